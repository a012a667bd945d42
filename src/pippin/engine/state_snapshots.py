"""Recurrent-state snapshots beside the prefix cache, so hybrid models share prefixes.

A model with recurrent layers (Qwen3-Next / Qwen3.5 gated DeltaNet, Mamba hybrids,
LFM2's short convolutions) keeps, besides its attention layers' KV, a state per
sequence that folds in every token so far; KV blocks alone cannot rebuild it. So a
prefix is reusable only where the state after it was kept: a snapshot is that state
(every recurrent layer's arrays, batch 1), taken after the token that ends a full
block and stored under that block's chained key (cache salt and image keys included,
as the block's). A request whose prompt matches cached blocks starts from the deepest
of them that has a snapshot: the snapshot's state plus the blocks' KV.

Snapshots are taken (the scheduler ends prefill chunks there, `clip`):
- at the last block boundary of each prompt: the next agent turn, or the same prompt
  again, finds it;
- every `interval` blocks of a long prompt, so requests that share only a long system
  prompt reuse most of it;
- at the last block boundary a finished generation reached (prompt + answer): a decoding
  sequence keeps its latest boundary state (`Sequence.boundary`) and stores it when it
  ends or is preempted.

They are held in device memory within `max_bytes`, a share of the KV cache budget
(LRU past it), and one is dropped when the block it is keyed by leaves the prefix cache.
With an SSD tier, `on_drop` is told each one leaving memory so (to write it), and
snapshots read back from disk come in through `install` (`pippin.engine.cache_tiers`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from pippin.engine.block_manager import BlockManager
from pippin.runner.recurrent_state import as_arrays

# Per cache layer: that recurrent layer's arrays, or None (attention layers).
State = list[list[mx.array] | None]


def own_copy(state: list[Any]) -> State:
    """A sequence's state (`Sequence.recurrent`) in arrays of its own: a row of a batched
    call's state would keep the whole batch's buffers alive."""
    out: State = []
    for entry in state:
        arrays = as_arrays(entry)
        out.append(None if arrays is None else [mx.contiguous(a) for a in arrays])
    return out


def state_bytes(state: State) -> int:
    return sum(a.nbytes for s in state if s is not None for a in s)


# A snapshot every so many tokens of a long prompt may weigh at most this share of the
# KV those tokens hold (see `snapshot_interval`).
INTERVAL_OVERHEAD = 0.5
# Models with no attention layers (Mamba): no KV to weigh a snapshot against.
STATE_ONLY_INTERVAL_TOKENS = 4096


def snapshot_interval(state_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """Blocks between two snapshots of a long prompt. A snapshot saves a request that
    diverges after it the prefill of the tokens since the one before, so the closer they
    are the less is recomputed; what limits them is memory, so the interval is the
    fewest tokens whose KV weighs 1 / `INTERVAL_OVERHEAD` times a snapshot. Qwen3-Next-80B's
    state (36 gated-delta layers, float32: 73.7 MiB) weighs as much as 3,144 tokens of
    its KV (12 attention layers, 24 KiB a token): a snapshot every 6.3k tokens."""
    if kv_bytes_per_token <= 0:
        tokens = STATE_ONLY_INTERVAL_TOKENS
    else:
        tokens = state_bytes / (INTERVAL_OVERHEAD * kv_bytes_per_token)
    return max(1, -(-int(tokens) // block_size))


@dataclass
class Boundary:
    """A sequence's state after its first `tokens` tokens (a block boundary), until that
    block's key is known: a prompt's snapshot points (`eager`) are stored as soon as it
    is, a generation's latest boundary when the sequence ends or is preempted."""

    tokens: int
    state: State
    eager: bool


