"""Recurrent-state snapshots on the SSD tier (`CacheTiers` decides when they move).

A snapshot (`pippin.engine.state_snapshots`) is every recurrent layer's arrays after a
block boundary, keyed by that block's chained key. On disk it is one file of a second
`SsdStore` in the KV blocks' directory (the same checksums, atomic writes, index, size cap
and LRU), under a fingerprint of its own: the model's KV fingerprint plus the state
layout (each array's layer, shape and dtype), so a file is only read back into the layout
that wrote it. The payload is the arrays' raw bytes back to back, in layer order. Files
carry no token ids: the key already chains every token before it.

The layout is the runner's probe's (a prompt and a decode step on mlx-lm's own caches); a
snapshot whose arrays do not match it is not written (counted).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from pippin.engine.kv_fingerprint import from_raw, raw_dtype, raw_view, state_fingerprint
from pippin.engine.ssd_store import SsdStore
from pippin.engine.state_snapshots import State
from pippin.runner.model_runner import ModelRunner

# (the runner's cache slot, index in the slot's list, shape, dtype) of one state array.
Slot = tuple[int, int, tuple[int, ...], mx.Dtype]


def state_layout(runner: ModelRunner) -> list[Slot] | None:
    """Every recurrent state array of one sequence, in payload order (the runner's probe);
    None when a layer leaves an entry unset (no fixed layout to write)."""
    return runner.state_layout


class SsdSnapshots:
    def __init__(self, store: SsdStore, slots: list[Slot], num_slots: int) -> None:
        self.store = store
        self.slots = slots
        self.num_slots = num_slots  # the length of a `State` (the runner's cache slots)
        self._spilling: list[tuple[int, list[mx.array]]] = []
        self.mismatched = 0  # snapshots not written: arrays unlike the layout

    @classmethod
    def open(
        cls,
        root: str | Path,
        kv_fp: str,
        slots: list[Slot],
        num_slots: int,
        max_bytes: int,
        queue_bytes: int,
        on_read: Callable[[], None] | None = None,
    ) -> SsdSnapshots:
        nbytes = sum(math.prod(shape) * dtype.size for _, _, shape, dtype in slots)
        store = SsdStore(
            root,
            state_fingerprint(kv_fp, slots),
            nbytes,
            max_bytes,
            max(queue_bytes // max(nbytes, 1), 1),
            on_read=on_read,
        )
        return cls(store, slots, num_slots)

    # -- spilling -----------------------------------------------------------
    def spill(self, key: int, state: State) -> None:
        """Copy a snapshot leaving memory out: launched now, handed to the writer at the
        next `hand_over` (the arrays are never written in place, so holding them is enough)."""
        if self.store.known(key) or any(k == key for k, _ in self._spilling):
            return
        parts = self._parts(state)
        if parts is None:
            self.mismatched += 1
            return
        mx.async_eval(parts)
        self._spilling.append((key, parts))

    def _parts(self, state: State) -> list[mx.array] | None:
        parts = []
        for i, j, shape, dtype in self.slots:
            arrays = state[i] if i < len(state) else None
            a = arrays[j] if arrays is not None and j < len(arrays) else None
            if a is None or tuple(a.shape) != shape or a.dtype != dtype:
                return None
            parts.append(raw_view(a))
        n = sum(len(s) for s in state if s is not None)
        return parts if n == len(self.slots) else None

    def hand_over(self, block: bool = False) -> None:
        for key, parts in self._spilling:
            self.store.put(key, (), [np.array(p) for p in parts], block=block)
        self._spilling = []

    def discard(self) -> None:
        """Drop the copies not handed to the writer yet."""
        self._spilling = []

    def flush(self, snapshots: list[tuple[int, State]]) -> None:
        """Write these snapshots (those not on disk yet) and wait for the writer."""
        self.hand_over(block=True)
        for key, state in snapshots:
            self.spill(key, state)
            self.hand_over(block=True)  # one at a time: the queue bounds host memory
        self.store.drain()

    # -- promotion ----------------------------------------------------------
    def request(self, key: int) -> None:
        self.store.request([(key, ())])

    def completed(self) -> list[tuple[int, State | None]]:
        """Finished reads: each key with its state, or None (missing or corrupt)."""
        return [
            (r.key, None if r.payload is None else self._decode(r.payload))
            for r in self.store.completed()
        ]

    def _decode(self, payload: bytes) -> State:
        state: State = [None] * self.num_slots
        off = 0
        for i, _, shape, dtype in self.slots:
            raw = raw_dtype(dtype)
            n = math.prod(shape)
            a = np.frombuffer(payload, raw, n, off).reshape(shape)
            off += n * raw.itemsize
            layer = state[i]
            if layer is None:
                layer = state[i] = []
            layer.append(from_raw(a, dtype))
        return state

    def stats(self) -> dict[str, Any]:
        s = self.store.stats()
        return {
            "count": s["blocks"],
            "bytes": s["bytes"],
            "writes": s["writes"],
            "write_errors": s["write_errors"],
            "write_queue_full": s["write_queue_full"],
            "not_written_other_layout": self.mismatched,
            "reads": s["reads"],
            "read_hits": s["read_hits"],
            "corrupt": s["corrupt"],
            "missing": s["missing"],
            "degraded": s["degraded"],
            "degraded_reason": s["degraded_reason"],
        }
