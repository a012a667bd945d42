"""A decode step's attention block as one CUDA kernel: q/k norms, RoPE, the KV write and
paged attention.

On a GPU, a small model's single-stream decode is bound by host time: MLX spends a few
microseconds per graph node (the compiled step's replay, the graph walk, each
primitive's encoding, the CUDA graph's nodes). mlx-lm's attention block is about 35
nodes and 8 kernels a layer: the q/k/v slices, reshapes and transposes, two RoPEs, the
copies and scatters that write the new token's keys and values, the attention and its
output transpose. For the plain attention of the Llama and Qwen families this module
puts one kernel in their place. It reads the fused q/k/v product (`fused_proj`) as it
comes out of the matmul, applies the q/k RMSNorms (Qwen3) and RoPE, writes the new
token's keys and values into the pools, then attends as `paged_attention`'s kernel does
(the same code, after its own prologue).

The write is in place: MLX's custom kernels only produce new arrays, so the kernel
writes into the pool arrays it is given, which is sound here because the pools are
row-contiguous (MLX passes them without a copy), every decode step is its own launch on
one stream (whatever reads the pools next runs after it), and nothing but the pool holds
them. The decode step's graph then has no scatter at all.

Where it applies: models whose every attention module is exactly mlx-lm's `llama`,
`qwen2` or `qwen3` `Attention`, with fused q/k/v, a RoPE whose angle is position times
a fixed frequency (`nn.RoPE`, Llama 3's), and decode batches that take the paged
kernel, that is on CUDA. `PIPPIN_FUSED_ATTENTION=0` turns it off. Off CUDA, tests run
the same hook with `reference` (mlx-lm's own ops) standing in for the kernel.

On the H200 it takes Llama-3.2-1B's single-stream decode from 296 to 483 tok/s and
Qwen3-0.6B's from 167 to 302 (`bench/gpu/single_stream.py`, in turns); `fused_layer` builds
the rest of the layer around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pippin.kernels import device, fused_proj, paged_attention

# (module, class): attention whose __call__ is the one `_call` stands in for.
CLASSES = (("llama", "Attention"), ("qwen2", "Attention"), ("qwen3", "Attention"))

_PROLOGUE = r"""
    // The row's q (G heads) and new k (one head) from the fused q/k/v product.
    const int pos = offsets[b];
    constexpr int W = (HKV * G + 2 * HKV) * D;
    const T* row = qkv + (size_t)b * W;
    __shared__ float ks[D];
    __shared__ float rms_s[G + 1];
    for (int i = threadIdx.x; i < (G + 1) * D; i += NWARPS * 32) {
        const int g = i / D, d = i % D;
        if (g < G) qs[g][d] = static_cast<float>(row[(kvh * G + g) * D + d]);
        else ks[d] = static_cast<float>(row[(HKV * G + kvh) * D + d]);
    }
    __syncthreads();
    if (QNORM) {  // RMSNorm over each head, rounded as MLX's rms_norm returns it
        for (int g = warp; g <= G; g += NWARPS) {
            const float* x = g < G ? qs[g] : ks;
            float ss = 0.f;
            for (int d = lane; d < D; d += 32) ss += x[d] * x[d];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
            if (lane == 0) rms_s[g] = rsqrtf(ss / D + eps[g < G ? 0 : 1]);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < (G + 1) * D; i += NWARPS * 32) {
            const int g = i / D, d = i % D;
            float* x = g < G ? &qs[g][d] : &ks[d];
            const T y = static_cast<T>(*x * rms_s[g]);
            const float w = static_cast<float>(g < G ? qw[d] : kw[d]);
            *x = static_cast<float>(static_cast<T>(w * static_cast<float>(y)));
        }
        __syncthreads();
    }
    // RoPE on the first RD dims: pairs (j, j + RD/2), or (2j, 2j + 1) if TRAD.
    constexpr int HALF = RD / 2;
    for (int i = threadIdx.x; i < (G + 1) * HALF; i += NWARPS * 32) {
        const int g = i / HALF, j = i % HALF;
        float* x = g < G ? qs[g] : ks;
        const int i1 = TRAD ? 2 * j : j;
        const int i2 = TRAD ? 2 * j + 1 : j + HALF;
        float sn, cs;
        sincosf(static_cast<float>(pos) * inv_freq[j], &sn, &cs);
        const float a = x[i1], c = x[i2];
        x[i1] = a * cs - c * sn;
        x[i2] = a * sn + c * cs;
    }
    __syncthreads();
    // The new token's keys and values into the pools, in place; q rounded as RoPE returns it.
    const size_t slot_new = (size_t)tables[b * NB + pos / BS] * BS + pos % BS;
    // Split over the context, only block 0 writes: it alone reads the new token's slot.
    T* kpool = const_cast<T*>(k) + ((size_t)kvh * NSLOTS + slot_new) * D;
    T* vpool = const_cast<T*>(v) + ((size_t)kvh * NSLOTS + slot_new) * D;
    for (int d = threadIdx.x; d < D && blockIdx.y == 0; d += NWARPS * 32) {
        kpool[d] = static_cast<T>(ks[d]);
        vpool[d] = row[(HKV * G + HKV + kvh) * D + d];
    }
    for (int i = threadIdx.x; i < G * D; i += NWARPS * 32) {
        qs[i / D][i % D] = static_cast<float>(static_cast<T>(qs[i / D][i % D])) * sc;
    }
    __syncthreads();  // also makes this block's pool writes visible to its own reads
