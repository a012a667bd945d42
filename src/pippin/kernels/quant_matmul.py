"""W4A16 / W8A16: products with MLX's affine-quantised weights on tensor cores (CUDA).

MLX's CUDA `quantized_matmul` reads each packed weight once but multiplies on the CUDA
cores, one row at a time: on an H100 a 4-bit 8B model decoding 64 streams took 212 ms a
step against bf16's 15 ms. This kernel keeps MLX's packing as it is (no repacking: the
weights stay shared with the checkpoint, LoRA, sleep mode and the fused projections) and
runs `mma.sync.m16n8k16` with the weights dequantised in registers, as Marlin does.

The trick that makes MLX's layout fit the MMA fragments without shuffles: a reduction does
not care which k meets which, only that the activation and the weight of one k meet. So
each thread takes whole packed words: lane (g, t) of a warp (g = lane / 4, t = lane % 4)
reads, per iteration, one 16-byte load of output column n = g's row (32 k for 4 bits, 16
for 8), and the matching 16 bytes of each activation row. A 4-bit word's nibble pairs
(p, p+4), masked as `word >> 4p & 0x000F000F` and or-ed into a bf16/fp16 exponent
(Marlin's magic number), are exactly one B-fragment register; the activations are
permuted the same way with one `prmt` per register. Each word's eight k lie in one
quantisation group (group sizes 32, 64, 128), so a thread needs one scale and bias per
column per iteration.

A block is WK warps over 8 * NT output columns and 16 * MT rows; the warps split K and add
their parts through shared memory. The weights of the next iteration are loaded before the
current one is multiplied. `staged` (XS, for measuring until a GPU run picks it) also copies
each warp's next tile of x into shared memory with `cp.async`, where otherwise every lane
loads its activations from global memory just before the MMAs that take them. Past
`DENSE_ROWS` rows (prompt chunks) the weight is unpacked into the model's dtype and cuBLAS
multiplies (`dense_quant`).

`qmm` is the product; `applies` says where the kernel takes a layer (CUDA, affine mode,
4 or 8 bits, group size 32/64/128, bf16/fp16 activations and scales; or MXFP4, as
gpt-oss ships its experts: E2M1 nibbles, one power-of-two exponent per 32, bf16
activations, each nibble pair looked up by `pippin_fp4_pair`). K need not fill the last
iteration (gpt-oss's 2,880 is 22.5 of 128): lanes past it load zeros. Elsewhere MLX's own
`quantized_matmul` runs. The result differs from MLX's only by rounding (each
dequantised weight is rounded to the activations' dtype, sums are fp32).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import device

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DTYPES = (mx.bfloat16, mx.float16)
GRID_Y = 65_535  # CUDA's most blocks along y
MAX_ROWS = 256  # the kernel's rows; the caller takes the dense product above its own bound
_SMS = 132  # streaming multiprocessors of an H100 (H200 too): enough blocks to fill them
_SMEM_LIMIT = 48 * 1024

# E2M1's eight magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) as bf16 bits, the low and the high
# byte of each: the tables `pippin_fp4_pair` looks them up in, four bytes to a word.
FP4_BF16 = (0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0)


def _words(octets: list[int]) -> tuple[int, int]:
    """Eight bytes as two little-endian words: prmt's bytes 0-3 and 4-7."""
    lo, hi = (int.from_bytes(bytes(octets[i : i + 4]), "little") for i in (0, 4))
    return lo, hi


FP4_LO = _words([b & 0xFF for b in FP4_BF16])
FP4_HI = _words([b >> 8 for b in FP4_BF16])

