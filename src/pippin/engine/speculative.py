"""Speculative decoding inside the batched engine, with prompt lookup (n-gram) proposals
or a draft model's (`pippin.engine.draft_model`).

Prompt lookup: a decoding sequence whose last tokens occurred earlier in its own tokens is
given the tokens that followed them there as proposals. A draft model proposes its own
next k tokens, drawn from its distributions q. Then one model call computes its last known
token and the k proposals (a k + 1-token chunk on top of its cache, as chunked prefill
runs) and returns the logits at all k + 1 positions; the rejection sampler
(`pippin.engine.rejection`) keeps a prefix of the proposals and draws one more token, so
a step emits 1 to k + 1 tokens, distributed exactly as without speculation.

KV: the step writes the proposals' KV into the sequence's blocks (grown for them); after
it only the kept tokens' KV counts (`num_computed`), blocks past the sequence's tokens are
freed (`BlockManager.trim`), and only full blocks of kept tokens reach the prefix cache.

Per request, each sampling feature is either exact in the verify step or turns
speculation off for that request:
- greedy, temperature, top_k, top_p, min_p: exact (the target distribution per position).
- logit_bias, min_tokens, repetition / presence / frequency penalties: exact, applied per
  position with the proposals before it counted as output.
- logprobs / top_logprobs: of each emitted token, as without speculation.
- stop strings, stop tokens, EOS, max_tokens: each emitted token goes through the output
  processor in order; the rest are dropped once one ends the sequence (proposals never
  pass max_tokens or the context).
- seed: off (a seeded request's noise depends on the step; with speculation its tokens
  would be another, equally distributed, sample).
- images or audio (vision models): off (the verify chunk's multimodal positions are not
  built).
- structured output (grammar masks) and reasoning budgets: off (their state would have to
  advance through proposals and roll back).

Recurrent layers (hybrid models: Qwen3-Next / Qwen3.5 gated DeltaNet, Mamba hybrids)
keep a state per sequence that the verify call runs every proposal through, refused ones
included, and it cannot be rewound by trimming as KV can. So each verifying row's state
from before the call is kept (its arrays are never written in place: the model code
assigns new ones, and the kept reference stops MLX from reusing their buffers); a row
that refused a proposal gets it back and its kept tokens are replayed on it in a second
call, batched over such rows, launched right after the verdict and never sampled: its
state then folds in exactly the kept tokens, as one-token decodes would have left it
(its attention layers write the same KV again). A row that kept every proposal keeps
the verify call's state. The replay costs a model call over the refused rows' 1 + kept
tokens in steps where any row refused something. A call's rows shorter than its longest
are right-padded and the runner keeps the padding out of their state; in the families
whose recurrent layers cannot (`ModelRunner.masks_padding`), the verify and replay calls
are split into one per row length.

A draft model (`pippin.engine.draft_model`) draws its proposals from its own logits at
the request's temperature, top-k/p and min-p and hands its distributions q to the
rejection sampler with them; penalties, logit bias and min_tokens act in the verify step
only (still exact; fewer proposals kept). Its own KV is caught up, trimmed and freed by
`DraftModel` (`settle` after each verdict, `forget` when a sequence ends). The
checkpoint's own multi-token-prediction layers (`pippin.engine.mtp`) propose the same
way, from the target's hidden states, which each target call hands over (`saw`).

Per step: speculation needs every token known on the host, so it gives up the overlap of
one step's host work with the previous step's device work; and verifying costs k + 1
positions per sequence. A step speculates only while at most `disable_by_batch_size`
sequences run (vLLM's name for the threshold); above it the engine decodes as usual.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pippin.engine.block_manager import BlockManager
from pippin.engine.config import SpeculativeConfig
from pippin.engine.draft_model import DraftModel
from pippin.engine.grammar_masks import GrammarMasks, split_constrained
from pippin.engine.mtp import MtpProposer
from pippin.engine.output_processor import OutputProcessor
from pippin.engine.rejection import judge, walk
from pippin.engine.sampler import SampleResult, adjust, sample, shaped
from pippin.engine.scheduler import ScheduledSeq, SchedulerOutput
from pippin.engine.types import RequestOutput, SamplingParams, TokenLogprob
from pippin.runner.batch import equal_length_groups

if TYPE_CHECKING:
    from pippin.engine.sequence import Sequence
    from pippin.engine.state_snapshots import StateSnapshots
    from pippin.runner.model_runner import ModelRunner

log = logging.getLogger(__name__)

# The most steps a sequence whose lookups keep finding nothing waits between two tries.
MAX_BACKOFF = 8


def propose_ngram(ids: list[int] | np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    of `ids` (of `n_max` down to `n_min` tokens); [] if none occurred."""
    arr = np.asarray(ids, dtype=np.int64)
    L = len(arr)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        # Windows that end before the last token, so a token follows each.
        hits = np.flatnonzero((sliding_window_view(arr[:-1], n) == arr[L - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []


def speculates(params: SamplingParams) -> bool:
    """Whether a request's settings allow speculation (see the module's list)."""
    return (
        params.seed is None
        and params.constraint is None
        and params.thinking is None
        and params.mm is None
    )


class EngineCore(Protocol):
    """What a speculative step uses of `pippin.engine.core.EngineCore`."""

    max_model_len: int
    steps: int
    runner: ModelRunner
    bm: BlockManager
    snapshots: StateSnapshots | None
    grammar: GrammarMasks
    outputs: OutputProcessor
    eos_ids: set[int]

    def _forward(
        self, sched: SchedulerOutput
    ) -> tuple[list[ScheduledSeq], list[ScheduledSeq], list[mx.array]]: ...

    def _append_tokens(self, sampling: list[ScheduledSeq], result: SampleResult) -> None: ...

    def _collect(self, sampling: list[ScheduledSeq]) -> list[RequestOutput]: ...


@dataclass
class _At:
    """A sequence as of one verified position: its proposals up to there count as output,
    so penalties and min_tokens see what they would see one token at a time."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    index: int
    forced: list[int] = field(default_factory=list)

    @property
    def num_output(self) -> int:
        return len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: DraftModel | None = None) -> None:
        self.config = config
        self.draft = draft  # None: prompt lookup; an `MtpProposer` for "mtp"
        # More sequences run than speculate (an MTP head then holds no hidden states).
        self._crowded = False
        # vLLM's counters: verified proposals (drafts), their tokens, and tokens kept,
        # also per position.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens
        # Rows whose recurrent state went back to before their verify call (see above).
        self.num_replays = 0
        # Sequences whose last lookup found nothing: seq_id -> (the step to try again at,
        # the wait that gave it).
        self._backoff: dict[int, tuple[int, int]] = {}

    def stats(self) -> dict[str, int]:
        out = {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
        }
        for i, n in enumerate(self.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_pos{i}"] = n
        out["spec_decode_num_replays"] = self.num_replays
        if self.draft is not None:
            out.update(self.draft.stats())
        return out

    def forget(self, seq: Sequence) -> None:
        """`seq` ended: its draft KV is freed."""
        self._backoff.pop(seq.seq_id, None)
        if self.draft is not None:
            self.draft.forget(seq.seq_id)

    def reset(self) -> None:
        """The pools were made anew (`EngineCore.recover`)."""
        if self.draft is not None:
            self.draft.reset()

    def wanted(self, running: list[Sequence], step: int) -> bool:
        """Whether step `step` may speculate (so the step in flight must finish first)."""
        self._crowded = len(running) > self.config.disable_by_batch_size
        if not running or self._crowded:
            return False
        if len(self._backoff) > 4 * self.config.disable_by_batch_size:
            ids = {s.seq_id for s in running}
            self._backoff = {i: b for i, b in self._backoff.items() if i in ids}
        return any(self._due(s, step) and not s.is_prefilling for s in running)

    def saw(self, items: list[ScheduledSeq], hidden: mx.array | None) -> None:
        """A target call's rows and its last hidden states ([B, L, H]; None unless an
        MTP head reads them): held for the head, for the sequences that may speculate."""
        if hidden is None or not isinstance(self.draft, MtpProposer):
            return
        rows = [(b, it) for b, it in enumerate(items) if speculates(it.seq.params)]
        if self._crowded:
            self.draft.drop([it.seq for _, it in rows])
        else:
            self.draft.saw(rows, hidden)

    def _due(self, seq: Sequence, step: int) -> bool:
        return speculates(seq.params) and self._backoff.get(seq.seq_id, (0, 0))[0] <= step

    def _missed(self, seq: Sequence, step: int) -> None:
        """No proposal: the next tries come after 1, 2, 4 ... MAX_BACKOFF steps, which run
        with the usual overlap (a stream whose text never repeats keeps nearly all of it)."""
        _, last = self._backoff.get(seq.seq_id, (0, 0))
        wait = min(max(1, 2 * last), MAX_BACKOFF)
        self._backoff[seq.seq_id] = (step + wait, wait)

    def propose(self, core: EngineCore, decodes: list[ScheduledSeq]) -> bool:
        """Give the step's decodes their proposals (and the blocks for them); True if any
        got one. Every token must be known on the host."""
        cfg = self.config
        any_draft = False
        step = core.steps
        wanted: list[tuple[ScheduledSeq, int]] = []
        for it in decodes:
            seq = it.seq
            if not self._due(seq, step) or seq.pending:
                continue
            n = seq.num_tokens
            k = min(
                cfg.num_speculative_tokens,
                seq.params.max_tokens - seq.num_output - 1,
                core.max_model_len - n - 1,
            )
            if k <= 0:
                continue
            if self.draft is not None:
                wanted.append((it, k))
                continue
            draft = propose_ngram(seq.all_ids, k, cfg.prompt_lookup_max, cfg.prompt_lookup_min)
            if not draft:
                self._missed(seq, step)
                continue
            self._backoff.pop(seq.seq_id, None)
            if not core.bm.ensure_capacity(seq.table, n + len(draft)):
                continue
            it.draft = draft
            it.length = 1 + len(draft)
            any_draft = True
        if self.draft is not None and wanted:
            self.draft.propose(wanted)
            for it, _ in wanted:
                if not it.draft:
                    continue
                if core.bm.ensure_capacity(it.seq.table, it.seq.num_tokens + len(it.draft)):
                    it.length = 1 + len(it.draft)
                    any_draft = True
                else:
                    self.draft.settle(it.seq.seq_id, 0)
                    it.draft, it.draft_probs = [], None
        return any_draft

    def step(self, core: EngineCore, sched: SchedulerOutput) -> list[RequestOutput]:
        """Run a step whose decodes carry proposals, to its outputs (no overlap)."""
        # Recurrent state before the verify call (a new outer list: the runner assigns
        # each layer's state into the sequence's own).
        before = {
            it.seq.seq_id: list(it.seq.recurrent)
            for it in sched.decodes
            if it.draft and it.seq.recurrent is not None
        }
        everything, sampling, parts = self._forward(core, sched)
        logits = parts[0] if len(parts) == 1 else mx.concatenate(parts)

        plain_rows: list[int] = []
        plain: list[ScheduledSeq] = []
        verify_rows: list[int] = []
        verify: list[ScheduledSeq] = []
        r = 0
        for it in sampling:
            n = 1 + len(it.draft)
            if it.draft:
                verify_rows.extend(range(r, r + n))
                verify.append(it)
            else:
                plain_rows.append(r)
                plain.append(it)
            r += n
        emitted = self._verify(core, logits[mx.array(verify_rows)], verify)
        if plain:
            self._sample_plain(core, logits[mx.array(plain_rows)], plain)
        for it in everything:
            if not it.draft:
                it.seq.num_computed = it.start + it.length
        replay: list[ScheduledSeq] = []
        for it, (tokens, lps) in zip(verify, emitted):
            seq = it.seq
            for tok, lp in zip(tokens, lps):
                core.outputs.append(seq, tok, lp)
                if seq.finish_reason is not None:
                    break
            # The last known token's KV and the kept proposals' are now in the pool.
            kept = len(tokens) - 1
            seq.num_computed = it.start + 1 + kept
            state = before.get(seq.seq_id)
            if state is not None and kept < len(it.draft) and seq.finish_reason is None:
                seq.recurrent = state
                replay.append(ScheduledSeq(seq, it.start, 1 + kept))
            self.num_drafts += 1
            self.num_draft_tokens += len(it.draft)
            self.num_accepted_tokens += kept
            for i in range(kept):
                self.accepted_per_pos[i] += 1
            if self.draft is not None:
                self.draft.settle(seq.seq_id, kept)
            if not seq.finished:
                core.bm.trim(seq.table, seq.num_tokens)
        if replay:
            self.num_replays += len(replay)
            # Not sampled (each ends before its new token): only the KV and state it
            # writes are used, by the next step's call.
            for rows in core.runner.call_groups(replay, similar=False):
                core.runner.forward(rows)
                mx.async_eval(core.runner.arrays_to_eval(rows))
        for it in everything:
            seq = it.seq
            if not seq.finished:
                if it.draft and core.snapshots is not None:
                    core.snapshots.reached(seq, seq.num_computed)
                core.bm.register_full_blocks(seq.table, seq.ids, seq.num_computed)
                if seq.boundaries and core.snapshots is not None:
                    core.snapshots.commit(seq)
        return core._collect(sampling)

    @staticmethod
    def _forward(
        core: EngineCore, sched: SchedulerOutput
    ) -> tuple[list[ScheduledSeq], list[ScheduledSeq], list[mx.array]]:
        """`core._forward`, with the decodes (1 + len(draft) tokens each) in a call per
        length where padding would run through the recurrent state."""
        if not core.runner.pads_state:
            return core._forward(sched)
        everything: list[ScheduledSeq] = []
        sampling: list[ScheduledSeq] = []
        parts: list[mx.array] = []
        calls = [SchedulerOutput(decodes=g) for g in equal_length_groups(sched.decodes)]
        for part in [*calls, SchedulerOutput(prefills=sched.prefills)]:
            # Each call launched before the next scatters into the same pools (as
            # `core._forward` does between its own calls).
            mx.async_eval(parts, core.runner.arrays_to_eval(everything))
            rows, samples, logits = core._forward(part)
            everything += rows
            sampling += samples
            parts += logits
        return everything, sampling, parts

    @staticmethod
    def _sample_plain(core: EngineCore, logits: mx.array, items: list[ScheduledSeq]) -> None:
        logits, items, constrained = split_constrained(logits, items)
        if items:
            core._append_tokens(items, sample(logits, [it.seq for it in items], core.eos_ids))
        if constrained is not None:
            c_logits, c_items = constrained
            seqs = [it.seq for it in c_items]
            allowed = core.grammar.allowed(seqs, c_logits.shape[-1])
            core._append_tokens(c_items, sample(c_logits, seqs, core.eos_ids, allowed))

    @staticmethod
    def _verify(
        core: EngineCore, logits: mx.array, items: list[ScheduledSeq]
    ) -> list[tuple[list[int], list[TokenLogprob | None]]]:
        """Each item's emitted tokens and their logprobs (None where not asked)."""
        rows: list[Any] = []
        greedy: list[bool] = []
        draft: list[int] = []
        for it in items:
            seq = it.seq
            for j in range(len(it.draft) + 1):
                out = seq.output_ids + it.draft[:j]
                rows.append(_At(seq.params, seq.prompt_ids, out, seq.index))
                greedy.append(seq.params.temperature <= 0.0)
                draft.append(it.draft[j] if j < len(it.draft) else 0)
        adjusted, _ = adjust(logits, rows, core.eos_ids)
        q = _draft_probs(items, logits.shape[-1])
        v = judge(shaped(adjusted, rows), mx.array(greedy), mx.array(draft, dtype=mx.int32), q)
        want_lp = any(it.seq.params.logprobs for it in items)
        logprobs = top_ids = top_lp = None
        k = max(it.seq.params.top_logprobs for it in items) if want_lp else 0
        if want_lp:
            logprobs = adjusted - mx.logsumexp(adjusted, axis=-1, keepdims=True)
            if k > 0:
                top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
                top_lp = mx.take_along_axis(logprobs, top_ids, axis=-1)
        mx.eval(v.kept, v.residual, v.plain)
        kept, residual, plain = v.kept.tolist(), v.residual.tolist(), v.plain.tolist()
        out: list[tuple[list[int], list[TokenLogprob | None]]] = []
        r = 0
        picked: list[tuple[int, int]] = []  # (flat row, token) of every emitted token
        for it in items:
            n = len(it.draft) + 1
            tokens = walk(kept[r : r + n], residual[r : r + n], plain[r : r + n], it.draft)
            picked.extend((r + j, t) for j, t in enumerate(tokens))
            out.append((tokens, [None] * len(tokens)))
            r += n
        if logprobs is not None:
            pr = mx.array([p for p, _ in picked])
            chosen = logprobs[pr, mx.array([t for _, t in picked])].tolist()
            tids = top_ids[pr].tolist() if top_ids is not None else None
            tlps = top_lp[pr].tolist() if top_lp is not None else None
            i = 0
            for it, (tokens, lps) in zip(items, out):
                p = it.seq.params
                for j, t in enumerate(tokens):
                    if p.logprobs:
                        top: list[tuple[int, float]] = []
                        if p.top_logprobs and tids is not None and tlps is not None:
                            top = sorted(zip(tids[i], tlps[i]), key=lambda x: -x[1])
                            top = top[: p.top_logprobs]
                        lps[j] = TokenLogprob(t, chosen[i], top)
                    i += 1
        return out


def _draft_probs(items: list[ScheduledSeq], width: int) -> mx.array | None:
    """The draft model's q per verified row, [rows, width] (a zero row after each item's
    proposals: its bonus position); None for prompt lookup's point masses."""
    if all(it.draft_probs is None for it in items):
        return None
    parts: list[mx.array] = []
    for it in items:
        q = it.draft_probs
        if q is None:  # a point mass on each proposal
            q = mx.zeros((len(it.draft), width))
            if it.draft:
                q[mx.arange(len(it.draft)), mx.array(it.draft)] = 1.0
        elif q.shape[-1] != width:
            pad = width - q.shape[-1]
            q = q[:, :width] if pad < 0 else mx.pad(q, [(0, 0), (0, pad)])
        parts += [q, mx.zeros((1, width))]
    return mx.concatenate(parts)
