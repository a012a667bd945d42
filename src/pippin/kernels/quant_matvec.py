"""W4A16 / W8A16 products of 1-16 rows (decode) on tensor cores, the weights as the MMA's
A operand (CUDA).

`quant_matmul` gives the activations the MMA's 16-row A operand and the weights its 8-column
B operand, so at one row 15 of the 16 rows are padding, each MMA covers 128 weights and the
loop does little loading per instruction. At 1-16 rows (a decode step of a few streams) the
roles swap here, as TensorRT-LLM's and vLLM's small-batch paths do: a warp's MMA
`m16n8k16` takes 16 output columns of dequantised weights as A (256 weights an MMA) and
8 activation rows as B (two MMAs per A past 8 rows: `NB`). The dequantisation and the
pairing of packed words with activations are `quant_matmul`'s (its header): lane (g, t)
takes columns g and g + 8 of its block, 16 bytes of each a step, and the activations of
the same k for rows g (and 8 + g).

A block is WK warps on 16 * CT columns, splitting K; each warp loads the weights, scales
and activations of U steps before it multiplies any of them, so that enough bytes are in flight
to keep the memory system busy (one step at a time left a 4-bit 8B decode at about a third
of the H100's bandwidth). The warps' sums meet in shared memory.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import device
from pippin.kernels.quant_matmul import (
    DENSE,
    GROUPED,
    HEADER,
    expert_rows,
    in_features,
    iterations,
    packing,
)

MAX_ROWS = 16  # two of the MMA's 8-column B operands
_NORM_SHARED = 32 * 1024  # bytes of normalised rows `fused` keeps in shared memory
# Dense layers' rows up to which this form beats `quant_matmul` (H100, 8B shape: at 16 rows
# the matmul form took 0.342 ms over the five projections, this form 0.372 at its best).
DENSE_ROWS = 8
# Rows up to which MLX's own quantised product beats this form, by bits: its one-row
# `qmv` at 8 bits (H100, 2026-12-07, 8B shape, one stream in-process: 178.6 tok/s with
# MLX's product, 155.0 with this form; gpt-oss-20b, 8-bit outside its experts: 113.7
# against 76.6). At 16 rows MLX's product gave 290 tok/s against this kernel's 2,099.
MLX_ROWS = {8: 1}

# After `quant_matmul`'s prologues (DENSE, GROUPED): rows p0 to p1 (at most TILE) of x.
_TILE = "    constexpr int TILE = 8 * NB;\n"
# The plain products: no norm before, no SwiGLU, bias or residual after (`fused` takes
# them as template arguments).
_PLAIN = (
    "    constexpr bool NORM = false, SWIGLU = false, BIAS = false, RES = false;\n"
    "    constexpr int XS = 0;\n"
    "    const float* eps = nullptr;\n"
    "    const T* norm_w = nullptr;\n"
    "    const T* bias = nullptr;\n"
    "    const T* res = nullptr;\n"
)

# A fused decode layer's projection (`fused`): the input RMSNorm'd as it is loaded
# (rounded where MLX's `rms_norm` rounds), SwiGLU over the gate's rows [0, N/2) and the
# up's [N/2, N) (a warp's 16 weight columns are 8 of each, so lane (g, t) holds gate and
# up of one feature), the bias and the residual added as mlx-lm adds them.
_NORM = r"""
template <typename T>
__device__ __forceinline__ uint4 pippin_rms8(uint4 v, uint4 gw, float inv) {
    T* e = reinterpret_cast<T*>(&v);
    const T* w = reinterpret_cast<const T*>(&gw);
    #pragma unroll
    for (int i = 0; i < 8; ++i) {
        const T y = static_cast<T>(static_cast<float>(e[i]) * inv);
        e[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(y));
    }
    return v;
}
"""

_CORE = r"""
    constexpr int SPAN = BITS == 4 ? 32 : 16;  // k of one lane's 16-byte load
    constexpr int KPS = 4 * SPAN;              // k of one warp step
    constexpr int ROUNDS = SPAN / 8;           // MMA pairs (k32) a step
    const int KW = K * BITS / 32;
    const int KG = K / GS;
    const int steps = (K + KPS - 1) / KPS;  // K may end mid-step, as in quant_matmul
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;
    const int t = lane & 3;
    // Column tile c of the warp: columns na[c] = 16 c + g and nb[c] = na[c] + 8 of the
    // block's 16 * CT; the tiles share the activations' loads.
    // With SWIGLU a tile is 8 output features: the gate's rows na[c] and the up's nb[c].
    constexpr int FW = SWIGLU ? 8 : 16;
    const int NO = SWIGLU ? N / 2 : N;  // output features
    int na[CT], nb[CT];
    bool oka[CT], okb[CT];
    const uint32_t* wa[CT];
    const uint32_t* wb[CT];
    decltype(sx) sa[CT];
    decltype(bx) ba[CT];
    decltype(sx) sb[CT];
    decltype(bx) bb[CT];
    #pragma unroll
    for (int c = 0; c < CT; ++c) {
        na[c] = (blockIdx.x * CT + c) * FW + g;
        nb[c] = SWIGLU ? na[c] + NO : na[c] + 8;
        oka[c] = na[c] < NO;
        okb[c] = SWIGLU ? oka[c] : nb[c] < N;
        const size_t ra = oka[c] ? na[c] : 0;
        const size_t rb = okb[c] ? nb[c] : 0;
        wa[c] = wx + ra * KW + SPAN * t * BITS / 32;
        wb[c] = wx + rb * KW + SPAN * t * BITS / 32;
        sa[c] = sx + ra * KG;
        ba[c] = bx + ra * KG;
        sb[c] = sx + rb * KG;
        bb[c] = bx + rb * KG;
    }
    // Rows g and (NB = 2) 8 + g of x: this lane's B operands.
    bool xok[NB];
    const T* xr[NB];
    #pragma unroll
    for (int j = 0; j < NB; ++j) {
        xok[j] = p0 + 8 * j + g < p1;
        xr[j] = x + (size_t)(xok[j] ? xrow_of(p0 + 8 * j + g) : 0) * K + SPAN * t;
    }
    // NORM: each row's 1 / rms, every warp summing a share of every row's squares in
    // 16-byte loads (all in flight at once: this runs before any weight is loaded).
    __shared__ float part_ss[NORM ? WK * TILE : 1];
    __shared__ float inv_rms[NORM ? TILE : 1];
    if (NORM) {
        #pragma unroll
        for (int r = 0; r < TILE; ++r) {
            float ss = 0.f;
            if (p0 + r < p1) {  // the same for the whole block
                const T* xp = x + (size_t)xrow_of(p0 + r) * K;
                #pragma unroll 4
                for (int k = (warp * 32 + lane) * 8; k < K; k += WK * 256) {
                    const uint4 raw = *reinterpret_cast<const uint4*>(xp + k);
                    const T* e = reinterpret_cast<const T*>(&raw);
                    #pragma unroll
                    for (int i = 0; i < 8; ++i) {
                        const float v = static_cast<float>(e[i]);
                        ss += v * v;
                    }
                }
            }
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
            if (lane == 0) part_ss[warp * TILE + r] = ss;
        }
        __syncthreads();
        if (threadIdx.x < TILE) {
            float ss = 0.f;
            #pragma unroll
            for (int v = 0; v < WK; ++v) ss += part_ss[v * TILE + threadIdx.x];
            inv_rms[threadIdx.x] = rsqrtf(ss / K + eps[0]);
        }
        __syncthreads();
    }
    // XS: the block's rows normalised once into shared memory, which the loop then reads
    // (else each lane normalises what it loads, inside the loop).
    __shared__ __align__(16) T xsh[XS > 0 ? XS : 8];
    if (NORM && XS > 0) {
        const int rows = min(p1 - p0, TILE);
        for (int i = threadIdx.x * 8; i < rows * K; i += 32 * WK * 8) {
            const int r = i / K;
            const int k = i - r * K;
            const uint4 v = *reinterpret_cast<const uint4*>(x + (size_t)xrow_of(p0 + r) * K + k);
            const uint4 gw = *reinterpret_cast<const uint4*>(norm_w + k);
            *reinterpret_cast<uint4*>(xsh + i) = pippin_rms8<T>(v, gw, inv_rms[r]);
        }
        __syncthreads();
        #pragma unroll
        for (int j = 0; j < NB; ++j) xr[j] = xsh + (xok[j] ? 8 * j + g : 0) * K + SPAN * t;
    }
    const T zero = static_cast<T>(0.f);
    const uint4 none = make_uint4(0u, 0u, 0u, 0u);

    float acc[CT][NB][4];
    #pragma unroll
    for (int c = 0; c < CT; ++c) {
        #pragma unroll
        for (int j = 0; j < NB; ++j) {
            #pragma unroll
            for (int e = 0; e < 4; ++e) acc[c][j][e] = 0.f;
        }
    }
    for (int s0 = warp; s0 < steps; s0 += WK * U) {
        uint4 qa[U][CT], qb[U][CT];
        T csa[U][CT], cba[U][CT], csb[U][CT], cbb[U][CT];
        uint4 xv[U][NB][ROUNDS];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int s = s0 + u * WK;
            const bool in = s * KPS + SPAN * t < K;  // this lane's span: K's tail
            const int gi = (s * KPS + SPAN * t) / GS;
            #pragma unroll
            for (int c = 0; c < CT; ++c) {
                qa[u][c] = qb[u][c] = none;
                csa[u][c] = cba[u][c] = csb[u][c] = cbb[u][c] = zero;
                if (in && oka[c]) {
                    qa[u][c] = *reinterpret_cast<const uint4*>(wa[c] + s * (KPS * BITS / 32));
                    csa[u][c] = pippin_scale(sa[c][gi]);
                    if constexpr (!MX) cba[u][c] = ba[c][gi];
                }
                if (in && okb[c]) {
                    qb[u][c] = *reinterpret_cast<const uint4*>(wb[c] + s * (KPS * BITS / 32));
                    csb[u][c] = pippin_scale(sb[c][gi]);
                    if constexpr (!MX) cbb[u][c] = bb[c][gi];
                }
            }
            #pragma unroll
            for (int j = 0; j < NB; ++j) {
                #pragma unroll
                for (int r = 0; r < ROUNDS; ++r)
                    xv[u][j][r] = in && xok[j]
                        ? *reinterpret_cast<const uint4*>(xr[j] + s * KPS + 8 * r)
                        : none;
            }
            if (NORM && XS == 0 && in) {
                #pragma unroll
                for (int r = 0; r < ROUNDS; ++r) {
                    const uint4 gw =
                        *reinterpret_cast<const uint4*>(norm_w + s * KPS + SPAN * t + 8 * r);
                    #pragma unroll
                    for (int j = 0; j < NB; ++j)
                        xv[u][j][r] = pippin_rms8<T>(xv[u][j][r], gw, inv_rms[8 * j + g]);
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            if (s0 + u * WK < steps) {  // the same for the whole warp
                #pragma unroll
                for (int c = 0; c < CT; ++c) {
                    const uint32_t* wda = reinterpret_cast<const uint32_t*>(&qa[u][c]);
                    const uint32_t* wdb = reinterpret_cast<const uint32_t*>(&qb[u][c]);
                    #pragma unroll
                    for (int r = 0; r < ROUNDS; ++r) {
                        uint32_t pa[4], pb[4];
                        pippin_dequant<BITS, MX>(wda, r, csa[u][c], cba[u][c], pa);
                        pippin_dequant<BITS, MX>(wdb, r, csb[u][c], cbb[u][c], pb);
                        #pragma unroll
                        for (int j = 0; j < NB; ++j) {
                            // The activations of k (8 of this lane's span) as the pairs
                            // (e, e + 4) the weights give.
                            const uint4 v = xv[u][j][r];
                            pippin_mma(acc[c][j], pa[0], pb[0], pa[1], pb[1],
                                       __byte_perm(v.x, v.z, 0x5410),
                                       __byte_perm(v.x, v.z, 0x7632), T());
                            pippin_mma(acc[c][j], pa[2], pb[2], pa[3], pb[3],
                                       __byte_perm(v.y, v.w, 0x5410),
                                       __byte_perm(v.y, v.w, 0x7632), T());
                        }
                    }
                }
            }
        }
    }

    // acc[c][j]: (column na[c], rows 8j + 2t and 8j + 2t + 1), then (column nb[c], the
    // same rows).
    constexpr int PER = CT * NB * 4;
    if (WK > 1) {
        __shared__ float part[WK * PER * 32];
        #pragma unroll
        for (int c = 0; c < CT; ++c) {
            #pragma unroll
            for (int j = 0; j < NB; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e)
                    part[(warp * PER + (c * NB + j) * 4 + e) * 32 + lane] = acc[c][j][e];
            }
        }
        __syncthreads();
        if (warp != 0) return;
        #pragma unroll
        for (int c = 0; c < CT; ++c) {
            #pragma unroll
            for (int j = 0; j < NB; ++j) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float sum = 0.f;
                    #pragma unroll
                    for (int v = 0; v < WK; ++v)
                        sum += part[(v * PER + (c * NB + j) * 4 + e) * 32 + lane];
                    acc[c][j][e] = sum;
                }
            }
        }
    }
    #pragma unroll
    for (int c = 0; c < CT; ++c) {
        #pragma unroll
        for (int j = 0; j < NB; ++j) {
            #pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int p = p0 + 8 * j + 2 * t + h;
                if (p < p1) {
                    const size_t o = (size_t)orow_of(p) * NO;
                    if (SWIGLU) {  // rounded where mlx-lm's MLP rounds
                        if (oka[c]) {
                            const T gate = static_cast<T>(acc[c][j][h]);
                            const T up = static_cast<T>(acc[c][j][2 + h]);
                            const float gf = static_cast<float>(gate);
                            const T sig = static_cast<T>(1.f / (1.f + __expf(-gf)));
                            const T act = static_cast<T>(gf * static_cast<float>(sig));
                            out[o + na[c]] = static_cast<T>(
                                static_cast<float>(act) * static_cast<float>(up));
                        }
                    } else {
                        #pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            const int n = half ? nb[c] : na[c];
                            if (!(half ? okb[c] : oka[c])) continue;
                            T y = static_cast<T>(acc[c][j][2 * half + h]);
                            if (BIAS)
                                y = static_cast<T>(static_cast<float>(y) +
                                                   static_cast<float>(bias[n]));
                            if (RES)
                                y = static_cast<T>(static_cast<float>(res[o + n]) +
                                                   static_cast<float>(y));
                            out[o + n] = y;
                        }
                    }
                }
            }
        }
    }
