"""Prefill attention on CUDA without a cuDNN plan built for every new shape.

MLX's fused attention on CUDA runs a prompt chunk through cuDNN, whose execution plan
MLX caches keyed on the exact shapes and strides of q, k, v and the mask. A plan it has
not seen is built on the host, NVRTC compile included: 50-150 ms, while the device waits.
A server's prefill batches rarely repeat a shape (rows, padded length, key width all
vary), so under a stream of new prompts most steps that carry a prompt chunk stalled for
that long (a native profile of the H200 server at 256 streams: docs/benchmarks.md).

Below `SCORES_BUDGET` score elements a chunk's attention is instead composed of plain
ops (two matmuls, the mask, a softmax), as MLX's own fallback does: no per-shape build,
and at those sizes a few milliseconds of device time at most. Larger chunks (long
prompts) keep cuDNN's flash kernel, where the build is paid once per shape against much
more compute, and where the scores would not fit in memory anyway.

`PIPPIN_PREFILL_ATTENTION`: `auto` (the default: composed on CUDA under the budget),
`fused` (always MLX's fused attention) or `composed` (always composed; tests use it on
any device).
"""

from __future__ import annotations

import os

import mlx.core as mx

# Score elements (rows x query heads x queries x keys) of the largest composed call:
# 256M, 512 MB of bf16 scores. 16 fresh prompts of 512 tokens are 134M for 32 heads.
SCORES_BUDGET = 1 << 28


def mode() -> str:
    return os.environ.get("PIPPIN_PREFILL_ATTENTION", "auto")


def wanted() -> bool:
    """Whether the route is installed at all (CUDA, or forced)."""
    m = mode()
    return m == "composed" or (m == "auto" and _on_cuda())


def _on_cuda() -> bool:
    from pippin.engine.paged_attention import on_cuda

    return on_cuda()


def use_composed(queries: mx.array, keys: mx.array) -> bool:
    """Whether a prompt chunk's attention (queries [B, Hq, L, D], keys [B, Hkv, S, D])
    is composed of plain ops rather than handed to the fused kernel."""
    m = mode()
    if m == "fused" or queries.shape[2] == 1:
        return False
    if m == "composed":
        return True
    B, hq, L, _ = queries.shape
    # Elsewhere (Metal, CPU) the fused attention builds nothing per shape.
    return B * hq * L * keys.shape[2] <= SCORES_BUDGET and _on_cuda()


def composed_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | str | None,
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` as plain ops: the same arithmetic as
    MLX's fallback (scaled queries, scores in the input dtype, a precise softmax).

    queries [B, Hq, L, D]; keys, values [B, Hkv, S, D]; mask "causal" (queries aligned
    to the last keys), a boolean or additive array broadcastable to [B, Hq, L, S], or
    None. Returns [B, Hq, L, Dv]."""
    B, hq, L, _ = queries.shape
    hkv, S = keys.shape[1], keys.shape[2]
    g = hq // hkv
    q = queries * mx.array(scale, dtype=queries.dtype)
    k, v = keys, values
    if g > 1:
        # Grouped heads: each KV head serves g query heads without repeating K or V.
        q = q.reshape(B, hkv, g, L, -1)
        k, v = k[:, :, None], v[:, :, None]
    scores = q @ k.swapaxes(-1, -2)
    if isinstance(mask, str):
        qpos = mx.arange(S - L, S, dtype=mx.int32)[:, None]
        mask = qpos >= mx.arange(S, dtype=mx.int32)[None]
    if mask is not None:
        if g > 1 and mask.ndim >= 3:
            mask = (
                mx.expand_dims(mask, -3)
                if mask.shape[-3] == 1
                else mask.reshape(*mask.shape[:-3], hkv, g, *mask.shape[-2:])
            )
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ v
    return out.reshape(B, hq, L, -1) if g > 1 else out
