"""Recurrent layers' state per sequence, stacked into each call's batch.

A sequence's state for one recurrent layer (mlx-lm `ArraysCache` entries: convolution
and SSM / delta-rule state) is either arrays of its own (batch 1: a snapshot's, or none
yet) or a row of the batched arrays the last call that ran it left (`StateRow`). Rows
are not sliced out after a call: a batch of decodes that runs again in the same order
takes the previous call's arrays as they are, and rows of one earlier call are gathered
with one `take` per array. Slicing every row out and stacking them again would cost two
small ops per sequence, array and layer on every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache


@dataclass(frozen=True, eq=False)
class StateRow:
    """Row `row` of one call's batched state arrays (never written after the call)."""

    arrays: tuple[mx.array | None, ...]
    row: int

    def own(self) -> list[mx.array | None]:
        return [None if a is None else a[self.row : self.row + 1] for a in self.arrays]


def as_arrays(entry: Any) -> list[mx.array | None] | None:
    """One layer's state of one sequence as batch-1 arrays (None: no state yet)."""
    if entry is None:
        return None
    return entry.own() if isinstance(entry, StateRow) else list(entry)


def stack(entries: list[Any], size: int, lengths: list[int]) -> ArraysCache:
    """One layer's cache for a call over rows with these states (`StateRow`, batch-1
    arrays or None) and token counts (right-padded to the longest)."""
    cache = ArraysCache(size)
    B = len(entries)
    first = entries[0]
    if (
        isinstance(first, StateRow)
        and all(
            isinstance(e, StateRow) and e.arrays is first.arrays and e.row == b
            for b, e in enumerate(entries)
        )
        and all(a is None or a.shape[0] == B for a in first.arrays)
    ):
        cache.cache = list(first.arrays)  # the same batch as the last call
    elif any(e is not None for e in entries):
        cache.cache = [_stack_entry(entries, k) for k in range(size)]
    if min(lengths) != max(lengths):
        # Each row's state stops at its own length.
        cache.prepare(lengths=lengths)
    return cache


def _stack_entry(entries: list[Any], k: int) -> mx.array | None:
    """Array `k` of every row, stacked: consecutive rows of one earlier call in one
    gather, missing states as zeros."""
    like = next(
        (a for e in entries if e is not None for a in [_array(e, k)] if a is not None), None
    )
    if like is None:
        return None
    pieces: list[mx.array] = []
    run: tuple[mx.array, list[int]] | None = None
    for e in entries:
        if isinstance(e, StateRow) and e.arrays[k] is not None:
            src = e.arrays[k]
            if run is not None and run[0] is src:
                run[1].append(e.row)
                continue
            if run is not None:
                pieces.append(_rows(*run))
            run = (src, [e.row])
            continue
        if run is not None:
            pieces.append(_rows(*run))
            run = None
        a = None if e is None else _array(e, k)
        pieces.append(mx.zeros((1, *like.shape[1:]), like.dtype) if a is None else a)
    if run is not None:
        pieces.append(_rows(*run))
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces)


def _array(entry: Any, k: int) -> mx.array | None:
    if isinstance(entry, StateRow):
        a = entry.arrays[k]
        return None if a is None else a[entry.row : entry.row + 1]
    return entry[k]


def _rows(src: mx.array, rows: list[int]) -> mx.array:
    if rows == list(range(src.shape[0])):
        return src
    if rows == list(range(rows[0], rows[0] + len(rows))):
        return src[rows[0] : rows[0] + len(rows)]
    return mx.take(src, mx.array(rows), axis=0)


def unstack(cache: ArraysCache, rows: int) -> list[StateRow]:
    """Each row's state after the call."""
    arrays = tuple(cache.cache)
    return [StateRow(arrays, b) for b in range(rows)]
