"""The engine side of constrained decoding: one matcher per sequence, masks per step.

A constrained row's mask depends on the token sampled just before it, which the step in
flight still holds. So the engine launches the model for the step first, then (while the
device runs it) turns the previous step's tokens into outputs, advances the matchers and
computes the masks here, and only then samples the constrained rows. Unconstrained rows
are sampled with the model call as before and never wait for a mask.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import fill_next_token_bitmask, fill_next_token_bitmask_par

from pippin.engine.constraint import Constraint


class Phase(enum.Enum):
    """Where a sequence is: its first token may still open a reasoning section; inside
    that section (unconstrained); or in the constrained answer."""

    MAY_REASON = "may_reason"
    REASONING = "reasoning"
    ANSWER = "answer"


MAY_REASON, REASONING, ANSWER = Phase.MAY_REASON, Phase.REASONING, Phase.ANSWER


@dataclass
class GrammarState:
    """A sequence's own matcher and how far it has read the sequence's output."""

    matcher: LLMatcher
    phase: Phase
    seen: int = 0  # output tokens already read
    tail: list[int] = field(default_factory=list)  # last tokens, to spot the end marker

    @classmethod
    def start(cls, c: Constraint) -> GrammarState:
        if c.think_open:
            phase = REASONING
        elif c.think_start_id is not None:
            phase = MAY_REASON
        else:
            phase = ANSWER
        return cls(c.matcher.deep_copy(), phase)

    def read(self, output_ids: Seq[int], c: Constraint, eos_ids: set[int]) -> None:
        """Advance over the tokens generated since the last call."""
        for tok in output_ids[self.seen :]:
            self.seen += 1
            if self.phase == MAY_REASON:
                if tok == c.think_start_id:
                    self.phase = REASONING
                    continue
                self.phase = ANSWER
            if self.phase == REASONING:
                self.tail = (self.tail + [tok])[-len(c.think_end_ids) :]
                if tuple(self.tail) == c.think_end_ids:
                    self.phase = ANSWER
                continue
            if tok in eos_ids and self.matcher.is_accepting():
                continue  # the end of the sequence, not part of the answer
            # A token the mask allowed is always accepted; a failure (a forced reasoning
            # marker, a grammar bug) leaves the matcher in its error state, which allows
            # only EOS from then on.
            self.matcher.consume_token(tok)


def _state(seq: Any) -> GrammarState:
    if seq.grammar is None:
        seq.grammar = GrammarState.start(seq.params.constraint)
    return seq.grammar


class GrammarMasks:
    """Computes the allowed tokens of a step's constrained rows."""

    def __init__(self, eos_ids: set[int]) -> None:
        self.eos_ids = eos_ids
        self._executor: LLExecutor | None = None

    def allowed(self, seqs: Seq[Any], width: int) -> mx.array:
        """[rows, width] bool: which tokens each sequence may produce next.

        `seqs` are engine `Sequence`s whose `params.constraint` is set; every token they
        produced so far must be in their `output_ids`.
        """
        n = len(seqs)
        # The matchers' width: the tokenizer's, which covers the logits' ids.
        words = (seqs[0].params.constraint.n_vocab + 31) // 32
        bitmask = np.full((n, words), -1, dtype=np.int32)
        jobs: list[tuple[LLMatcher, int]] = []
        starts: list[tuple[int, int]] = []
        eos_only: list[int] = []
        for r, seq in enumerate(seqs):
            if seq.finished:
                continue  # a row wasted on a sequence that ended in the step before
            c: Constraint = seq.params.constraint
            st = _state(seq)
            st.read(seq.output_ids, c, self.eos_ids)
            if st.phase == REASONING:
                continue
            if st.matcher.is_error():
                eos_only.append(r)
                continue
            jobs.append((st.matcher, r))
            if st.phase == MAY_REASON and c.think_start_id is not None:
                starts.append((r, c.think_start_id))
        if jobs:
            self._fill(jobs, bitmask)
        bits = bitmask.view(np.uint32)
        for r in eos_only:
            bits[r] = 0
            for tok in self.eos_ids:
                _set(bits, r, tok)
        for r, tok in starts:
            _set(bits, r, tok)
        return unpack(bitmask, width)

    def _fill(self, jobs: list[tuple[LLMatcher, int]], bitmask: np.ndarray) -> None:
        if len(jobs) == 1:
            fill_next_token_bitmask(jobs[0][0], bitmask, jobs[0][1])
            return
        if self._executor is None:
            self._executor = LLExecutor()
        fill_next_token_bitmask_par(self._executor, jobs, bitmask)


def _set(bits: np.ndarray, row: int, tok: int) -> None:
    if 0 <= tok < bits.shape[1] * 32:
        bits[row, tok // 32] |= np.uint32(1 << (tok % 32))


def unpack(bitmask: np.ndarray, width: int) -> mx.array:
    """[rows, words] bits (token t is bit t % 32 of word t // 32) -> [rows, width] bool,
    expanded on the device so only 1/32 of the mask crosses over. Ids beyond the
    mask (logits wider than the vocabulary) are not allowed."""
    words = mx.array(bitmask.view(np.uint32))
    shifts = mx.arange(32, dtype=mx.uint32)
    bits = (mx.right_shift(words[:, :, None], shifts) & 1).reshape(bitmask.shape[0], -1)
    if bits.shape[1] < width:
        pad = mx.zeros((bits.shape[0], width - bits.shape[1]), bits.dtype)
        bits = mx.concatenate([bits, pad], axis=1)
    return bits[:, :width].astype(mx.bool_)


def split_constrained(
    logits: mx.array, items: list[Any]
) -> tuple[mx.array, list[Any], tuple[mx.array, list[Any]] | None]:
    """Split a step's sampled rows (anything with a `.seq`): (logits, items) of the
    unconstrained rows, and (logits, items) of the constrained ones, or None if none is."""
    c_rows = [r for r, it in enumerate(items) if it.seq.params.constraint is not None]
    if not c_rows:
        return logits, items, None
    if len(c_rows) == len(items):
        return logits[:0], [], (logits, items)
    taken = set(c_rows)
    u_rows = [r for r in range(len(items)) if r not in taken]
    return (
        logits[mx.array(u_rows)],
        [items[r] for r in u_rows],
        (logits[mx.array(c_rows)], [items[r] for r in c_rows]),
    )