HEADER = (
    "".join(
        f"#define FP4_{name}_{half} 0x{word:08X}u\n"
        for name, table in (("LO", FP4_LO), ("HI", FP4_HI))
        for half, word in zip("AB", table)
    )
    + r"""
// Dequantise, per dtype: 4-bit pairs through the exponent trick, 8-bit through fp32.
__device__ __forceinline__ uint32_t pippin_q4_pair(uint32_t word, int p, __nv_bfloat16 s,
                                                   __nv_bfloat16 b) {
    uint32_t v = ((word >> (4 * p)) & 0x000F000Fu) | 0x43004300u;  // 128 + q, exactly
    __nv_bfloat162 q = *reinterpret_cast<__nv_bfloat162*>(&v);
    q = __hsub2(q, __nv_bfloat162(__float2bfloat16(128.f), __float2bfloat16(128.f)));
    __nv_bfloat162 r = __hfma2(q, __nv_bfloat162(s, s), __nv_bfloat162(b, b));
    return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t pippin_q4_pair(uint32_t word, int p, __half s, __half b) {
    uint32_t v = ((word >> (4 * p)) & 0x000F000Fu) | 0x64006400u;  // 1024 + q, exactly
    __half2 q = *reinterpret_cast<__half2*>(&v);
    q = __hsub2(q, __half2(__float2half(1024.f), __float2half(1024.f)));
    __half2 r = __hfma2(q, __half2(s, s), __half2(b, b));
    return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ float pippin_byte(uint32_t word, int p) {
    return __uint_as_float(0x4B000000u | ((word >> (8 * p)) & 0xFFu)) - 8388608.f;
}
__device__ __forceinline__ uint32_t pippin_pack(float lo, float hi, __nv_bfloat16) {
    __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t pippin_pack(float lo, float hi, __half) {
    __half2 r = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&r);
}
// MXFP4 (bf16 activations): nibbles p and p + 4 of `word` (E2M1: sign, 2-bit exponent,
// 1-bit mantissa) as a bf16 pair times s. Each magnitude's bf16 bits come from two byte
// lookups (prmt over 8-entry tables, FP4_LO / FP4_HI); the sign goes to bit 15.
__device__ __forceinline__ uint32_t pippin_fp4_pair(uint32_t word, int p, __nv_bfloat16 s) {
    const uint32_t v = (word >> (4 * p)) & 0x00070007u;  // the magnitudes, bits 0-2, 16-18
    const uint32_t lo = __byte_perm(FP4_LO_A, FP4_LO_B, v | (v >> 8));  // bytes 0, 2
    const uint32_t hi = __byte_perm(FP4_HI_A, FP4_HI_B, (v << 4) | (v >> 4));  // bytes 1, 3
    uint32_t bits = lo | hi | ((word << (12 - 4 * p)) & 0x80008000u);
    __nv_bfloat162 q = *reinterpret_cast<__nv_bfloat162*>(&bits);
    q = __hmul2(q, __nv_bfloat162(s, s));  // exact: 3 significant bits times a power of 2
    return *reinterpret_cast<uint32_t*>(&q);
}
// A group's scale as the activations' dtype: itself (affine), or for an MXFP4 exponent
// byte e, 2^(e - 127) (bf16 shares fp32's exponent; e = 0 is the subnormal 2^-127).
template <typename T>
__device__ __forceinline__ T pippin_scale(T s) { return s; }
__device__ __forceinline__ __nv_bfloat16 pippin_scale(uint8_t e) {
    return __ushort_as_bfloat16(e ? (unsigned short)(e << 7) : (unsigned short)0x0040u);
}
// Round r of one lane's 16-byte load (`words`, one scale and bias) as four registers of
// weight pairs (k, k + 4): 8 k of 4-bit words[r], or of 8-bit words[2r] and words[2r + 1].
// MX: MXFP4 (4 bits, no bias).
template <int BITS, bool MX, typename T>
__device__ __forceinline__ void pippin_dequant(const uint32_t* words, int r, T s, T b,
                                               uint32_t* out) {
    if constexpr (MX) {
        #pragma unroll
        for (int p = 0; p < 4; ++p) out[p] = pippin_fp4_pair(words[r], p, s);
    } else if (BITS == 4) {
        #pragma unroll
        for (int p = 0; p < 4; ++p) out[p] = pippin_q4_pair(words[r], p, s, b);
    } else {
        const float fs = static_cast<float>(s);
        const float fb = static_cast<float>(b);
        const uint32_t lo = words[2 * r];
        const uint32_t hi = words[2 * r + 1];
        #pragma unroll
        for (int p = 0; p < 4; ++p)
            out[p] = pippin_pack(fmaf(pippin_byte(lo, p), fs, fb),
                                 fmaf(pippin_byte(hi, p), fs, fb), T());
    }
}
// XS: where 16-byte chunk `ch` of a staged row of x sits in shared memory. A quarter warp's
// reads (rows g = 0, 1; spans t = 0-3) and each 8 lanes' copies then fall in 8 different
// bank groups: the span's high bit moves 4-bit rows' chunks 8-15 by two, odd rows by one.
__device__ __forceinline__ int pippin_xs_chunk(int row, int ch) {
    return ch ^ (((ch >> 3) & 1) << 1) ^ (row & 1);
}
__device__ __forceinline__ void pippin_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                           uint32_t a3, uint32_t b0, uint32_t b1,
                                           __nv_bfloat16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void pippin_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                           uint32_t a3, uint32_t b0, uint32_t b1, __half) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
"""
)

