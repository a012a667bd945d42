"""Paged-attention decode: attention that reads KV straight from the block tables.

The portable path (`paged_cache.PagedLayerCache`) gathers every sequence's KV
out of the pool into a dense tensor each step, then calls MLX's fused
attention. On CUDA, a decode step (one new token per row) can instead run one
custom kernel per layer that walks each row's block table and attends to the
blocks where they lie: no gather, no dense copy, no mask array.

How it hooks in without touching the model classes: mlx-lm's attention layers
call the `scaled_dot_product_attention` bound in their own module.
`patches.route_attention` wraps that name in the model's modules; the wrapper runs the
kernel when the
layer's cache is a `PagedLayerCache` of a decode batch that opted in, composes a
prompt chunk's attention of plain ops where `prefill_attention` says so, and
otherwise calls the original. The gather path stays the fallback, and the
default wherever the kernel cannot run (CPU, Metal, models that call MLX's
attention directly, prefill).

Set `PIPPIN_PAGED_KERNEL=0` to turn the kernel off, `=1` to force it on for any
decode batch (the default: see `worth_it`).
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import device
from pippin.kernels.device import on_cuda

# The kernel gives each (row, KV head) one thread block and does not split a row's
# context, so a few rows of long context would leave most of the GPU idle: those
# take the gather path. Rows at or above MIN_ROWS, or contexts up to SOLO_CONTEXT
# tokens, take the kernel (for one row of a 512-token context it saves the
# gather, the mask and the unfused masked attention: about 200 ops per step).
MIN_ROWS = 16
SOLO_CONTEXT = 8192

# The kernel in three parts, so that `fused_attention` can put its own prologue (norms,
# RoPE, the KV write) in place of loading q: declarations, the q load, the attention.
SOURCE_HEAD = r"""
    // One thread block per (row, KV head); it serves the G query heads of that KV head.
    // Each warp takes chunks of 32 tokens: lane j scores token j of the chunk against
    // the G queries (q is in shared memory), the warp does an online softmax over the
    // chunk, then every lane accumulates its D/32 output dims over the chunk's V rows.
    constexpr int VPT = D / 32;
    const float NEG_INF = __int_as_float(0xff800000);
    constexpr int EPV = 16 / sizeof(T);  // elements per 16-byte load
    __shared__ __align__(16) float qs[G][D];
    __shared__ float ps[NWARPS][G][32];
    __shared__ int slot_s[NWARPS][32];
    __shared__ float red_m[NWARPS][G];
    __shared__ float red_l[NWARPS][G];
    __shared__ float red_acc[NWARPS][G][D];

    const int bh = blockIdx.x;
    const int b = bh / HKV;
    const int kvh = bh % HKV;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int len = offsets[b] + 1;
    const int NB = tables_shape[1];  // runtime, so a growing context compiles nothing new
    const size_t NSLOTS = k_shape[1];
    const float sc = scale[0];
"""

_LOAD_Q = r"""
    for (int i = threadIdx.x; i < G * D; i += NWARPS * 32) {
        qs[i / D][i % D] = static_cast<float>(q[(size_t)bh * G * D + i]) * sc;
    }
    __syncthreads();