"""

_SOURCE = paged_attention.SOURCE_HEAD + _PROLOGUE + paged_attention.SOURCE_ATTEND
_SOURCE_SPLIT = paged_attention.SOURCE_HEAD + _PROLOGUE + paged_attention.SOURCE_ATTEND_PART
_INPUTS = ("qkv", "k", "v", "tables", "offsets", "scale", "inv_freq", "qw", "kw", "eps")


@dataclass
class Spec:
    """What the kernel needs to know of one attention module."""

    hq: int
    hkv: int
    d: int
    rope_dims: int
    traditional: bool
    inv_freq: mx.array  # [rope_dims / 2] float32, the angle per position of each pair
    qnorm: bool
    norm_weights: tuple[mx.array, mx.array]  # q and k RMSNorm weights (ones if no norm)
    eps: mx.array  # [2] float32
    scale: mx.array  # [1] float32


def spec(m: nn.Module) -> Spec | None:
    parts = [getattr(m, n, None) for n in ("q_proj", "k_proj", "v_proj")]
    if not all(isinstance(p, fused_proj.Part) for p in parts):
        return None
    shared = parts[0].shared
    if any(p.shared is not shared for p in parts) or [p.i for p in parts] != [0, 1, 2]:
        return None
    hq, hkv = m.n_heads, m.n_kv_heads
    widths = [b - a for a, b in shared.bounds]
    if hq % hkv or widths[0] % hq:
        return None
    d = widths[0] // hq
    if widths != [hq * d, hkv * d, hkv * d] or d % 32 or d > 256:
        return None
    qnorm = hasattr(m, "q_norm")
    norms = (m.q_norm, m.k_norm) if qnorm else ()
    if qnorm and not all(type(n) is nn.RMSNorm and n.weight.shape == (d,) for n in norms):
        return None
    rope = _rope(m.rope, d)
    if rope is None:
        return None
    rd, trad, inv = rope
    ones = mx.ones((d,), dtype=shared.fused.weight.dtype)
    return Spec(
        hq=hq,
        hkv=hkv,
        d=d,
        rope_dims=rd,
        traditional=trad,
        inv_freq=inv,
        qnorm=qnorm,
        norm_weights=(m.q_norm.weight, m.k_norm.weight) if qnorm else (ones, ones),
        eps=mx.array([n.eps for n in norms] if qnorm else [0.0, 0.0], dtype=mx.float32),
        scale=mx.array([m.scale], dtype=mx.float32),
    )


def _rope(rope: Any, d: int) -> tuple[int, bool, mx.array] | None:
    """(dims, traditional, angle per position of each pair) of a RoPE module whose angle
    is position times a fixed frequency, checked against the module itself; else None."""
    dims, trad = getattr(rope, "dims", None), getattr(rope, "traditional", None)
    if not isinstance(dims, int) or not isinstance(trad, bool) or dims % 2 or dims > d:
        return None
    half = dims // 2
    if type(rope) is nn.RoPE:
        inv = rope.scale * rope.base ** (-np.arange(half, dtype=np.float64) / half)
    elif type(rope).__name__ == "Llama3RoPE" and hasattr(rope, "_freqs"):
        inv = 1.0 / np.array(rope._freqs.astype(mx.float32), dtype=np.float64)
    else:
        return None
    x = np.random.default_rng(0).standard_normal((1, 2, 3, d)).astype(np.float32)
    for off in (0, 17, 3000):
        got = np.array(rope(mx.array(x), offset=off))
        if not np.allclose(got, _rotate(x, off, inv, dims, trad), atol=2e-3):
            return None
    return dims, trad, mx.array(inv.astype(np.float32))


def _rotate(x: np.ndarray, off: int, inv: np.ndarray, dims: int, trad: bool) -> np.ndarray:
    """RoPE in float64 for [..., L, D] at positions off, off + 1, ... (the check above)."""
    half = dims // 2
    pos = off + np.arange(x.shape[-2], dtype=np.float64)[:, None]
    cos, sin = np.cos(pos * inv), np.sin(pos * inv)
    out = x.astype(np.float64)
    i1 = np.arange(0, dims, 2) if trad else np.arange(half)
    i2 = i1 + 1 if trad else i1 + half
    a, c = out[..., i1].copy(), out[..., i2].copy()
    out[..., i1] = a * cos - c * sin
    out[..., i2] = a * sin + c * cos
    return out


def call(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    lay = getattr(cache, "layout", None)
    if not getattr(lay, "fused_attention", False):
        return super(type(self), self).__call__(x, mask, cache)
    qkv = self.q_proj.shared.fused(x)  # [B, 1, (hq + 2 hkv) d], one matmul
    return self.o_proj(attend(self, qkv, cache.pool.parts, lay))


def attend(attn: Any, qkv: mx.array, parts: list[mx.array], lay: Any) -> mx.array:
    """The fused block: the kernel, or `reference` where tests force the reference path."""
    fn = reference if paged_attention.force_reference else fused_decode_attention
    return fn(attn, qkv, parts, lay)


def fused_decode_attention(attn: Any, qkv: mx.array, parts: list[mx.array], lay: Any) -> mx.array:
    """The kernel: [B, 1, hq * d] attention output; writes the new keys and values into
    `parts` (the layer's key and value pools, [hkv, slots, d]) in place."""
    s: Spec = attn._pippin_fused
    B = qkv.shape[0]
    g = s.hq // s.hkv
    nw = paged_attention.warps(g, s.d, extra=s.d + g + 1)
    split = 1
    if getattr(lay, "paged_split", False):  # a long context: as `paged_attention` splits it
        split = paged_attention.num_splits(B, s.hkv, lay.gather_blocks.shape[1] * lay.block_size)
    name, source = "pippin_fused_decode_attention", _SOURCE
    if split > 1:
        name, source = "pippin_fused_decode_attention_split", _SOURCE_SPLIT
    out = device.cuda_kernel(name, _INPUTS, source)(
        inputs=[
            qkv,
            parts[0],
            parts[1],
            lay.gather_blocks,
            lay.offsets,
            s.scale,
            s.inv_freq,
            *s.norm_weights,
            s.eps,
        ],
        template=[
            ("T", qkv.dtype),
            ("D", s.d),
            ("G", g),
            ("HKV", s.hkv),
            ("BS", lay.block_size),
            ("NWARPS", nw),
            ("WIN", 0),  # no sliding window: `CLASSES` are plain attention
            ("RD", s.rope_dims),
            ("TRAD", s.traditional),
            ("QNORM", s.qnorm),
        ],
        grid=(B * s.hkv * nw * 32, split, 1),
        threadgroup=(nw * 32, 1, 1),
        **paged_attention.split_outputs(split, (B, 1, s.hq * s.d), qkv.dtype, s.hkv, g, s.d),
    )
    return paged_attention.merged(out[0], split, (B, 1, s.hq * s.d), qkv.dtype)


def reference(attn: Any, qkv: mx.array, parts: list[mx.array], lay: Any) -> mx.array:
    """The same with mlx-lm's own ops (the module's norms and RoPE, a scatter, the
    gather-based attention): what the kernel must equal; the stand-in off CUDA."""
    s: Spec = attn._pippin_fused
    B = qkv.shape[0]
    q, k, v = (qkv[..., a:b] for a, b in attn.q_proj.shared.bounds)
    q, k, v = q.reshape(B, 1, s.hq, -1), k.reshape(B, 1, s.hkv, -1), v.reshape(B, 1, s.hkv, -1)
    if s.qnorm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
    q, k = attn.rope(q, offset=lay.offsets), attn.rope(k, offset=lay.offsets)
    parts[0][:, lay.write_slots] = k.transpose(1, 0, 2, 3).reshape(s.hkv, B, -1)
    parts[1][:, lay.write_slots] = v.transpose(1, 0, 2, 3).reshape(s.hkv, B, -1)
    out = paged_attention.reference_decode_attention(
        q, parts[0], parts[1], lay.gather_blocks, lay.offsets, attn.scale, lay.block_size
    )
    return out.transpose(0, 2, 1, 3).reshape(B, 1, -1)
