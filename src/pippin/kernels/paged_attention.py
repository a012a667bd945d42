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

A batch of few rows over a long context would give the kernel too few thread blocks
(one per row and KV head: 8 for one row of Llama 3) to load the GPU, so there the
context is split, as flash-decoding does: each (row, KV head) gets `num_splits` blocks
over consecutive runs of its tokens, each writes its unnormalised output with its
running max and sum, and a second kernel merges the parts.

Sliding-window layers and attention sinks (gpt-oss, Gemma 3: `WINDOWED_MODULES`) run
in the kernel too: the layer's mask is a `Window` naming its size, which bounds the first
key read, and each head's sink logit joins its softmax where the output is normalised.

Set `PIPPIN_PAGED_KERNEL=0` to turn the kernel off, `=1` to force it on for any
decode batch (the default: see `worth_it`);
`PIPPIN_PAGED_SPLIT=0` keeps long contexts of few rows on the gather path, as before the
split.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import device
from pippin.kernels.device import on_cuda

# Unsplit, the kernel gives each (row, KV head) one thread block, so a few rows of long
# context would leave most of the GPU idle. Rows at or above MIN_ROWS, or contexts up to
# SOLO_CONTEXT tokens, take it unsplit (for one row of a 512-token context it saves the
# gather, the mask and the unfused masked attention: about 200 ops per step); fewer than
# SPLIT_MAX_ROWS rows over more than SPLIT_MIN_CONTEXT keys take it split.
MIN_ROWS = 16
SOLO_CONTEXT = 8192
SPLIT_MAX_ROWS = 64
SPLIT_MIN_CONTEXT = 2048
# A split spans at least SPLIT_TOKENS keys (one pass of 8 warps of 32 tokens), and a
# call has about TARGET_BLOCKS thread blocks (an H100/H200 holds 4+ per SM, 132 SMs).
SPLIT_TOKENS = 256
TARGET_BLOCKS = 512

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
    // The first key attended: a sliding-window layer (WIN > 0) sees the last WIN only.
    const int lo = WIN > 0 ? max(0, len - WIN) : 0;
    const int c_lo = lo / 32;
    // This block's run of 32-token chunks: all of them unless the grid splits the
    // context (gridDim.y > 1). Block 0 takes the run with the newest token (in
    // `fused_attention` only block 0 writes it to the pool, then reads it back), blocks
    // 1.. the runs before it in order; a run past the end is empty (its block writes
    // m = -inf, l = 0).
    const int nchunks_all = (len + 31) / 32 - c_lo;
    const int per_split = (nchunks_all + gridDim.y - 1) / gridDim.y;
    const int run_last = (nchunks_all - 1) / per_split;
    const int yb = blockIdx.y;
    const int run = yb == 0 ? run_last : (yb <= run_last ? yb - 1 : yb);
    const int c_begin = c_lo + run * per_split;
    const int c_end = min(c_lo + nchunks_all, c_begin + per_split);
"""

_LOAD_Q = r"""
    for (int i = threadIdx.x; i < G * D; i += NWARPS * 32) {
        qs[i / D][i % D] = static_cast<float>(q[(size_t)bh * G * D + i]) * sc;
    }
    __syncthreads();
