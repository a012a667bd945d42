"""Speculative decoding's rejection sampler (Leviathan et al. 2023; vLLM's
`RejectionSampler`): which proposed tokens a target distribution keeps, so that the
tokens it emits are distributed exactly as sampling the target one token at a time.

A proposal d drawn from the draft distribution q is kept with probability
min(1, p(d) / q(d)); at the first one refused, the token is drawn from the residual
max(p - q, 0), renormalised; when all are kept, one more is drawn from p at the next
position (the bonus token). Prompt lookup proposes without a distribution: q is a point
mass on d, so d is kept with probability p(d) and the residual is p without d. Greedy
rows keep d when it is p's argmax and emit the argmax otherwise.

The device computes, for every verified position (a flat row), whether its proposal is
kept, the residual draw and the plain draw; the host walks each sequence's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

NEG_INF = float("-inf")


@dataclass
class Verdicts:
    """Per flat row: whether its proposal is kept, the token to emit if it is refused
    (residual draw), and the token to emit after the last proposal (plain draw)."""

    kept: mx.array  # [R] bool
    residual: mx.array  # [R] int32
    plain: mx.array  # [R] int32


def judge(
    x: mx.array,
    greedy: mx.array,
    draft: mx.array,
    draft_probs: mx.array | None = None,
) -> Verdicts:
    """`x` [R, V]: the target's logits per row, shaped as the sampler draws from them
    (temperature, top-k/p, min-p); `greedy` [R] bool; `draft` [R] the token proposed at
    each row (any id on rows with no proposal: only their plain draw is read);
    `draft_probs` [R, V] the draft model's distribution (None: a point mass on `draft`)."""
    R, V = x.shape
    x = x.astype(mx.float32)
    logp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    d = draft.astype(mx.int32)[:, None]
    p_d = mx.exp(mx.take_along_axis(logp, d, axis=-1)[:, 0])
    argmax = mx.argmax(x, axis=-1).astype(mx.int32)
    plain = mx.argmax(x + mx.random.gumbel((R, V)), axis=-1).astype(mx.int32)
    if draft_probs is None:
        ratio = p_d
        # p without d: the point mass removed, renormalised by the argmax itself.
        cols = mx.arange(V, dtype=mx.int32)[None, :]
        resid_logits = mx.where(cols == d, NEG_INF, x)
    else:
        q_d = mx.take_along_axis(draft_probs, d, axis=-1)[:, 0]
        ratio = mx.minimum(p_d / mx.maximum(q_d, 1e-30), 1.0)
        resid = mx.maximum(mx.exp(logp) - draft_probs, 0.0)
        # p == q leaves no residual (a proposal is then always kept, but for rounding):
        # draw from p there.
        some = mx.sum(resid, axis=-1, keepdims=True) > 0
        resid_logits = mx.where(some, mx.log(resid), logp)
    residual = mx.argmax(resid_logits + mx.random.gumbel((R, V)), axis=-1).astype(mx.int32)
    u = mx.random.uniform(shape=(R,))
    kept = mx.where(greedy, argmax == d[:, 0], u < ratio)
    return Verdicts(kept, mx.where(greedy, argmax, residual), mx.where(greedy, argmax, plain))


def walk(kept: list[bool], residual: list[int], plain: list[int], draft: list[int]) -> list[int]:
    """The tokens one sequence emits from its 1 + len(draft) rows (host lists): the kept
    prefix of `draft`, then the residual draw where one is refused or else the plain
    draw after the last."""
    out: list[int] = []
    for j, d in enumerate(draft):
        if not kept[j]:
            out.append(residual[j])
            return out
        out.append(d)
    out.append(plain[len(draft)])
    return out
