"""Batched sampling with per-row parameters, on the device.

Work that only some rows need (penalties, logit bias, top-k/top-p sorting,
seeded noise) is done only for those rows, so a plain greedy or temperature
batch costs one softmax-free pass.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx
import numpy as np

from pippin.engine.sequence import Sequence

NEG_INF = float("-inf")


@dataclass
class SampleResult:
    tokens: mx.array  # [n] int32
    logprobs: mx.array | None  # [n] chosen-token logprob
    top_ids: mx.array | None  # [n, k]
    top_logprobs: mx.array | None  # [n, k]


def _scatter_rows(
    seqs: Seq[Any], eos_ids: set[int]
) -> tuple[list[int], list[int], list[float], list[int], list[int], list[float]]:
    """(rows, cols, additive deltas) and (rows, cols, repetition penalties)."""
    add_r: list[int] = []
    add_c: list[int] = []
    add_v: list[float] = []
    rep_r: list[int] = []
    rep_c: list[int] = []
    rep_v: list[float] = []
    for r, s in enumerate(seqs):
        p = s.params
        for tok, bias in p.logit_bias.items():
            add_r.append(r)
            add_c.append(tok)
            add_v.append(bias)
        if s.num_output < p.min_tokens:
            for tok in eos_ids | set(p.stop_token_ids):
                add_r.append(r)
                add_c.append(tok)
                add_v.append(NEG_INF)
        for tok in _banned(p.bad_words_ids, s.output_ids):
            add_r.append(r)
            add_c.append(tok)
            add_v.append(NEG_INF)
        if (p.presence_penalty or p.frequency_penalty) and s.output_ids:
            ids, counts = np.unique(np.asarray(s.output_ids), return_counts=True)
            add_r.extend([r] * len(ids))
            add_c.extend(ids.tolist())
            add_v.extend((-(p.presence_penalty + p.frequency_penalty * counts)).tolist())
        if p.repetition_penalty != 1.0:
            ids = np.unique(np.asarray(s.all_ids))
            rep_r.extend([r] * len(ids))
            rep_c.extend(ids.tolist())
            rep_v.extend([p.repetition_penalty] * len(ids))
    return add_r, add_c, add_v, rep_r, rep_c, rep_v


def _banned(words: list[list[int]], output: list[int]) -> set[int]:
    """vLLM's bad words: each word's last token, where the output ends with the others."""
    out: set[int] = set()
    for w in words:
        head = w[:-1]
        if not head or output[-len(head) :] == head:
            out.add(w[-1])
    return out


def _allowed_rows(seqs: Seq[Any], vocab: int) -> tuple[list[int], np.ndarray] | None:
    """The rows with `allowed_token_ids` and their masks ([rows, vocab] bool)."""
    rows = [r for r, s in enumerate(seqs) if s.params.allowed_token_ids]
    if not rows:
        return None
    mask = np.zeros((len(rows), vocab), dtype=bool)
    for i, r in enumerate(rows):
        ids = [t for t in seqs[r].params.allowed_token_ids if 0 <= t < vocab]
        mask[i, ids] = True
    return rows, mask


def _seed_key(seq: Sequence) -> mx.array:
    # Depends only on the seed, the sequence's index and the step: same seed, same output.
    assert seq.params.seed is not None
    mixed = (seq.params.seed * 1_000_003 + seq.index * 7_919 + seq.num_output) % (1 << 63)
    return mx.random.key(mixed)


def sample(
    logits: mx.array, seqs: list[Sequence], eos_ids: set[int], allowed: mx.array | None = None
) -> SampleResult:
    """`allowed`: [n, vocab] bool, the tokens a grammar lets each row produce."""
    n, vocab = logits.shape
    logits, adjusted = adjust(logits, seqs, eos_ids, allowed)

    temps = [s.params.temperature for s in seqs]
    greedy = [t <= 0.0 for t in temps]
    if all(greedy):
        tokens = mx.argmax(logits, axis=-1)
    elif _plain(seqs) and not adjusted:
        # Temperature only (the usual case): one compiled graph, its elementwise work fused.
        inv_t = mx.array([0.0 if g else 1.0 / t for g, t in zip(greedy, temps)], mx.float32)
        tokens = _sample_temperature(logits, inv_t)
    else:
        greedy_tokens = mx.argmax(logits, axis=-1)
        x = shaped(logits, seqs)
        noise = mx.random.gumbel((n, vocab))
        seeded = [r for r, s in enumerate(seqs) if s.params.seed is not None and not greedy[r]]
        if seeded:
            rows = [mx.random.gumbel((vocab,), key=_seed_key(seqs[r])) for r in seeded]
            noise[mx.array(seeded)] = mx.stack(rows)
        sampled = mx.argmax(x + noise, axis=-1)
        tokens = mx.where(mx.array(greedy), greedy_tokens, sampled)

    forced = [bool(s.think.forced) for s in seqs]
    if any(forced):  # a spent reasoning budget writes the section's end marker
        tokens = mx.where(
            mx.array(forced),
            mx.array([s.think.forced[0] if s.think.forced else 0 for s in seqs]),
            tokens,
        )

    want_lp = any(s.params.logprobs for s in seqs)
    if not want_lp:
        return SampleResult(tokens.astype(mx.int32), None, None, None)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    k = max(s.params.top_logprobs for s in seqs)
    top_ids = top_lp = None
    if k > 0:
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
    return SampleResult(tokens.astype(mx.int32), chosen, top_ids, top_lp)


def adjust(
    logits: mx.array, seqs: Seq[Any], eos_ids: set[int], allowed: mx.array | None = None
) -> tuple[mx.array, bool]:
    """Float32 logits with each row's penalties, logit bias, min_tokens, bad words,
    allowed tokens and grammar mask applied (what logprobs are computed from), and whether
    any of those changed them."""
    vocab = logits.shape[-1]
    logits = logits.astype(mx.float32)
    add_r, add_c, add_v, rep_r, rep_c, rep_v = _scatter_rows(seqs, eos_ids)
    if rep_r:
        rr, rc = mx.array(rep_r), mx.array(rep_c)
        vals = logits[rr, rc]
        pen = mx.array(rep_v)
        logits[rr, rc] = mx.where(vals > 0, vals / pen, vals * pen)
    if add_r:
        valid = [i for i, c in enumerate(add_c) if 0 <= c < vocab]
        rr = mx.array([add_r[i] for i in valid])
        rc = mx.array([add_c[i] for i in valid])
        logits = logits.at[rr, rc].add(mx.array([add_v[i] for i in valid]))
    only = _allowed_rows(seqs, vocab)
    if only is not None:
        ridx = mx.array(only[0])
        logits[ridx] = mx.where(mx.array(only[1]), logits[ridx], NEG_INF)
    if allowed is not None:
        logits = mx.where(allowed, logits, NEG_INF)
    return logits, bool(add_r or rep_r or only is not None or allowed is not None)


def shaped(logits: mx.array, seqs: Seq[Any]) -> mx.array:
    """Adjusted logits scaled by each row's temperature (1 for greedy rows) and cut by its
    top_k, top_p and min_p: the distribution a sampled row draws from is their softmax."""
    t = mx.array([s.params.temperature if s.params.temperature > 0 else 1.0 for s in seqs])
    x = logits / t.astype(mx.float32)[:, None]
    x = _apply_top_k(x, [s.params.top_k for s in seqs])
    x = _apply_top_p(x, [s.params.top_p for s in seqs])
    return _apply_min_p(x, [s.params.min_p for s in seqs])


def _plain(seqs: list[Sequence]) -> bool:
    for s in seqs:
        p = s.params
        if p.top_k > 0 or 0.0 < p.top_p < 1.0 or p.min_p > 0 or p.seed is not None:
            return False
    return True


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def _sample_temperature(logits: mx.array, inv_t: mx.array) -> mx.array:
    """Rows with inv_t 0 are greedy; the others sample at temperature 1 / inv_t (the
    Gumbel-max trick: argmax of logits / t plus Gumbel noise)."""
    x = logits.astype(mx.float32)
    noise = mx.random.gumbel(x.shape)
    sampled = mx.argmax(x * inv_t[:, None] + noise, axis=-1)
    return mx.where(inv_t == 0, mx.argmax(x, axis=-1), sampled)


def _apply_top_k(x: mx.array, ks: list[int]) -> mx.array:
    active = [k for k in ks if k > 0]
    if not active:
        return x
    kmax = min(max(active), x.shape[-1])
    top = mx.sort(mx.topk(x, kmax, axis=-1), axis=-1)[:, ::-1]  # descending
    col = mx.array([min(k, kmax) - 1 if k > 0 else 0 for k in ks])
    thresh = mx.take_along_axis(top, col[:, None], axis=-1)
    on = mx.array([k > 0 for k in ks])[:, None]
    return mx.where(on & (x < thresh), NEG_INF, x)


def _apply_top_p(x: mx.array, ps: list[float]) -> mx.array:
    rows = [r for r, p in enumerate(ps) if 0.0 < p < 1.0]
    if not rows:
        return x
    ridx = mx.array(rows)
    sub = x[ridx]
    probs = mx.softmax(sub, axis=-1)
    sorted_p = mx.sort(probs, axis=-1)[:, ::-1]
    cum = mx.cumsum(sorted_p, axis=-1)
    p = mx.array([ps[r] for r in rows], dtype=mx.float32)[:, None]
    # Keep the smallest set whose mass reaches p (always at least the top token).
    keep = (cum - sorted_p) < p
    thresh = mx.min(mx.where(keep, sorted_p, mx.inf), axis=-1, keepdims=True)
    x[ridx] = mx.where(probs < thresh, NEG_INF, sub)
    return x


def _apply_min_p(x: mx.array, ps: list[float]) -> mx.array:
    if not any(p > 0 for p in ps):
        return x
    probs = mx.softmax(x, axis=-1)
    thresh = mx.array(ps, dtype=mx.float32)[:, None] * mx.max(probs, axis=-1, keepdims=True)
    return mx.where(probs < thresh, NEG_INF, x)
