"""Speculative decoding's draft model (`--speculative-config '{"model": ...}'`).

A second, smaller model sharing the target's vocabulary proposes each speculating
sequence's next k tokens, one batched decode call of it per token, and keeps its
distributions q, which the rejection sampler (`pippin.engine.rejection`) needs to keep a
proposal with probability min(1, p/q). It runs in the engine's thread with a
`ModelRunner` and a `BlockManager` of its own (its own paged KV pool and prefix cache:
a prompt whose draft KV another sequence computed is not computed again).

Its KV follows each sequence lazily: a sequence's draft KV is computed only in the steps
where it speculates, from where it stopped up to the sequence's last token (the whole
prompt the first time, then the one or two tokens the target kept past the draft's
proposals: its corrected or bonus token). That is the simpler of the two designs:
- every token is known on the host in a speculative step (the step in flight has
  finished), so the catch-up reads them like any prefill chunk, while prefilling
  alongside the target's chunks would need the tokens the overlapped steps still
  hold on the device;
- a sequence that never speculates (a seeded request, a batch above
  `disable_by_batch_size`) never costs the draft anything.
A long catch-up (a new prompt) is chunked under the step's token budget
(`max_num_batched_tokens`); a sequence whose catch-up does not end in this step just
decodes plainly in it and proposes in a later one.

After the target's verdict the draft keeps the KV of the proposals it kept (the last
proposal's KV was never computed: it was sampled, not fed) and its block table is
trimmed to them (`settle`). Its blocks are freed when the sequence ends (`forget`), and
its tables are dropped (to be caught up again later) when its pool runs short.

A draft with recurrent layers (a hybrid) keeps its state per sequence too. Proposing
feeds its proposals one call at a time, so the state after each call is a checkpoint
for free: `settle` takes back the one after the last kept proposal it fed. Its KV
blocks are not shared between sequences (their state could not be rebuilt from them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from pippin.engine.block_manager import BlockManager, BlockTable
from pippin.engine.config import SpeculativeConfig
from pippin.engine.sampler import adjust, shaped
from pippin.runner.model_runner import ModelRunner
from pippin.runner.paged_cache import bytes_per_block
from pippin.store.loaded import LoadedModel, ModelLoadError
from pippin.store.loader import load_model, materialize

if TYPE_CHECKING:
    from pippin.engine.scheduler import ScheduledSeq
    from pippin.engine.sequence import Sequence

log = logging.getLogger(__name__)

NEG_INF = float("-inf")


class DraftModelError(ModelLoadError):
    """A draft model pippin cannot run with this target; the message says why."""


def check_vocab(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose tokenizer maps any token to another id than the target's."""
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv == dv:
        return
    differ = sum(1 for t, i in tv.items() if dv.get(t) != i) + len(set(dv) - set(tv))
    raise DraftModelError(
        f"--speculative-config: the draft model {draft.source} does not share the target's "
        f"vocabulary ({len(dv)} tokens against {len(tv)}, {differ} mapped differently); "
        "a draft model must use the target's tokenizer"
    )


@dataclass(eq=False)
class _DraftSeq:
    """A target sequence as the draft runner reads it (`pippin.runner.batch.RunSequence`):
    the target's tokens, the draft's own block table and KV count."""

    source: Sequence
    table: BlockTable = field(default_factory=BlockTable)
    computed: int = 0  # tokens whose draft KV is in the draft's pool
    # Position i's input is the sequence's token shift + i (an MTP head's: see
    # `pippin.engine.mtp`).
    shift: int = 0
    # The step's proposal: where its fed positions start (a draft's: the sequence's
    # length when it was made), and its size.
    base: int = 0
    k: int = 0
    pending: list[tuple[Any, int]] = field(default_factory=list)
    known: int = 0  # what the runner takes for the tokens known on the host
    recurrent: list[Any] | None = None
    # Recurrent drafts: the state after `base + j` tokens at index j, while proposing.
    states: list[list[Any]] = field(default_factory=list)
    media: Any = None

    @property
    def num_known(self) -> int:
        return self.known

    @property
    def request_id(self) -> str:
        return self.source.request_id

    def ids(self, start: int, end: int) -> list[int]:
        return self.source.ids(start + self.shift, end + self.shift)


@dataclass
class _Row:
    """One row of a draft call (`pippin.runner.batch.RunItem`)."""

    seq: _DraftSeq
    start: int
    length: int
    samples: bool
    draft: list[int] = field(default_factory=list)
    hidden: mx.array | None = None  # an MTP head's input beside the tokens, [length, H]