"""

_ATTEND_LOOP = r"""
    float m[G], l[G], acc[G][VPT];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.f;
        #pragma unroll
        for (int i = 0; i < VPT; ++i) acc[g][i] = 0.f;
    }
    const size_t head = (size_t)kvh * NSLOTS;
    for (int c = c_begin + warp; c < c_end; c += NWARPS) {
        const int t = c * 32 + lane;
        const bool valid = t >= lo && t < len;
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
        // The chunk's V rows, 8 at a time: all 8 loads are issued before their sums, so
        // a warp waits on memory once per 8 rows rather than once per row. Rows past the
        // context load as 0 (their p is 0 too).
        const int n = min(32, len - c * 32);
        for (int t0 = 0; t0 < n; t0 += 8) {
            float vv[8][VPT];
            #pragma unroll
            for (int u = 0; u < 8; ++u) {
                __align__(16) T e[VPT];
                if (t0 + u < n) {
                    const T* vp = v + (head + slot_s[warp][t0 + u]) * D + lane * VPT;
                    if constexpr (VPT * sizeof(T) == 16) {
                        *reinterpret_cast<uint4*>(e) = *reinterpret_cast<const uint4*>(vp);
                    } else if constexpr (VPT * sizeof(T) == 8) {
                        *reinterpret_cast<uint2*>(e) = *reinterpret_cast<const uint2*>(vp);
                    } else if constexpr (VPT * sizeof(T) == 4) {
                        *reinterpret_cast<unsigned*>(e) = *reinterpret_cast<const unsigned*>(vp);
                    } else {
                        #pragma unroll
                        for (int i = 0; i < VPT; ++i) e[i] = vp[i];
                    }
                } else {
                    #pragma unroll
                    for (int i = 0; i < VPT; ++i) e[i] = static_cast<T>(0.f);
                }
                #pragma unroll
                for (int i = 0; i < VPT; ++i) vv[u][i] = static_cast<float>(e[i]);
            }
            #pragma unroll
            for (int u = 0; u < 8; ++u) {
                #pragma unroll
                for (int g = 0; g < G; ++g) {
                    const float p = ps[warp][g][t0 + u];
                    #pragma unroll
                    for (int i = 0; i < VPT; ++i) acc[g][i] += p * vv[u][i];
                }
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
"""

# The warps' parts merged: the normalised output (unsplit), or this split's part.
_MERGE_WARPS = r"""
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
"""

_WRITE_OUT = r"""
        out[(size_t)bh * G * D + i] = static_cast<T>(num / den);
    }
"""

# With attention sinks (gpt-oss): each query head's softmax has one more logit, its
# sink, that weighs no value row. Both kernels that normalise (unsplit, and the split
# parts' merge) take it from this header.
_SINK_HEADER = r"""
__device__ inline float pippin_with_sink(float num, float den, float m, float sink) {
    const float top = fmaxf(m, sink);
    const float f = __expf(m - top);
    return num * f / (den * f + __expf(sink - top));
}
"""

_WRITE_OUT_SINKS = r"""
        const float sk = static_cast<float>(sinks[kvh * G + g]);
        out[(size_t)bh * G * D + i] = static_cast<T>(pippin_with_sink(num, den, mx_, sk));
    }
"""

# out [B * HKV, S, G, D + 2] float32: the unnormalised output, then m and l.
_WRITE_PART = r"""
        float* part = out + (((size_t)bh * gridDim.y + blockIdx.y) * G + g) * (D + 2);
        part[d] = num;
        if (d == 0) {
            part[D] = mx_;
            part[D + 1] = den;
        }
    }
"""

SOURCE_ATTEND = _ATTEND_LOOP + _MERGE_WARPS + _WRITE_OUT
# The same, for a grid that splits the context: each block writes its part.
SOURCE_ATTEND_PART = _ATTEND_LOOP + _MERGE_WARPS + _WRITE_PART

_SOURCE = SOURCE_HEAD + _LOAD_Q + SOURCE_ATTEND
_SOURCE_SPLIT = SOURCE_HEAD + _LOAD_Q + SOURCE_ATTEND_PART
_SOURCE_SINKS = SOURCE_HEAD + _LOAD_Q + _ATTEND_LOOP + _MERGE_WARPS + _WRITE_OUT_SINKS

# One thread per output element: the splits' parts merged by their maxima.
_COMBINE_PARTS = r"""
    const int S = part_shape[1];
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)part_shape[0] * G * D) return;
    const size_t bh = i / (G * D);
    const int g = (i / D) % G;
    const int d = i % D;
    const float* p = part + (bh * S * G + g) * (D + 2);
    constexpr size_t STEP = (size_t)G * (D + 2);
    float mx_ = __int_as_float(0xff800000);
    for (int s = 0; s < S; ++s) mx_ = fmaxf(mx_, p[s * STEP + D]);
    float num = 0.f, den = 0.f;
    for (int s = 0; s < S; ++s) {
        const float l = p[s * STEP + D + 1];
        if (l > 0.f) {
            const float f = __expf(p[s * STEP + D] - mx_);
            num += p[s * STEP + d] * f;
            den += l * f;
        }
    }
"""
_SOURCE_COMBINE = (
    _COMBINE_PARTS
    + r"""
    out[i] = static_cast<T>(num / den);
"""
)
# The same with each query head's sink logit (as `_WRITE_OUT_SINKS`).
_SOURCE_COMBINE_SINKS = (
    _COMBINE_PARTS
    + r"""
    const float sk = static_cast<float>(sinks[(bh % HKV) * G + g]);
    out[i] = static_cast<T>(pippin_with_sink(num, den, mx_, sk));
