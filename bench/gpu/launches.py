"""Kernel launches timed as a model runs them, for the GPU probes (`kernel_time.py`,
`quant_matmul.py`).

Two things a lone kernel timed again and again gets wrong: its weights stay in the L2 (the
8B shape's q/k/v, o and down weights, 8-29 MB, fit the H100's 50 MB), so `copies` of them,
more than the L2 holds in all, are taken in turn; and independent launches overlap on the
device, hiding each kernel's start and end, so with `chain` each launch waits for the one
before (`after`, no work on the device), as a step's kernels do. On 2026-12-06 a tiling
sweep without either picked tilings that ran a 4-bit 8B decode 30% slower.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import mlx.core as mx

CYCLE_BYTES = 200e6  # more than the H200's 50 MB L2

Launch = Callable[[mx.array | None], mx.array]  # one launch, after the array given if any


def after(a: mx.array, dep: mx.array | None) -> mx.array:
    return a if dep is None else mx.depends(a, dep)


def copies(nbytes: int) -> int:
    """How many copies of `nbytes` of weights make their launches read from memory."""
    return max(1, math.ceil(CYCLE_BYTES / nbytes))


def timed(fns: list[Launch], reps: int, chain: bool = True) -> float:
    """µs per call, the calls cycling through `fns` (each a copy of the same work); with
    `chain`, each call after the previous one's output."""
    mx.eval([f(None) for f in fns])  # builds, compiles, first touches
    mx.synchronize()
    outs: list[mx.array] = []
    for i in range(reps):  # the graph, built before the clock
        outs.append(fns[i % len(fns)](outs[-1] if chain and outs else None))
    t = time.perf_counter()
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t) / reps * 1e6