"""

SOURCE_ATTEND = r"""
    float m[G], l[G], acc[G][VPT];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
        #pragma unroll
        for (int i = 0; i < VPT; ++i) acc[g][i] = 0.f;
    }
    const size_t head = (size_t)kvh * NSLOTS;
    const int nchunks = (len + 31) / 32;
    for (int c = warp; c < nchunks; c += NWARPS) {
        const int t = c * 32 + lane;
        const bool valid = t < len;
        int slot = 0;
        if (valid) slot = tables[b * NB + t / BS] * BS + t % BS;
        slot_s[warp][lane] = slot;
        float s[G];
        #pragma unroll
        for (int g = 0; g < G; ++g) s[g] = 0.f;
        if (valid) {
            const uint4* kp = reinterpret_cast<const uint4*>(k + (head + slot) * D);
            #pragma unroll
            for (int j = 0; j < D / EPV; ++j) {
                uint4 raw = kp[j];
                const T* e = reinterpret_cast<const T*>(&raw);
                #pragma unroll
                for (int u = 0; u < EPV; ++u) {
                    const float x = static_cast<float>(e[u]);
                    #pragma unroll
                    for (int g = 0; g < G; ++g) s[g] += qs[g][j * EPV + u] * x;
                }
            }
        }
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float cmax = valid ? s[g] : NEG_INF;
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffff, cmax, o));
            const float mn = fmaxf(m[g], cmax);
            const float corr = __expf(m[g] - mn);
            const float p = valid ? __expf(s[g] - mn) : 0.f;
            l[g] = l[g] * corr + p;
            #pragma unroll
            for (int i = 0; i < VPT; ++i) acc[g][i] *= corr;
            m[g] = mn;
            ps[warp][g][lane] = p;
        }
        __syncwarp();
        const int n = min(32, len - c * 32);
        for (int tt = 0; tt < n; ++tt) {
            const T* vp = v + (head + slot_s[warp][tt]) * D + lane * VPT;
            float vv[VPT];
            #pragma unroll
            for (int i = 0; i < VPT; ++i) vv[i] = static_cast<float>(vp[i]);
            #pragma unroll
            for (int g = 0; g < G; ++g) {
                const float p = ps[warp][g][tt];
                #pragma unroll
                for (int i = 0; i < VPT; ++i) acc[g][i] += p * vv[i];
            }
        }
        __syncwarp();
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        float lsum = l[g];
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) lsum += __shfl_xor_sync(0xffffffff, lsum, o);
        if (lane == 0) {
            red_m[warp][g] = m[g];
            red_l[warp][g] = lsum;
        }
        #pragma unroll
        for (int i = 0; i < VPT; ++i) red_acc[warp][g][lane * VPT + i] = acc[g][i];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * D; i += NWARPS * 32) {
        const int g = i / D;
        const int d = i % D;
        float mx_ = NEG_INF;
        #pragma unroll
        for (int w = 0; w < NWARPS; ++w) mx_ = fmaxf(mx_, red_m[w][g]);
        float num = 0.f, den = 0.f;
        #pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            if (red_l[w][g] > 0.f) {
                const float f = __expf(red_m[w][g] - mx_);
                num += red_acc[w][g][d] * f;
                den += red_l[w][g] * f;
            }
        }
        out[(size_t)bh * G * D + i] = static_cast<T>(num / den);
    }