class StateSnapshots:
    def __init__(self, bm: BlockManager, max_bytes: int, interval_blocks: int) -> None:
        self.bm = bm
        self.max_bytes = max_bytes
        self.block_size = bm.block_size
        self.interval = interval_blocks * bm.block_size  # 0: prompt ends only
        self._snaps: OrderedDict[int, tuple[State, int]] = OrderedDict()  # key: (state, bytes)
        self.bytes = 0
        self.hits = 0
        self.stores = 0
        self.evictions = 0  # dropped for room or with their block
        # Told each snapshot dropped for room or with its block (the SSD tier writes it).
        self.on_drop: Callable[[int, State], None] | None = None
        bm.on_forget = self._forget

    def __len__(self) -> int:
        return len(self._snaps)

    # -- where chunks end -------------------------------------------------
    def _last(self, num_tokens: int) -> int:
        """The last block boundary a prefix match of these tokens can reach (their last
        token is always computed)."""
        return (num_tokens - 1) // self.block_size * self.block_size

    def clip(self, start: int, n: int, num_tokens: int) -> int:
        """The length of a prefill chunk of a sequence of `num_tokens` tokens from `start`,
        cut at its next snapshot point if that lies inside `n` tokens."""
        last = self._last(num_tokens)
        if last <= start:
            return n
        nxt = last
        if self.interval:
            nxt = min(last, (start // self.interval + 1) * self.interval)
        return min(n, nxt - start)

    def is_point(self, end: int, num_tokens: int) -> bool:
        """Whether a prefill chunk ending at `end` ends at a snapshot point."""
        if end == 0 or end % self.block_size:
            return False
        last = self._last(num_tokens)
        return end == last or bool(self.interval and end % self.interval == 0 and end < last)

    def after_forward(self, items: Seq[Any]) -> None:
        """Keep the state of each row that ended at a block boundary worth a snapshot:
        a prefill chunk at a snapshot point, the last known token at any boundary."""
        for it in items:
            seq = it.seq
            end = it.start + it.length
            if seq.recurrent is None or end % self.block_size or it.draft:
                continue
            eager = self.is_point(end, seq.num_tokens)
            if eager:
                seq.boundaries.append(Boundary(end, own_copy(seq.recurrent), True))
            elif end == seq.num_tokens:
                self.reached(seq, end)

    def reached(self, seq: Any, tokens: int) -> None:
        """The sequence's state now folds in exactly its first `tokens` tokens: its latest
        boundary if they end a block (also after a speculative step's verdict)."""
        if tokens % self.block_size == 0 and seq.recurrent is not None:
            kept = [b for b in seq.boundaries if b.eager]
            seq.boundaries = [*kept, Boundary(tokens, own_copy(seq.recurrent), False)]

    def commit(self, seq: Any, ending: bool = False) -> None:
        """Store the sequence's boundaries whose block is registered and still cached:
        the eager ones now, all of them when it ends or is preempted (`ending`)."""
        hashes = seq.table.hashes
        keep = []
        for b in seq.boundaries:
            n = b.tokens // self.block_size
            if (b.eager or ending) and len(hashes) >= n:
                if self.bm.hash_to_block.get(hashes[n - 1]) is not None:
                    self.put(hashes[n - 1], b.state)
            elif not ending:
                keep.append(b)
        seq.boundaries = keep

    # -- the store --------------------------------------------------------
    def deepest(
        self, cached: list[int], hashes: list[int]
    ) -> tuple[list[int], list[int], State | None]:
        """The longest prefix of the matched blocks that ends at a snapshot, and that
        snapshot's state (lists of its own; the arrays are shared, never written)."""
        for j in range(len(hashes), 0, -1):
            entry = self._snaps.get(hashes[j - 1])
            if entry is not None:
                self._snaps.move_to_end(hashes[j - 1])
                self.hits += 1
                return cached[:j], hashes[:j], [None if s is None else list(s) for s in entry[0]]
        return [], [], None

    def put(self, key: int, state: State) -> None:
        if self._enter(key, state):
            self.stores += 1

    def install(self, key: int, state: State) -> None:
        """Enter a snapshot read back from a lower tier, most recently used (one already
        here is kept)."""
        if key in self._snaps:
            self._snaps.move_to_end(key)
        else:
            self._enter(key, state)

    def _enter(self, key: int, state: State) -> bool:
        nbytes = state_bytes(state)
        if nbytes > self.max_bytes:
            return False
        self._forget(key, evicted=False)
        while self._snaps and self.bytes + nbytes > self.max_bytes:
            old, (old_state, b) = self._snaps.popitem(last=False)
            self.bytes -= b
            self.evictions += 1
            if self.on_drop is not None:
                self.on_drop(old, old_state)
        self._snaps[key] = (state, nbytes)
        self.bytes += nbytes
        return True

    def _forget(self, key: int, evicted: bool = True) -> None:
        """Drop the snapshot keyed by a block the prefix cache let go."""
        entry = self._snaps.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]
            self.evictions += evicted
            if evicted and self.on_drop is not None:
                self.on_drop(key, entry[0])

    def contains(self, key: int) -> bool:
        return key in self._snaps

    def touch(self, key: int) -> None:
        """Mark a snapshot most recently used (a request will resume from it)."""
        if key in self._snaps:
            self._snaps.move_to_end(key)

    def items(self) -> list[tuple[int, State]]:
        """Every snapshot in memory, least recently used first."""
        return [(k, state) for k, (state, _) in self._snaps.items()]

    def stats(self) -> dict[str, int]:
        return {
            "snapshot_hits": self.hits,
            "snapshot_stores": self.stores,
            "snapshot_evictions": self.evictions,
            "snapshot_count": len(self._snaps),
            "snapshot_bytes": self.bytes,
            "snapshot_max_bytes": self.max_bytes,
        }
