"""Prefill attention on CUDA without a cuDNN plan built for every new shape.

MLX's fused attention on CUDA runs a prompt chunk through cuDNN, whose execution plan
MLX caches keyed on the exact shapes and strides of q, k, v and the mask. A plan it has
not seen is built on the host, NVRTC compile included: 50-150 ms, while the device waits.
A server's prefill batches rarely repeat a shape (rows, padded length, key width all
vary), so under a stream of new prompts most steps that carry a prompt chunk stalled for
that long (a native profile of the H200 server at 256 streams: docs/benchmarks.md).

A chunk's attention is instead composed of plain ops (two matmuls, the mask, a softmax),
as MLX's own fallback does: no per-shape build. Its rows go in pieces of at most
`SCORES_BUDGET` score elements, a few milliseconds of device time each. A row that is
over the budget alone (a long prompt) keeps cuDNN's flash kernel: there the build is
paid once per shape against much more compute, and the scores would take too much
memory.

`PIPPIN_PREFILL_ATTENTION`: `auto` (the default: composed on CUDA under the budget),
`fused` (always MLX's fused attention) or `composed` (always composed; tests use it on
any device).
"""

from __future__ import annotations

import mlx.core as mx

from pippin.kernels.device import on_cuda

# Score elements (rows x query heads x queries x keys) of the largest composed call:
# 256M, 512 MB of bf16 scores. 16 fresh prompts of 512 tokens are 134M for 32 heads.
SCORES_BUDGET = 1 << 28


def wanted(mode: str) -> bool:
    """Whether the route is installed at all (CUDA, or forced); `mode` is
    `KernelConfig.prefill_attention`: auto, composed or fused."""
    return mode == "composed" or (mode == "auto" and on_cuda())


def composed_rows(queries: mx.array, keys: mx.array, mode: str = "auto") -> int:
    """How many rows of a prompt chunk batch (queries [B, Hq, L, D], keys [B, Hkv, S, D])
    each composed piece takes; 0: the batch goes to the fused kernel instead."""
    m = mode
    B, hq, L, _ = queries.shape
    if m == "fused" or L == 1:
        return 0
    if m == "composed":
        return B
    per_row = hq * L * keys.shape[2]
    # Elsewhere (Metal, CPU) the fused attention builds nothing per shape. A row over the
    # budget alone is a long prompt: cuDNN's flash kernel, built once for its shape.
    if per_row > SCORES_BUDGET or not on_cuda():
        return 0
    return min(B, SCORES_BUDGET // per_row)


def composed_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | str | None,
    rows: int | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` as plain ops: the same arithmetic as
    MLX's fallback (scaled queries, scores in the input dtype, a precise softmax).

    queries [B, Hq, L, D]; keys, values [B, Hkv, S, D]; mask "causal" (queries aligned
    to the last keys), a boolean or additive array broadcastable to [B, Hq, L, S], or
    None. `rows`: at most this many rows at a time (bounds the scores' memory). `sinks`
    [Hq]: a logit per query head that takes a share of the softmax and no value (gpt-oss).
    Returns [B, Hq, L, Dv]."""
    B = queries.shape[0]
    if rows is not None and rows < B:
        per_row = isinstance(mask, mx.array) and mask.shape[0] == B
        return mx.concatenate(
            [
                _composed(
                    queries[i : i + rows],
                    keys[i : i + rows],
                    values[i : i + rows],
                    scale,
                    mask[i : i + rows] if per_row else mask,  # type: ignore[index]
                    sinks,
                )
                for i in range(0, B, rows)
            ]
        )
    return _composed(queries, keys, values, scale, mask, sinks)


def _composed(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None,
) -> mx.array:
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
    if sinks is not None:
        sink = sinks.astype(scores.dtype).reshape(*q.shape[1:-2], 1, 1)  # per query head
        scores = mx.concatenate([mx.broadcast_to(sink, (*scores.shape[:-1], 1)), scores], -1)
    probs = mx.softmax(scores, axis=-1, precise=True)
    out = (probs[..., 1:] if sinks is not None else probs) @ v
    return out.reshape(B, hq, L, -1) if g > 1 else out