# Each kernel's first lines set: K, N, the tile's first row p0 and its rows' end p1, the
# expert's weights (wx, sx, bx), and where row p of the tile reads x (xrow_of) and writes
# out (orow_of). TILE, the rows of a block, comes before (`tile_rows`).
DENSE = r"""
    // x [M, K] (T), w [N, K * BITS / 32] (uint32), scales and biases [N, K / GS] (T;
    // MX: scales uint8, biases never read).
    const int K = x_shape[1];
    const int N = w_shape[0];
    const int p0 = blockIdx.y * TILE;
    const int p1 = x_shape[0];
    const uint32_t* wx = w;
    const auto* sx = scales;
    const auto* bx = biases;
    auto xrow_of = [](int p) { return p; };
    auto orow_of = [](int p) { return p; };
"""

# Mixture of experts: pairs (a token, one of its experts) sorted by expert (`ids`,
# ascending); block y = expert e * chunks + c takes the c-th TILE pairs of e. Blocks
# past an expert's pairs leave at once. Sorted pair p is the token's pair order[p]: with XG
# it reads x row order[p] / (P / rows of x) (the token's), else row p; with OG it writes
# out row order[p] (the pairs' own order), else row p.
GROUPED = r"""
    // x [R, K], w [E, N, K * BITS / 32], scales and biases [E, N, K / GS], ids [P].
    const int K = x_shape[1];
    const int N = w_shape[1];
    const int E = w_shape[0];
    const int P = ids_shape[0];
    const int div = P / x_shape[0];
    const int chunks = gridDim.y / E;
    const int e = blockIdx.y / chunks;
    int lo = 0, hi = P;  // [lb, ub): the pairs of expert e
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if ((int)ids[mid] < e) lo = mid + 1; else hi = mid;
    }
    const int lb = lo;
    hi = P;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if ((int)ids[mid] <= e) lo = mid + 1; else hi = mid;
    }
    const int p1 = lo;
    const int p0 = lb + (blockIdx.y % chunks) * TILE;
    if (p0 >= p1) return;  // the whole block: no barrier is reached
    const uint32_t* wx = w + (size_t)e * N * (K * BITS / 32);
    const auto* sx = scales + (size_t)e * N * (K / GS);
    const auto* bx = biases + (size_t)e * N * (K / GS);
    auto xrow_of = [&](int p) { return XG ? (int)order[p] / div : p; };
    auto orow_of = [&](int p) { return OG ? (int)order[p] : p; };
"""

_TILE = "    constexpr int TILE = 16 * MT;\n"

