"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability
under the model, its rank and the top k alternatives.

Position p's logits predict token p + 1, so a prefill chunk [start, start + length)
scores the prompt tokens start + 1 .. start + length (the last position of the prompt
predicts the first new token, not a prompt token). The runner keeps those positions'
logits (`ModelRunner.forward`'s `score`); log-softmax, rank and top-k run on the device
and only those small arrays reach the host, when the request's first output is sent.
Scores are of the model's raw logits (vLLM's default, `raw_logprobs`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import mlx.core as mx

from pippin.engine.scheduler import ScheduledSeq
from pippin.engine.sequence import Sequence
from pippin.engine.types import TokenLogprob


@dataclass
class Chunk:
    """One prefill chunk's scores (lazy): prompt tokens start + 1 .. start + n."""

    start: int
    n: int
    logprob: mx.array  # [n] the prompt token's
    rank: mx.array  # [n]
    top_ids: mx.array | None  # [n, k]
    top_logprobs: mx.array | None  # [n, k]

    def arrays(self) -> list[mx.array]:
        parts = (self.logprob, self.rank, self.top_ids, self.top_logprobs)
        return [a for a in parts if a is not None]


def positions(items: Seq[ScheduledSeq]) -> dict[int, int]:
    """Row -> how many of its first positions score a prompt token this call."""
    out: dict[int, int] = {}
    for b, it in enumerate(items):
        seq = it.seq
        if seq.scores_prompt and not it.draft:
            n = min(it.length, len(seq.prompt_ids) - 1 - it.start)
            if n > 0:
                out[b] = n
    return out


def record(items: Seq[ScheduledSeq], score: dict[int, int], logits: mx.array) -> list[mx.array]:
    """Score the call's kept positions (`logits`: [sum(score), vocab], by row) into each
    sequence's chunks; returns the arrays to evaluate."""
    targets: list[int] = []
    for b, n in score.items():
        it = items[b]
        targets += it.seq.prompt_ids[it.start + 1 : it.start + 1 + n]
    x = logits.astype(mx.float32)
    lp = x - mx.logsumexp(x, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(lp, mx.array(targets)[:, None], axis=-1)
    rank = (lp > chosen).sum(axis=-1) + 1
    chosen = chosen[:, 0]
    k = max(items[b].seq.params.prompt_logprobs or 0 for b in score)
    top_ids = top_lp = None
    if k > 0:
        k = min(k, lp.shape[-1])
        top_ids = mx.argpartition(-lp, kth=k - 1, axis=-1)[:, :k]
        top_lp = mx.take_along_axis(lp, top_ids, axis=-1)
    out: list[mx.array] = []
    off = 0
    for b, n in score.items():
        it = items[b]
        seq = it.seq
        if it.start == 0:
            seq.prompt_chunks.clear()  # recomputed from the start (preempted)
        part = slice(off, off + n)
        chunk = Chunk(
            it.start,
            n,
            chosen[part],
            rank[part],
            top_ids[part] if top_ids is not None else None,
            top_lp[part] if top_lp is not None else None,
        )
        seq.prompt_chunks.append(chunk)
        out += chunk.arrays()
        off += n
    return out


def take(seq: Sequence) -> list[TokenLogprob | None]:
    """The sequence's prompt logprobs, on the host (None first); marks them sent."""
    out: list[TokenLogprob | None] = [None]
    k = seq.params.prompt_logprobs or 0
    for c in sorted(seq.prompt_chunks, key=lambda c: c.start):
        lps, ranks = c.logprob.tolist(), c.rank.tolist()
        ids = c.top_ids.tolist() if c.top_ids is not None and k else None
        tops = c.top_logprobs.tolist() if c.top_logprobs is not None and k else None
        for i in range(c.n):
            top: list[tuple[int, float]] = []
            if ids is not None and tops is not None:
                top = sorted(zip(ids[i], tops[i]), key=lambda x: -x[1])[:k]
            token = seq.prompt_ids[c.start + 1 + i]
            out.append(TokenLogprob(token, lps[i], top, int(ranks[i])))
    seq.prompt_chunks.clear()
    seq.prompt_sent = True
    return out