"""
)

# mlx-lm model modules whose attention is plain (no soft-capping, sinks or windows)
# and goes through the shared `scaled_dot_product_attention`.
SUPPORTED_MODULES = frozenset(
    f"mlx_lm.models.{m}"
    for m in ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "olmo2", "granite", "phi3")
)
# Those whose layers also have sliding windows (the window reaches the kernel as the
# layer's mask, a `Window`) or attention sinks.
WINDOWED_MODULES = frozenset(f"mlx_lm.models.{m}" for m in ("gpt_oss", "gemma3_text", "gemma3"))


@dataclass(frozen=True)
class Window:
    """A sliding-window layer's mask in a decode batch that takes the kernel: the keys
    it sees are the last `size` (its own included)."""

    size: int


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

    Only models without recurrent state whose cache layers are plain `KVCache`s
    (`RotatingKVCache`s too, for `WINDOWED_MODULES`), with equal key and value widths
    that are a multiple of 32."""
    if flag == "0" or not (available(flag) or force_reference) or state_sizes or not specs:
        return False
    from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

    kinds = {type(c) for c in make_prompt_cache(model)}
    if not kinds <= {KVCache, RotatingKVCache}:
        return False
    if any(s.k_dim != s.v_dim or s.k_dim % 32 or s.k_dim > 256 for s in specs.values()):
        return False
    modules = {
        type(m).__module__
        for _, m in model.named_modules()
        if type(m).__module__.startswith("mlx_lm.models.")
        and type(m).__module__.rsplit(".", 1)[1] not in _HELPER_MODULES
    }
    if not modules:
        return False
    if modules <= SUPPORTED_MODULES:
        return kinds == {KVCache}
    return modules <= SUPPORTED_MODULES | WINDOWED_MODULES


def use_kernel(layout: Any, always: bool = False, split: bool = True) -> None:
    """Mark a decode batch (one new token per row) for the kernel where it pays (any
    decode batch when `always`: `PIPPIN_PAGED_KERNEL=1`); `split`: whether long contexts
    of few rows may take it split (`PIPPIN_PAGED_SPLIT`)."""
    rows = len(layout.starts)
    if layout.pad_len != 1 or not worth_it(rows, layout.kv_width, always, split):
        return
    layout.paged_kernel = True
    layout.paged_split = split_wanted(rows, layout.kv_width, split)
    off = layout.offset
    layout.offsets = off if isinstance(off, mx.array) else mx.array([off], dtype=mx.int32)


def worth_it(rows: int, kv_tokens: int, always: bool = False, split: bool = True) -> bool:
    """Whether a decode batch of `rows` reading up to `kv_tokens` keys each takes the kernel."""
    if always or split_wanted(rows, kv_tokens, split):
        return True
    return rows >= MIN_ROWS or kv_tokens <= SOLO_CONTEXT


def split_wanted(rows: int, kv_tokens: int, split: bool = True) -> bool:
    """Whether such a batch's attention splits each row's context over thread blocks."""
    return split and rows < SPLIT_MAX_ROWS and kv_tokens > SPLIT_MIN_CONTEXT