_CORE = r"""
    constexpr int SPAN = BITS == 4 ? 32 : 16;  // k of one thread's 16-byte load
    constexpr int KPI = 4 * SPAN;              // k of one warp iteration
    constexpr int ROUNDS = SPAN / 8;           // MMA pairs (k32) an iteration
    const int KW = K * BITS / 32;
    const int KG = K / GS;
    // K may end mid-iteration (gpt-oss: 2,880 = 22.5 x 128): a lane whose span starts past
    // K loads zeros, while every lane still runs the warp's MMAs.
    const int iters = (K + KPI - 1) / KPI;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int n0 = blockIdx.x * (8 * NT);

    float acc[MT][NT][4];
    #pragma unroll
    for (int i = 0; i < MT; ++i) {
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            #pragma unroll
            for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
        }
    }
    // Rows of x this lane reads (rows past the tile's read as zeros).
    const T* xrow[MT][2];
    bool xok[MT][2];
    // XS: each warp copies its iterations' tiles of x into shared memory (cp.async), the
    // next one in flight while the MMAs read the current one, rather than each lane
    // loading its activations from global memory just before the MMAs that take them.
    // Rows of x by tile row (-1 past the tile's rows); two stages of a warp's tile.
    constexpr int EPC = 16 / (int)sizeof(T);  // elements of a 16-byte chunk
    constexpr int CPR = KPI / EPC;             // chunks of a staged row
    __shared__ int xs_rows[XS ? TILE : 1];
    __shared__ __align__(16) T xs[XS ? WK * 2 * TILE * KPI : 8];
    if constexpr (XS) {
        for (int r = threadIdx.x; r < TILE; r += blockDim.x)
            xs_rows[r] = p0 + r < p1 ? xrow_of(p0 + r) : -1;
        __syncthreads();
    } else {
        #pragma unroll
        for (int i = 0; i < MT; ++i) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int p = p0 + i * 16 + h * 8 + g;
                xok[i][h] = p < p1;
                xrow[i][h] = x + (size_t)(xok[i][h] ? xrow_of(p) : 0) * K + SPAN * t;
            }
        }
    }
    // XS: iteration `i`'s tile into stage `st` (zeros past the rows and past K).
    auto stage = [&](int i, int st) {
        T* dst = xs + (warp * 2 + st) * TILE * KPI;
        for (int c = lane; c < TILE * CPR; c += 32) {
            const int row = c / CPR;
            const int ch = c % CPR;
            const int k = i * KPI + ch * EPC;
            const int src = xs_rows[row];
            const bool ok = src >= 0 && k < K;
            const T* from = x + (ok ? (size_t)src * K + k : 0);
            const uint32_t to = (uint32_t)__cvta_generic_to_shared(
                dst + row * KPI + pippin_xs_chunk(row, ch) * EPC);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                         :: "r"(to), "l"(from), "r"(ok ? 16 : 0));
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    const uint32_t* wrow[NT];
    decltype(sx) srow[NT];
    decltype(bx) brow[NT];
    bool nok[NT];
    #pragma unroll
    for (int j = 0; j < NT; ++j) {
        const int n = n0 + j * 8 + g;
        nok[j] = n < N;
        const size_t nn = nok[j] ? n : 0;
        wrow[j] = wx + nn * KW + (SPAN * t) * BITS / 32;
        srow[j] = sx + nn * KG + (SPAN * t) / GS;
        brow[j] = bx + nn * KG + (SPAN * t) / GS;
    }

    uint4 wq[NT];
    T sc[NT];
    T bi[NT];
    #pragma unroll
    for (int j = 0; j < NT; ++j) bi[j] = static_cast<T>(0.f);
    int it = warp;
    if constexpr (XS) {
        if (it < iters) stage(it, 0);
    }
    #pragma unroll
    for (int j = 0; j < NT; ++j) {
        if (nok[j] && it * KPI + SPAN * t < K) {
            wq[j] = *reinterpret_cast<const uint4*>(wrow[j] + it * (KPI * BITS / 32));
            sc[j] = pippin_scale(srow[j][it * KPI / GS]);
            if constexpr (!MX) bi[j] = brow[j][it * KPI / GS];
        } else {
            wq[j] = make_uint4(0u, 0u, 0u, 0u);
            sc[j] = static_cast<T>(0.f);
        }
    }
    for (int st = 0; it < iters; it += WK, st ^= 1) {
        if constexpr (XS) {
            if (it + WK < iters) {
                stage(it + WK, st ^ 1);
                asm volatile("cp.async.wait_group 1;\n" ::);
            } else {
                asm volatile("cp.async.wait_group 0;\n" ::);
            }
            __syncwarp();  // the warp's copies of this stage, seen by all its lanes
        }
        uint4 cw[NT];
        T cs[NT];
        T cb[NT];
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            cw[j] = wq[j];
            cs[j] = sc[j];
            cb[j] = bi[j];
        }
        const int nx = it + WK;  // the next iteration's weights, in flight while this one runs
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            if (nok[j] && nx * KPI + SPAN * t < K) {
                wq[j] = *reinterpret_cast<const uint4*>(wrow[j] + nx * (KPI * BITS / 32));
                sc[j] = pippin_scale(srow[j][nx * KPI / GS]);
                if constexpr (!MX) bi[j] = brow[j][nx * KPI / GS];
            } else {
                wq[j] = make_uint4(0u, 0u, 0u, 0u);
                sc[j] = bi[j] = static_cast<T>(0.f);
            }
        }
        #pragma unroll
        for (int r = 0; r < ROUNDS; ++r) {
            // Activations of k (8 of this lane's span) for both row halves of each tile,
            // as the pairs (e, e + 4) the weights give.
            uint32_t a[MT][2][4];
            #pragma unroll
            for (int i = 0; i < MT; ++i) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    uint4 v = make_uint4(0u, 0u, 0u, 0u);
                    if constexpr (XS) {
                        const int row = i * 16 + h * 8 + g;
                        v = *reinterpret_cast<const uint4*>(
                            xs + ((warp * 2 + st) * TILE + row) * KPI +
                            pippin_xs_chunk(row, (SPAN / EPC) * t + r) * EPC);
                    } else if (xok[i][h] && it * KPI + SPAN * t < K) {
                        v = *reinterpret_cast<const uint4*>(xrow[i][h] + it * KPI + 8 * r);
                    }
                    a[i][h][0] = __byte_perm(v.x, v.z, 0x5410);
                    a[i][h][1] = __byte_perm(v.x, v.z, 0x7632);
                    a[i][h][2] = __byte_perm(v.y, v.w, 0x5410);
                    a[i][h][3] = __byte_perm(v.y, v.w, 0x7632);
                }
            }
            #pragma unroll
            for (int j = 0; j < NT; ++j) {
                const uint32_t* words = reinterpret_cast<const uint32_t*>(&cw[j]);
                uint32_t b[4];
                pippin_dequant<BITS, MX>(words, r, cs[j], cb[j], b);
                #pragma unroll
                for (int i = 0; i < MT; ++i) {
                    pippin_mma(acc[i][j], a[i][0][0], a[i][1][0], a[i][0][1], a[i][1][1],
                               b[0], b[1], T());
                    pippin_mma(acc[i][j], a[i][0][2], a[i][1][2], a[i][0][3], a[i][1][3],
                               b[2], b[3], T());
                }
            }
        }
        if constexpr (XS) __syncwarp();  // read: the stage may take the iteration after next
    }

    // The warps' parts of K, added through shared memory; then each thread writes some.
    constexpr int PER = MT * NT * 4;
    __shared__ float part[WK * PER * 32];
    #pragma unroll
    for (int i = 0; i < MT; ++i) {
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            #pragma unroll
            for (int c = 0; c < 4; ++c)
                part[(warp * PER + (i * NT + j) * 4 + c) * 32 + lane] = acc[i][j][c];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < PER * 32; e += WK * 32) {
        float sum = 0.f;
        #pragma unroll
        for (int v = 0; v < WK; ++v) sum += part[v * PER * 32 + e];
        const int ln = e & 31;
        const int idx = e >> 5;  // (i * NT + j) * 4 + c
        const int c = idx & 3;
        const int j = (idx >> 2) % NT;
        const int i = (idx >> 2) / NT;
        const int p = p0 + i * 16 + (ln >> 2) + (c >> 1) * 8;
        const int col = n0 + j * 8 + (ln & 3) * 2 + (c & 1);
        if (p < p1 && col < N) out[(size_t)orow_of(p) * N + col] = static_cast<T>(sum);
    }
"""