"""


Tiles = tuple[int, int, int]


def plan(k: int, bits: int, m: int = 1) -> Tiles:
    """(WK, U, CT) for `m` rows: warps per block splitting K, steps loaded at once per
    warp, column tiles of 16 per warp. Measured on an H100 (bench/gpu/quant_matmul.py
    --matvec, the 8B shape's five projections, weights read from memory, products chained,
    one column tile): 4 warps, one step at a time, came within 4% of each shape's best
    tiling at 1-4 rows and 7% at 8; past 8 rows, 2 warps two steps at a time. More column
    tiles (fewer loads of the activations per weight byte, which past a few rows may bound
    the product) are not measured yet."""
    wk, u = (4, 1) if m <= 8 else (2, 2)
    return min(wk, iterations(k, bits)), u, 1


def qmv(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    tiles: Tiles | None = None,
) -> mx.array:
    """`x @ dequantize(w).T` for x [..., K] of at most `MAX_ROWS` rows (the layers
    `quant_matmul.applies` to); `tiles` (WK, U, CT) instead of `plan`'s, for measuring."""
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], w.shape[0]
    wk, u, ct = tiles = tiles or plan(k, bits, m)
    biases, mxfp4 = packing(scales, biases)
    kernel = device.cuda_kernel(
        "pippin_quant_matvec",
        ("x", "w", "scales", "biases"),
        _TILE + _PLAIN + DENSE + _CORE,
        HEADER + _NORM,
    )
    (out,) = kernel(
        inputs=[x2, w, scales, biases],
        template=_template(x.dtype, bits, group_size, mxfp4, tiles, m),
        grid=(-(-n // (16 * ct)) * 32 * wk, 1, 1),
        threadgroup=(32 * wk, 1, 1),
        output_shapes=[(m, n)],
        output_dtypes=[x.dtype],
    )
    return out.reshape(*lead, n)


def fused(
    x: mx.array,
    layer: nn.QuantizedLinear,
    eps: mx.array,
    norm_weight: mx.array | None = None,
    swiglu: bool = False,
    res: mx.array | None = None,
) -> mx.array:
    """A fused decode layer's projection of x [B, K] (at most `MAX_ROWS` rows) in one
    launch: `layer(rms_norm(x, norm_weight, eps))` (or of x without `norm_weight`), with
    SwiGLU over the gate's and up's halves of its rows, plus `res` [B, N]. `eps` is a
    float32 [1] array."""
    m, k = x.shape
    n = layer["weight"].shape[0]
    bits, group_size = layer.bits, layer.group_size
    wk, u, ct = tiles = plan(k, bits, m)
    # The normalised rows in shared memory where they fit (rows padded to 1, 2, 4, 8).
    held = 1 << (m - 1).bit_length() if norm_weight is not None and m <= 8 else 0
    xs = held * k if held * k * x.dtype.size <= _NORM_SHARED else 0
    scales = layer["scales"]
    bias = layer.get("bias")
    width = n // 2 if swiglu else n
    kernel = device.cuda_kernel(
        "pippin_fused_quant_matvec",
        ("x", "w", "scales", "biases", "norm_w", "eps", "bias", "res"),
        _TILE + DENSE + _CORE,
        HEADER + _NORM,
    )
    (out,) = kernel(
        inputs=[
            x,
            layer["weight"],
            scales,
            layer["biases"],
            scales if norm_weight is None else norm_weight,  # never read when absent
            eps,
            scales if bias is None or swiglu else bias,
            scales if res is None else res,
        ],
        template=[
            *_template(x.dtype, bits, group_size, False, tiles, m),
            ("NORM", norm_weight is not None),
            ("SWIGLU", swiglu),
            ("BIAS", bias is not None and not swiglu),
            ("RES", res is not None),
            ("XS", xs),
        ],
        grid=(-(-width // ((8 if swiglu else 16) * ct)) * 32 * wk, 1, 1),
        threadgroup=(32 * wk, 1, 1),
        output_shapes=[(m, width)],
        output_dtypes=[x.dtype],
    )
    return out


def _template(
    dtype: mx.Dtype, bits: int, group_size: int, mxfp4: bool, tiles: Tiles, rows: int
) -> list[tuple[str, object]]:
    wk, u, ct = tiles
    nb = 1 if rows <= 8 else 2
    return [
        ("T", dtype),
        ("BITS", bits),
        ("GS", group_size),
        ("MX", mxfp4),
        ("WK", wk),
        ("U", u),
        ("CT", ct),
        ("NB", nb),
    ]


def gather_plan(p: int, e: int, k: int, bits: int, tokens: int) -> tuple[int, Tiles]:
    """(rows, tiles) `gather_qmv` takes for `p` pairs over `e` experts, `tokens` an
    expert's most pairs: the rows to plan for (`expert_rows`, no more than `tokens`)
    decide the tiling and 8 or 16 pairs a block (`moe_quant.warm` keys its templates on
    rows > 8 and the tiles)."""
    rows = min(tokens, expert_rows(p, e))
    return rows, plan(k, bits, rows)


def takes(p: int, e: int) -> bool:
    """Whether `gather_qmv` (rather than `quant_matmul.gather_qmm`) takes `p` pairs over
    `e` experts: an expert's rows (about 4x the mean, as `quant_matmul.gather_plan`
    reckons) within two 8-row operands."""
    return expert_rows(p, e) <= MAX_ROWS


def gather_qmv(
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
    """`quant_matmul.gather_qmm` in the matvec form: blocks of 8 or 16 pairs of one
    expert (`takes`), tiled by `gather_plan`."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    p, (e, n) = ids.size, w.shape[:2]
    rows, tiles = gather_plan(p, e, k, bits, tokens)
    wk, u, ct = tiles
    tile = 8 if rows <= 8 else 16
    biases, mxfp4 = packing(scales, biases)
    kernel = device.cuda_kernel(
        "pippin_gather_quant_matvec",
        ("x", "w", "scales", "biases", "ids", "order"),
        _TILE + _PLAIN + GROUPED + _CORE,
        HEADER + _NORM,
    )
    (out,) = kernel(
        inputs=[x2, w, scales, biases, ids, order],
        template=[
            *_template(x.dtype, bits, group_size, mxfp4, tiles, rows),
            ("XG", gather_x),
            ("OG", scatter_out),
        ],
        grid=(-(-n // (16 * ct)) * 32 * wk, e * -(-tokens // tile), 1),
        threadgroup=(32 * wk, 1, 1),
        output_shapes=[(p, n)],
        output_dtypes=[x.dtype],
    )
    return out


def layer_qmv(layer: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """`layer(x)` through `qmv` (its bias added after)."""
    y = qmv(x, layer["weight"], layer["scales"], layer.get("biases"), layer.group_size, layer.bits)
    return y + layer["bias"] if "bias" in layer else y


def warm(layers: list[nn.Module]) -> int:
    """Build now every template `qmv` takes for `layers` (as `quant_matmul.warm`); how many
    products ran."""
    seen: set[tuple] = set()
    for layer in layers:
        k = in_features(layer)
        dtype = layer["scales"].dtype
        key = (dtype, layer.bits, layer.group_size, plan(k, layer.bits))  # to DENSE_ROWS
        if key not in seen:
            seen.add(key)
            mx.eval(layer_qmv(layer, mx.zeros((1, k), dtype=dtype)))
    return len(seen)
