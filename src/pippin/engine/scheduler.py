"""Continuous batching: which sequences run this step, and how many tokens each.

Decodes go first (one token each) so running streams never stall behind a long
prompt; then prefills continue in chunks under the step's token budget; then
waiting sequences are admitted while KV blocks and the budget allow. When a
decode needs a block and none is free, the newest running sequence is
preempted: its blocks are freed and it is recomputed later.

Under the "priority" policy (vLLM's `--scheduling-policy priority`) every queue is
ordered by rank, (priority, arrival), the lowest first: the waiting queue, the order
running sequences take blocks and budget in, and the victim (the highest rank). A
waiting sequence that cannot be admitted for want of blocks or a batch slot preempts
running sequences of a larger priority value, the highest rank first. A preempted
sequence keeps its tokens; its full blocks stay in the prefix cache, so it resumes by
recomputing only what was evicted meanwhile, and samples on as it would have (a seed
draws per output position, not per step).
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pippin.engine.block_manager import BlockManager, salt_root
from pippin.engine.config import SCHEDULING_POLICIES
from pippin.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from pippin.engine.cache_tiers import CacheTiers
    from pippin.engine.state_snapshots import StateSnapshots


def rank(seq: Sequence) -> tuple[int, int]:
    """Its place under the priority policy: priority value, then arrival (ids grow)."""
    return seq.params.priority, seq.seq_id


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first token position computed this step
    length: int  # tokens computed this step
    # Proposed tokens verified this step (speculative decoding), counted in `length`.
    draft: list[int] = field(default_factory=list)
    # A draft model's distributions the proposals were drawn from, [len(draft), vocab]
    # (None: prompt lookup's, a point mass on each).
    draft_probs: Any = None

    @property
    def samples(self) -> bool:
        """Whether this step ends at the sequence's last token (so it yields a new one)."""
        return self.start + self.length - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    decodes: list[ScheduledSeq] = field(default_factory=list)
    prefills: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        tiers: CacheTiers | None = None,
        snapshots: StateSnapshots | None = None,
        policy: str = "fcfs",
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.priority = policy == "priority"
        self.bm = block_manager
        # Models with recurrent layers: their state at block boundaries, without which
        # cached blocks cannot be resumed from.
        self.snapshots = snapshots
        # The prefix cache's lower tiers: promoted blocks are installed before each
        # step is scheduled, evicted ones copied out after it.
        self.tiers = tiers
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.budget = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.table.root = salt_root(seq.params.cache_salt, seq.lora_key)
        self._enqueue(seq, front=False)
        if self.tiers is not None:
            self.tiers.prefetch(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        if self.snapshots is not None:
            self.snapshots.commit(seq, ending=True)
        self.bm.free_table(seq.table)
        seq.status = Status.FINISHED
        seq.recurrent = None
        if self.tiers is not None:
            self.tiers.forget(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        if self.snapshots is not None:
            # Its state so far is a snapshot it resumes from, if its blocks stay cached.
            self.snapshots.commit(seq, ending=True)
        self.bm.free_table(seq.table)
        seq.status = Status.WAITING
        seq.num_computed = 0
        seq.recurrent = None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, front=True)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Into the waiting queue: by rank under the priority policy, else at the back
        (new) or the front (preempted, so it resumes before newer ones start)."""
        if self.priority:
            self.waiting.insert(bisect.bisect(self.waiting, rank(seq), key=rank), seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def _victim(self) -> Sequence:
        return max(self.running, key=rank) if self.priority else self.running[-1]

    def preempt_all(self) -> list[Sequence]:
        """Preempt every running sequence (they resume oldest first, ahead of the waiting
        ones); returns them."""
        running = list(self.running)
        for seq in reversed(running):
            self._preempt(seq)
        return running

    def schedule(self) -> SchedulerOutput:
        if self.tiers is not None:
            self.tiers.poll()
        out = self._schedule()
        if self.tiers is not None:
            self.tiers.spill_evicted()
        return out

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.budget

        # One pass sorts the running sequences (a step may hold hundreds of them).
        decoding: list[tuple[Sequence, int]] = []
        prefilling: list[Sequence] = []
        for s in self.running:
            n = s.num_tokens
            if s.num_computed < n - 1:
                prefilling.append(s)
            elif not s.exhausted(self.max_model_len):
                decoding.append((s, n))
        if self.priority:
            # The most urgent first: the victim (the highest rank) is never one already
            # scheduled in this step.
            decoding.sort(key=lambda d: rank(d[0]))
            prefilling.sort(key=rank)

        # 1. Running decodes, oldest first; preempt the newest when blocks run out.
        for seq, n in decoding:
            if seq.status is not Status.RUNNING:
                continue  # preempted below in this same loop
            while not self.bm.ensure_capacity(seq.table, n):
                victim = self._victim()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:
                continue
            out.decodes.append(ScheduledSeq(seq, seq.num_computed, 1))
            budget -= 1

        # 2. Prefills already running continue under the budget.
        for seq in prefilling:
            if budget <= 0:
                break
            if seq.status is Status.RUNNING:  # not preempted in 1.
                n = self._chunk(seq, budget)
                out.prefills.append(ScheduledSeq(seq, seq.num_computed, n))
                budget -= n

        # 3. Admit waiting sequences in arrival (or rank) order.
        while self.waiting and budget > 0:
            full = len(self.running) >= self.max_num_seqs
            if full and not self.priority:
                break
            seq = self.waiting[0]
            if seq.pending:
                break  # preempted with tokens in flight: its ids are not all known yet
            if self.tiers is not None and self.tiers.is_promoting(seq):
                break  # its prompt's blocks are on their way from disk
            if seq.wait_for is not None:
                if seq.wait_for.status is Status.RUNNING and seq.wait_for.is_prefilling:
                    break  # keep order: it will find the sibling's blocks next step
                seq.wait_for = None
            ids = seq.all_keys
            # Prompt logprobs need every position's logits: nothing comes from the cache.
            cached, hashes = (
                ([], []) if seq.scores_prompt else self.bm.match_prefix(ids, seq.table.root)
            )
            state = None
            if self.snapshots is not None:
                # Recurrent layers resume only where their state was kept.
                cached, hashes, state = self.snapshots.deepest(cached, hashes)
            need = self.bm.blocks_for(len(ids)) - len(cached)
            if full or not self.bm.can_allocate(need, cached):
                # Wait for running sequences to free blocks (one that could never fit
                # was refused at submission: the context is capped to the pool), or
                # under the priority policy, take them from less urgent ones.
                freed = self._preempt_for(seq, need, cached, out) if self.priority else None
                if freed is None:
                    break
                budget += freed
            self.waiting.popleft()
            self.bm.allocate(seq.table, len(ids), cached, hashes)
            seq.num_computed = len(cached) * self.bm.block_size
            if seq.num_preemptions == 0:
                seq.num_cached = seq.num_computed
            seq.recurrent = state
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = self._chunk(seq, budget)
            out.prefills.append(ScheduledSeq(seq, seq.num_computed, n))
            budget -= n
        return out

    def _preempt_for(
        self, seq: Sequence, need: int, cached: list[int], out: SchedulerOutput
    ) -> int | None:
        """Preempt the fewest running sequences of a larger priority value than `seq`'s,
        the highest rank first, that give it a batch slot and `need` blocks (beside its
        `cached` ones); none if all of them would not. Returns the step budget they give
        back (their rows are taken out of `out`), or None."""
        candidates = sorted(
            (s for s in self.running if s.params.priority > seq.params.priority),
            key=rank,
            reverse=True,
        )
        reclaimed = sum(1 for b in cached if self.bm.blocks[b].ref_count == 0)
        keep = set(cached)  # shared with `seq`: freeing them frees nothing for it
        held: Counter[int] = Counter()
        victims: list[Sequence] = []
        for v in candidates:
            victims.append(v)
            held.update(v.table.block_ids)
            freed = sum(
                1 for b, k in held.items() if b not in keep and self.bm.blocks[b].ref_count == k
            )
            slot = len(self.running) - len(victims) < self.max_num_seqs
            if slot and self.bm.num_free + freed >= need + reclaimed:
                break
        else:
            return None  # no candidates, or too few blocks even with all of them
        gained = 0
        gone = set(victims)
        for items in (out.decodes, out.prefills):
            gained += sum(it.length for it in items if it.seq in gone)
            items[:] = [it for it in items if it.seq not in gone]
        for v in victims:
            self._preempt(v)
            out.preempted.append(v)
        return gained if self.bm.can_allocate(need, cached) else None

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The next prefill chunk's length: what is left, within the budget, cut at the
        next recurrent-state snapshot point if one comes first."""
        n = min(seq.num_tokens - seq.num_computed, budget)
        if self.snapshots is not None:
            n = self.snapshots.clip(seq.num_computed, n, seq.num_tokens)
        return n