class DraftModel:
    # Whether the KV of the proposals it fed stays after a verdict that kept them (an MTP
    # head's does not: it was computed from the head's own hidden states).
    keeps_fed = True

    def __init__(
        self,
        config: SpeculativeConfig,
        target: LoadedModel,
        *,
        block_size: int,
        budget: int,
        draft: LoadedModel | None = None,
    ) -> None:
        """`draft`: the model already loaded (tests); else `config.model` is loaded. Its
        KV pool comes with `allocate`, once the engine has shared the memory out."""
        assert config.model is not None
        if draft is None:
            draft = materialize(load_model(config.model))
        check_vocab(target, draft)
        self.loaded = draft
        self._setup(ModelRunner(draft.model, block_size), target, block_size, budget)

    def _setup(
        self, runner: ModelRunner, target: LoadedModel, block_size: int, budget: int
    ) -> None:
        self.runner = runner
        self.bytes_per_block = bytes_per_block(self.runner.kv_specs, block_size)
        self.num_blocks = 0
        self.block_size = block_size
        self.bm: BlockManager  # with the pool, in `allocate`
        self.budget = budget
        # Proposals and q are over the target's logits; the draft's own may be wider or
        # narrower (padding past the tokenizer's ids), so its extra ids are never drawn.
        self.width = target.vocab_size
        self.eos_ids = set(target.eos_token_ids)
        self.seqs: dict[int, _DraftSeq] = {}
        self.num_evictions = 0

    def allocate(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.runner.allocate(num_blocks)
        self.bm = self._block_manager()

    def _block_manager(self) -> BlockManager:
        # A recurrent draft's cached blocks could not be resumed from: no prefix cache.
        caching = not self.runner.has_state_layers
        return BlockManager(self.num_blocks, self.block_size, caching)

    # -- bookkeeping ----------------------------------------------------------
    def forget(self, seq_id: int) -> None:
        ds = self.seqs.pop(seq_id, None)
        if ds is not None:
            self.bm.free_table(ds.table)

    def reset(self) -> None:
        """Fresh pools and no draft KV (after a failed step, as the target's)."""
        self.seqs.clear()
        self.bm = self._block_manager()
        self.runner.reset_pools(self.num_blocks)

    def settle(self, seq_id: int, kept: int) -> None:
        """The target kept `kept` of the sequence's proposals: the draft KV of those it fed
        (all but the last proposal) stays, the rest of its table goes."""
        ds = self.seqs.get(seq_id)
        if ds is None or ds.k == 0:
            return
        fed = min(kept, ds.k - 1) if self.keeps_fed else 0
        ds.computed = ds.base + fed
        if ds.states:
            ds.recurrent, ds.states = ds.states[fed], []
        ds.k = 0
        self.bm.trim(ds.table, ds.computed)
        self.bm.register_full_blocks(ds.table, ds.ids, ds.computed)

    def stats(self) -> dict[str, int]:
        return {
            "spec_draft_blocks_total": self.bm.num_usable,
            "spec_draft_blocks_free": self.bm.num_free,
            "spec_draft_evictions": self.num_evictions,
        }

    def _reserve(self, ds: _DraftSeq, tokens: int, keep: set[int]) -> bool:
        """Blocks for `tokens` tokens of `ds`; other sequences' draft KV (not in `keep`)
        is dropped, oldest first, while the pool is short."""
        while not self.bm.ensure_capacity(ds.table, tokens):
            victim = next((i for i in self.seqs if i not in keep), None)
            if victim is None:
                return False
            self.forget(victim)
            self.num_evictions += 1
        return True

    # -- proposing ------------------------------------------------------------
    def propose(self, wanted: list[tuple[ScheduledSeq, int]]) -> None:
        """Give each (decode, k) its proposal, up to k tokens in `it.draft` with the
        draft's distributions in `it.draft_probs` ([k, vocab]); those whose draft KV is
        not caught up within the step's budget, or whose blocks run out, get none."""
        keep = {it.seq.seq_id for it, _ in wanted}
        rows: list[_Row] = []
        ks: list[int] = []
        budget = self.budget
        # Short catch-ups first: a steady stream needs one or two tokens, a new prompt more.
        for it, k in sorted(wanted, key=lambda w: w[0].seq.num_tokens - self._computed(w[0])):
            ds = self._sequence(it.seq)
            if ds is None:
                continue
            behind = self._behind(ds)
            chunk = min(behind, budget)
            if chunk <= 0:
                continue
            done = chunk == behind
            # Proposals 1 .. k-1 are fed back, so their KV needs room too.
            if not self._reserve(ds, ds.computed + chunk + (k - 1 if done else 0), keep):
                continue
            budget -= chunk
            rows.append(self._row(ds, chunk, done))
            ks.append(k if done else 0)
        if not rows:
            return
        # Catch-up calls, then one decode call per further proposal, all left lazy:
        # each call's inputs are the previous call's draws.
        drawn: dict[int, list[tuple[mx.array, mx.array, int]]] = {}  # row -> (tokens, q, r)
        last: dict[int, tuple[mx.array, int, mx.array | None]] = {}  # and the hidden state
        index = {id(r): b for b, r in enumerate(rows)}
        for group in self.runner.call_groups(rows):
            self._call(group, [index[id(r)] for r in group], drawn, last)
        recurrent = self.runner.has_state_layers
        for r, k in zip(rows, ks):
            r.seq.computed = r.start + r.length
            self.bm.register_full_blocks(r.seq.table, r.seq.ids, r.seq.computed)
            if recurrent and k:
                r.seq.states = [list(r.seq.recurrent)]  # a new list: the runner's is reused
        for j in range(1, max(ks)):
            live = [b for b, k in enumerate(ks) if k > j]
            items = []
            for b in live:
                ds = rows[b].seq
                pos = ds.computed + j - 1
                tokens, r, hidden = last[b]
                ds.pending, ds.known = [(tokens, r)], pos
                items.append(_Row(ds, pos, 1, True, hidden=hidden))
            self._call(items, live, drawn, last)
            if recurrent:
                for it in items:
                    it.seq.states.append(list(it.seq.recurrent))
        for r in rows:
            r.seq.pending = []
        arrays = {id(t): t for d in drawn.values() for t, _, _ in d}
        mx.eval(list(arrays.values()))  # the step's one wait for the draft
        host = {i: t.tolist() for i, t in arrays.items()}
        by_seq = {rows[b].seq.source.seq_id: b for b in drawn}
        for it, _ in wanted:
            b = by_seq.get(it.seq.seq_id)
            if b is None:
                continue
            ds, k = rows[b].seq, ks[b]
            it.draft = [host[id(t)][r] for t, _, r in drawn[b][:k]]
            it.draft_probs = mx.stack([q[r] for _, q, r in drawn[b][:k]])
            ds.base, ds.k = ds.computed, k
            ds.computed = ds.base + k - 1  # until `settle`

    def _sequence(self, seq: Sequence) -> _DraftSeq | None:
        """The sequence's draft state (made on its first proposal); None: it cannot
        propose."""
        ds = self.seqs.get(seq.seq_id)
        if ds is None:
            ds = self.seqs[seq.seq_id] = self._start(seq)
        return ds

    def _behind(self, ds: _DraftSeq) -> int:
        """Positions the draft must compute before it proposes: up to the last token."""
        return ds.source.num_tokens - ds.computed

    def _row(self, ds: _DraftSeq, length: int, samples: bool) -> _Row:
        """The catch-up row of `length` positions from where `ds` stopped."""
        return _Row(ds, ds.computed, length, samples)

    def _start(self, seq: Sequence) -> _DraftSeq:
        """A sequence's draft state, with the draft KV of its prompt's cached blocks."""
        ds = _DraftSeq(seq)
        ds.table.root = seq.table.root
        cached, hashes = self.bm.match_prefix(seq.all_ids, ds.table.root)
        self.bm.allocate(ds.table, len(cached) * self.bm.block_size, cached, hashes)
        ds.computed = len(cached) * self.bm.block_size
        return ds

    def _computed(self, it: ScheduledSeq) -> int:
        ds = self.seqs.get(it.seq.seq_id)
        return ds.computed if ds is not None else 0

    def _call(
        self,
        items: list[_Row],
        ids: list[int],
        drawn: dict[int, list[tuple[mx.array, mx.array, int]]],
        last: dict[int, tuple[mx.array, int, mx.array | None]],
    ) -> None:
        """One draft call over `items` (rows `ids` of the step): the draws of the rows
        that sample, appended to theirs."""
        logits = self.runner.forward(items)
        if logits is None:
            mx.async_eval(self.runner.arrays_to_eval(items))
            return
        sampling = [(i, b, it) for i, (b, it) in enumerate(zip(ids, items)) if it.samples]
        tokens, q = self._draw(logits, [it.seq.source for _, _, it in sampling])
        # Launched before the next call scatters into the same pools, so its writes
        # stay in place (as `EngineCore._forward` does).
        mx.async_eval(tokens, q, self.runner.arrays_to_eval(items))
        # A head that reads hidden states is fed its own, of the position it sampled.
        hidden = self.runner.hidden if self.runner.keep_hidden else None
        for r, (i, b, it) in enumerate(sampling):
            drawn.setdefault(b, []).append((tokens, q, r))
            h = None if hidden is None else hidden[i, it.length - 1 : it.length]
            last[b] = (tokens, r, h)

    def _draw(self, logits: mx.array, seqs: list[Sequence]) -> tuple[mx.array, mx.array]:
        """Each row's proposal and the distribution q it was drawn from ([n, vocab]):
        the draft's logits with the request's penalties, logit bias and min_tokens, shaped
        by its temperature, top-k, top-p and min-p (greedy requests: its argmax; their q
        is never read). The penalties see the tokens known on the host, not this step's
        earlier proposals: q is still what each proposal was drawn from, so verification
        stays exact, and proposals follow what the target will verify."""
        x = logits
        n, width = x.shape
        if width > self.width:
            x = x[:, : self.width]
        elif width < self.width:
            x = mx.concatenate([x, mx.full((n, self.width - width), NEG_INF, x.dtype)], axis=-1)
        x, _ = adjust(x, seqs, self.eos_ids)
        xs = shaped(x, seqs)
        q = mx.softmax(xs, axis=-1)
        greedy = mx.array([s.params.temperature <= 0.0 for s in seqs])
        drawn = mx.argmax(xs + mx.random.gumbel(xs.shape), axis=-1)
        tokens = mx.where(greedy, mx.argmax(x, axis=-1), drawn).astype(mx.int32)
        return tokens, q