def num_splits(rows: int, hkv: int, kv_tokens: int) -> int:
    """Thread blocks per (row, KV head): enough for about TARGET_BLOCKS in all, each
    over at least SPLIT_TOKENS keys."""
    return max(1, min(kv_tokens // SPLIT_TOKENS, -(-TARGET_BLOCKS // (rows * hkv))))


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
    split: bool = False,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention of one new token per row over the row's paged KV.

    queries [B, Hq, 1, D]; pools [Hkv, slots, D]; tables [B, nb] int32 block ids;
    offsets [B] int32, the tokens before the new one (the new one is already in
    the pool); `split`: the context split over thread blocks (`num_splits` of them,
    from the shapes alone, so a compiled step keeps one trace per shape); `window`:
    a sliding-window layer's size; `sinks` [Hq]: each head's sink logit.
    Returns [B, Hq, 1, D]."""
    B, hq, L, d = queries.shape
    hkv = k_pool.shape[0]
    assert L == 1 and hq % hkv == 0 and d % 32 == 0
    g = hq // hkv
    nw = warps(g, d)
    # A sliding window short enough never to be split alone (gpt-oss's 128 keys) is not
    # split in a long context either: its blocks past the window would only be empty.
    split = split and (window is None or window > SPLIT_MIN_CONTEXT)
    s = num_splits(B, hkv, tables.shape[1] * block_size) if split else 1
    names = ["q", "k", "v", "tables", "offsets", "scale"]
    header = ""
    inputs = [
        queries.reshape(B, hq, d),
        k_pool,
        v_pool,
        tables,
        offsets,
        mx.array([scale], dtype=mx.float32),
    ]
    if s > 1:
        name, source = ("pippin_paged_decode_split", _SOURCE_SPLIT)
    elif sinks is not None:
        name, source, header = ("pippin_paged_decode_sinks", _SOURCE_SINKS, _SINK_HEADER)
        names.append("sinks")
        inputs.append(sinks)
    else:
        name, source = ("pippin_paged_decode", _SOURCE)
    out = device.cuda_kernel(name, tuple(names), source, header)(
        inputs=inputs,
        template=[
            ("T", queries.dtype),
            ("D", d),
            ("G", g),
            ("HKV", hkv),
            ("BS", block_size),
            ("NWARPS", nw),
            ("WIN", window or 0),
        ],
        grid=(B * hkv * nw * 32, s, 1),
        threadgroup=(nw * 32, 1, 1),
        **split_outputs(s, (B, hq, 1, d), queries.dtype, hkv, g, d),
    )
    return merged(out[0], s, (B, hq, 1, d), queries.dtype, sinks)


def split_outputs(
    split: int, shape: tuple[int, ...], dtype: mx.Dtype, hkv: int, g: int, d: int
) -> dict[str, list[Any]]:
    """A decode-attention kernel's `output_shapes` and `output_dtypes`: its result `shape`
    ([B, ...]) unsplit, else each block's part for `combine`."""
    if split == 1:
        return {"output_shapes": [shape], "output_dtypes": [dtype]}
    return {"output_shapes": [(shape[0] * hkv, split, g, d + 2)], "output_dtypes": [mx.float32]}


def merged(
    out: mx.array,
    split: int,
    shape: tuple[int, ...],
    dtype: mx.Dtype,
    sinks: mx.array | None = None,
) -> mx.array:
    """The kernel's output as `shape`: itself unsplit, else its parts combined (and the
    query heads' `sinks`, if any, added there)."""
    return out if split == 1 else combine(out, dtype, sinks).reshape(shape)


def combine(parts: mx.array, dtype: mx.Dtype, sinks: mx.array | None = None) -> mx.array:
    """The split kernels' parts [B * Hkv, S, G, D + 2] merged: [B * Hkv * G * D], that is
    [B, Hq, 1, D] (or [B, 1, Hq * D]) flattened; `sinks` [Hq]: each query head's sink."""
    rows, _, g, d2 = parts.shape
    d = d2 - 2
    n = rows * g * d
    name, source, header = "pippin_paged_decode_combine", _SOURCE_COMBINE, ""
    names, inputs = ["part"], [parts]
    template: list[tuple[str, Any]] = [("T", dtype), ("D", d), ("G", g)]
    if sinks is not None:
        name, source, header = (
            "pippin_paged_decode_combine_sinks",
            _SOURCE_COMBINE_SINKS,
            _SINK_HEADER,
        )
        names.append("sinks")
        inputs.append(sinks)
        template.append(("HKV", sinks.shape[0] // g))
    return device.cuda_kernel(name, tuple(names), source, header)(
        inputs=inputs,
        template=template,
        grid=(-(-n // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[(n,)],
        output_dtypes=[dtype],
    )[0]


def reference_decode_attention(
    queries: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    tables: mx.array,
    offsets: mx.array,
    scale: float,
    block_size: int,
    window: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """The portable path for the same inputs: gather the blocks, mask, fused attention."""
    B = queries.shape[0]
    hkv, nslots, d = k_pool.shape
    nb = tables.shape[1]

    def gather(pool: mx.array) -> mx.array:
        blocks = pool.reshape(hkv, nslots // block_size, block_size, -1)[:, tables]
        return blocks.reshape(hkv, B, nb * block_size, -1).transpose(1, 0, 2, 3)

    k = mx.arange(nb * block_size)[None, :]
    mask = k <= offsets[:, None]
    if window is not None:
        mask = mask & (k > offsets[:, None] - window)
    return mx.fast.scaled_dot_product_attention(
        queries,
        gather(k_pool),
        gather(v_pool),
        scale=scale,
        mask=mask[:, None, None, :],
        sinks=sinks,
    )