def applies(layer: nn.Module, dtype: mx.Dtype) -> bool:
    """Whether the kernel computes `layer` (an `nn.QuantizedLinear`, or mlx-lm's
    `QuantizedSwitchLinear` of stacked experts) for activations of `dtype`: MLX affine
    (4 or 8 bits, group size 32/64/128, scales and biases of `dtype`) or MXFP4 (bf16)."""
    mode = getattr(layer, "mode", "affine")
    if "scales" not in layer or layer.get("global_scale") is not None:
        return False
    if dtype != activations(layer):
        return False
    if mode == "mxfp4":
        if (layer.bits, layer.group_size) != (4, 32):
            return False
    elif mode == "affine":
        if getattr(layer, "bits", None) not in BITS or dtype not in DTYPES:
            return False
        if getattr(layer, "group_size", None) not in GROUP_SIZES:
            return False
        if layer.get("biases") is None or layer["biases"].dtype != dtype:
            return False
    else:
        return False
    return in_features(layer) % (128 // layer.bits) == 0  # a lane's 16-byte load: 32 k, 16


def in_features(layer: nn.Module) -> int:
    """K of a quantised layer (or of each of its stacked experts), from its packed words."""
    return layer["weight"].shape[-1] * 32 // layer.bits


def iterations(k: int, bits: int) -> int:
    """A warp's iterations over K (the matvec form's steps): 128 k each at 4 bits, 64 at 8;
    the last one partial where K ends mid-iteration."""
    return -(-k // (512 // bits))


def activations(layer: nn.Module) -> mx.Dtype:
    """The activations' dtype the kernel would compute `layer` for: its scales' (affine),
    bf16 (MXFP4: uint8 exponents for scales; `pippin_fp4_pair` gives bf16)."""
    scales = layer["scales"]
    return mx.bfloat16 if scales.dtype == mx.uint8 else scales.dtype


def plan(m: int, n: int, k: int, bits: int, row_blocks: int = 0) -> tuple[int, int, int]:
    """(MT, NT, WK): row tiles of 16 per block, column tiles of 8 per warp, warps per block
    splitting K, for `m` rows (of one expert) and `row_blocks` blocks along the rows (by
    default those m rows need). Few rows: a block per 32 columns and up to 8 warps on
    K, so that the weights stream from enough warps to fill the memory system; many rows:
    64 rows a block, the weights re-read per 64 rows from L2."""
    mt = 1 if m <= 16 else 2 if m <= 32 else 4
    # NT 4 throughout: at 16 rows 1.2-1.3x NT 2 on the 8B shape's q/k/v and down (H100,
    # 2026-12-08, two sweeps), where NT 2 had been taken below 8,448 columns.
    nt = 4
    blocks = -(-n // (8 * nt)) * (row_blocks or -(-m // (16 * mt)))
    wk = 8 if blocks < 2 * _SMS else 4 if blocks < 4 * _SMS else 2
    while wk > 1 and not fits((mt, nt, wk), k, bits):
        wk //= 2
    return mt, nt, wk


def fits(tiles: tuple[int, int, int], k: int, bits: int, staged: bool = False) -> bool:
    """Whether tiling (MT, NT, WK) builds and has work for every warp: the warps' partial
    sums (and, `staged`, two stages of each warp's tile of x and the tile's row numbers)
    within the static shared memory, no more warps than iterations of K."""
    mt, nt, wk = tiles
    smem = wk * mt * nt * 4 * 32 * 4
    if staged:
        smem += wk * 2 * 16 * mt * (512 // bits) * 2 + 16 * mt * 4
    return wk <= iterations(k, bits) and smem <= _SMEM_LIMIT


def _template(
    dtype: mx.Dtype,
    bits: int,
    group_size: int,
    mxfp4: bool,
    tiles: tuple[int, int, int],
    staged: bool = False,
) -> list[tuple[str, object]]:
    mt, nt, wk = tiles
    return [
        ("T", dtype),
        ("BITS", bits),
        ("GS", group_size),
        ("MX", mxfp4),
        ("MT", mt),
        ("NT", nt),
        ("WK", wk),
        ("XS", staged),
    ]


def packing(scales: mx.array, biases: mx.array | None) -> tuple[mx.array, bool]:
    """(the kernels' `biases` input, MX): MXFP4 weights (uint8 exponents for scales) have
    no biases, so their scales stand in (never read)."""
    mxfp4 = scales.dtype == mx.uint8
    return scales if biases is None else biases, mxfp4


def qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    tiles: tuple[int, int, int] | None = None,
    staged: bool = False,
) -> mx.array:
    """`x @ dequantize(w).T` for x [..., K] of at most `MAX_ROWS` rows; `tiles` (MT, NT, WK)
    instead of `plan`'s and `staged` (x through shared memory, `fits`) for measuring
    (`bench/gpu/quant_matmul.py --sweep`)."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], w.shape[0]
    mt, nt, wk = tiles or plan(m, n, k, bits)
    biases, mxfp4 = packing(scales, biases)
    kernel = device.cuda_kernel(
        "pippin_quant_matmul", ("x", "w", "scales", "biases"), _TILE + DENSE + _CORE, HEADER
    )
    (out,) = kernel(
        inputs=[x2, w, scales, biases],
        template=_template(x.dtype, bits, group_size, mxfp4, (mt, nt, wk), staged),
        grid=(-(-n // (8 * nt)) * 32 * wk, -(-m // (16 * mt)), 1),
        threadgroup=(32 * wk, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*lead, n)


def sort_pairs(indices: mx.array) -> tuple[mx.array, mx.array]:
    """(ids, order): the experts of `indices` [..., top_k] flattened and sorted, and the
    flat pair each sorted one came from; what `gather_qmm` takes."""
    flat = indices.reshape(-1)
    order = mx.argsort(flat)
    return flat[order], order


def expert_rows(p: int, e: int) -> int:
    """The rows to plan an expert's product for, of `p` pairs over `e` experts: about 4x
    the mean (a router spreads tokens unevenly)."""
    return 4 * p // e + 1


def gather_plan(p: int, e: int, n: int, k: int, bits: int, tokens: int) -> tuple[int, ...]:
    """`plan` for `p` pairs over `e` experts (`expert_rows`; blocks busy: one per expert
    with pairs), and the chunks of 16 * MT pairs per expert that `tokens` (an expert's
    most pairs) need."""
    mt, nt, wk = plan(expert_rows(p, e), n, k, bits, row_blocks=min(e, p))
    return mt, nt, wk, -(-tokens // (16 * mt))


def gather_fits(p: int, e: int, n: int, k: int, bits: int, tokens: int) -> bool:
    """Whether `gather_qmm`'s blocks for `p` pairs over `e` experts fit CUDA's grid: a row
    of blocks per expert and chunk of its pairs, at most 65,535 rows (512 experts and a
    8,192-token chunk would need 65,536)."""
    return e * gather_plan(p, e, n, k, bits, tokens)[3] <= GRID_Y


def gather_qmm(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    ids: mx.array,
    order: mx.array,
    tokens: int,
    group_size: int,
    bits: int,
    gather_x: bool,
    scatter_out: bool,
) -> mx.array:
    """The experts' products for the pairs of `sort_pairs`: row p of the result (in sorted
    order, or with `scatter_out` in the pairs' own order) is `x_r @ dequantize(w[ids[p]]).T`,
    x_r being x's row of pair p's token (`gather_x`: x holds one row per token) or x's row
    p (x holds one row per sorted pair). `tokens` bounds the pairs of one expert."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    p, (e, n) = ids.size, w.shape[:2]
    mt, nt, wk, chunks = gather_plan(p, e, n, k, bits, tokens)
    biases, mxfp4 = packing(scales, biases)
    kernel = device.cuda_kernel(
        "pippin_gather_quant_matmul",
        ("x", "w", "scales", "biases", "ids", "order"),
        _TILE + GROUPED + _CORE,
        HEADER,
    )
    (out,) = kernel(
        inputs=[x2, w, scales, biases, ids, order],
        template=[
            *_template(x.dtype, bits, group_size, mxfp4, (mt, nt, wk)),
            ("XG", gather_x),
            ("OG", scatter_out),
        ],
        grid=(-(-n // (8 * nt)) * 32 * wk, e * chunks, 1),
        threadgroup=(32 * wk, 1, 1),
        output_shapes=[(p, n)],
        output_dtypes=[x.dtype],
    )
    return out


def warm(layers: list[nn.Module], rows: int) -> int:
    """Build now every template `qmm` would take for `layers` (`nn.QuantizedLinear`s the
    kernel applies to) at 1 to `rows` - 1 rows: each build takes NVRTC a fraction of a
    second, which a batch of a new size would otherwise wait for mid-serving (MLX builds a
    template once, for every layer). How many products ran."""
    seen: set[tuple] = set()
    for layer in layers:
        n, k = layer["weight"].shape[0], in_features(layer)
        dtype = layer["scales"].dtype
        for m in range(1, min(rows, MAX_ROWS + 1)):
            key = (dtype, layer.bits, layer.group_size, plan(m, n, k, layer.bits))
            if key not in seen:
                seen.add(key)
                mx.eval(layer_qmm(layer, mx.zeros((m, k), dtype=dtype)))
    return len(seen)


def layer_qmm(layer: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """`layer(x)` through `qmm` (its bias added after)."""
    y = qmm(x, layer["weight"], layer["scales"], layer.get("biases"), layer.group_size, layer.bits)
    return y + layer["bias"] if "bias" in layer else y