"""

_SOURCE = SOURCE_HEAD + _LOAD_Q + SOURCE_ATTEND

# mlx-lm model modules whose attention is plain (no soft-capping, sinks or windows)
# and goes through the shared `scaled_dot_product_attention`.
SUPPORTED_MODULES = frozenset(
    f"mlx_lm.models.{m}"
    for m in ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "olmo2", "granite", "phi3")
)

_HELPER_MODULES = frozenset({"base", "cache", "rope_utils", "activations", "switch_layers"})

# Tests set this to run the whole kernel path on any device with the gather-based
# reference standing in for the CUDA kernel.
force_reference = False


@functools.cache
def available(flag: str = "auto") -> bool:
    """Whether the CUDA kernel can run here and is not turned off (`flag`:
    `KernelConfig.paged_kernel`)."""
    return flag != "0" and hasattr(mx.fast, "cuda_kernel") and on_cuda()


def enabled_for(
    model: nn.Module, specs: dict[int, Any], state_sizes: dict[int, int], flag: str = "auto"
) -> bool:
    """Whether decode batches of `model` can use the kernel (once `patches` routes its
    attention).

    Only models whose every cache layer is a plain `KVCache` (no sliding windows,
    no recurrent state), with equal key and value widths that are a multiple of 32."""
    if not (available(flag) or force_reference) or state_sizes or not specs:
        return False
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    if any(type(c) is not KVCache for c in make_prompt_cache(model)):
        return False
    if any(s.k_dim != s.v_dim or s.k_dim % 32 or s.k_dim > 256 for s in specs.values()):
        return False
    modules = {
        type(m).__module__
        for _, m in model.named_modules()
        if type(m).__module__.startswith("mlx_lm.models.")
        and type(m).__module__.rsplit(".", 1)[1] not in _HELPER_MODULES
    }
    if not modules or not modules <= SUPPORTED_MODULES:
        return False
    return True


def use_kernel(layout: Any, always: bool = False) -> None:
    """Mark a decode batch (one new token per row) of enough rows for the kernel (any
    decode batch when `always`: `PIPPIN_PAGED_KERNEL=1`)."""
    if layout.pad_len != 1 or not worth_it(len(layout.starts), layout.kv_width, always):
        return
    layout.paged_kernel = True
    off = layout.offset
    layout.offsets = off if isinstance(off, mx.array) else mx.array([off], dtype=mx.int32)


def worth_it(rows: int, kv_tokens: int, always: bool = False) -> bool:
    """Whether a decode batch of `rows` reading up to `kv_tokens` keys each takes the kernel."""
    if always:
        return True
    return rows >= MIN_ROWS or kv_tokens <= SOLO_CONTEXT


def warps(g: int, d: int, extra: int = 0) -> int:
    """Warps per thread block: as many as static shared memory allows (under 48 KB:
    red_acc is NWARPS * G * D floats); `extra`: more floats the caller's prologue keeps."""
    w = 8
    while w > 1 and 4 * (w * g * d + g * d + w * g * 32 + extra) > 40_000:
        w //= 2
    return w


def paged_decode_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    tables: mx.array,
    offsets: mx.array,
    scale: float,
    block_size: int,
) -> mx.array:
    """Attention of one new token per row over the row's paged KV.

    queries [B, Hq, 1, D]; pools [Hkv, slots, D]; tables [B, nb] int32 block ids;
    offsets [B] int32, the tokens before the new one (the new one is already in
    the pool). Returns [B, Hq, 1, D]."""
    B, hq, L, d = queries.shape
    hkv = k_pool.shape[0]
    assert L == 1 and hq % hkv == 0 and d % 32 == 0
    g = hq // hkv
    nw = warps(g, d)
    out = device.cuda_kernel(
        "pippin_paged_decode", ("q", "k", "v", "tables", "offsets", "scale"), _SOURCE
    )(
        inputs=[
            queries.reshape(B, hq, d),
            k_pool,
            v_pool,
            tables,
            offsets,
            mx.array([scale], dtype=mx.float32),
        ],
        template=[
            ("T", queries.dtype),
            ("D", d),
            ("G", g),
            ("HKV", hkv),
            ("BS", block_size),
            ("NWARPS", nw),
        ],
        grid=(B * hkv * nw * 32, 1, 1),
        threadgroup=(nw * 32, 1, 1),
        output_shapes=[(B, hq, 1, d)],
        output_dtypes=[queries.dtype],
    )
    return out[0]


def reference_decode_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    tables: mx.array,
    offsets: mx.array,
    scale: float,
    block_size: int,
) -> mx.array:
    """The portable path for the same inputs: gather the blocks, mask, fused attention."""
    B = queries.shape[0]
    hkv, nslots, d = k_pool.shape
    nb = tables.shape[1]

    def gather(pool: mx.array) -> mx.array:
        blocks = pool.reshape(hkv, nslots // block_size, block_size, -1)[:, tables]
        return blocks.reshape(hkv, B, nb * block_size, -1).transpose(1, 0, 2, 3)

    k = mx.arange(nb * block_size)[None, :]
    mask = (k <= offsets[:, None])[:, None, None, :]
    return mx.fast.scaled_dot_product_attention(
        queries, gather(k_pool), gather(v_pool), scale=scale, mask=mask
    )
