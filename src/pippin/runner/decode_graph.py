"""The decode step as one compiled MLX graph.

A decode batch (one new token per row) runs the same model graph every step;
only its values change. Built op by op in Python, that graph costs a few
milliseconds of host time per step, more than a small model's whole step on a
GPU. `mx.compile` traces it once per padded shape and then replays it (fusing
elementwise ops on the way), so a step's host time no longer grows with the
model's depth.

Every per-step value is an input array: the tokens, the block tables, the
offsets, the write slots and the KV pools themselves, which come back out as
the updated pools (the caller drops its references first, so the scatters stay
in place). Batch size and table width are padded to buckets so that a few
traces serve every step: padded rows read and write only the null block 0.

On by default on CUDA (see `enabled`); `PIPPIN_COMPILE=0` turns it off, every step then
running the model op by op.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
import numpy as np

from pippin.kernels import paged_attention
from pippin.kernels.config import KernelConfig
from pippin.kernels.device import on_cuda
from pippin.runner.paged_cache import DecodeLayout, LayerPool, table_arrays


@dataclass
class Traces:
    """Decode graphs' traces of new shapes, over a runner's life: how many, and the
    seconds those steps took to trace, compile and run (what a step of a new batch size
    waits for mid-serving)."""

    count: int = 0
    seconds: float = 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds

    def stats(self) -> dict[str, float]:
        return {"decode_traces": self.count, "decode_trace_seconds": self.seconds}


class Runner(Protocol):
    """What a decode graph reads of `ModelRunner` (which builds one for itself)."""

    model: Any
    pools: dict[int, LayerPool]
    block_size: int
    num_caches: int
    paged_kernel: bool
    kernels: KernelConfig

    lora: Any  # pippin.runner.lora.LoraSet | None
    traces: Traces

    def mark_fused(self, layout: Any, rows: int) -> None: ...

    def _view(self, pool: LayerPool, layout: Any) -> Any: ...


def enabled(flag: str = "auto") -> bool:
    """On by default on CUDA only (`flag`: `KernelConfig.compile`). On the CPU backend a
    step launched while the previous one still runs sometimes finds a pool still
    referenced there, and its scatter then copies that pool whole instead of updating it
    in place (seen with a tiny model, one copy of one layer's keys or values in about half
    the steps): a loss that grows with the pool. On Metal it is not measured yet.
    `PIPPIN_COMPILE=1` turns it on anywhere."""
    if flag != "auto":
        return flag != "0"
    return on_cuda()


def bucket(n: int) -> int:
    """`n` rounded up to one of a few sizes per power of two (at most 25% more)."""
    if n <= 4:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class DecodeGraph:
    """Runs decode batches of `runner`'s model through compiled traces."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.order = sorted(runner.pools)
        self.counts = [len(runner.pools[i].parts) for i in self.order]  # arrays per layer
        self.kernel = runner.paged_kernel
        self._fn = mx.compile(self._step)
        # Calls with LoRA rows: their slots are one more input ([Bp] uint32). A trace of
        # its own, so that calls without adapters skip the LoRA term altogether.
        self._fn_lora = mx.compile(self._lora_step)
        # The (rows, table width, LoRA) shapes traced so far: a call of a new one traces
        # the model in Python and compiles the graph on the host, mid-serving. The runner
        # counts them, and the time those steps took, over all its graphs (/metrics).
        self._shapes: set[tuple[int, int, bool]] = set()

    def close(self) -> None:
        """Let go of the compiled traces: the functions refer back to this graph, a cycle
        that only a collection would free, and none reaches a frozen heap (`pippin.heap`)."""
        self._fn = self._fn_lora = None  # type: ignore[assignment]

    def _lora_step(self, lora: mx.array, *args: Any) -> tuple[mx.array, ...]:
        with self.runner.lora.traced(lora):
            return self._step(*args)

    def _step(
        self, tokens: mx.array, tables: mx.array, offsets: mx.array, slots: mx.array, *parts: Any
    ) -> tuple[mx.array, ...]:
        r = self.runner
        B = tokens.shape[0]
        always, split = r.kernels.paged_kernel == "1", r.kernels.paged_split
        width = tables.shape[1] * r.block_size
        kernel = self.kernel and paged_attention.worth_it(B, width, always, split)
        split = paged_attention.split_wanted(B, width, split)
        layout = DecodeLayout(tables, offsets, slots, r.block_size, kernel, split)
        r.mark_fused(layout, B)
        pools = {i: r.pools[i].with_parts(p) for i, p in self._by_layer(parts).items()}
        caches = [r._view(pools[i], layout) for i in range(r.num_caches)]
        logits = r.model(tokens, cache=caches)
        return (logits[:, 0], *(p for i in self.order for p in pools[i].parts))

    def forward(
        self,
        tokens: mx.array,
        starts: list[int],
        tables: list[list[int]],
        lora: list[int] | None = None,
    ) -> mx.array:
        """Logits [B, vocab] of one decode step; `tokens` is [Bp, 1] already padded to
        `self.rows(B)` rows; `lora`: each row's adapter slot, if any row has one."""
        r = self.runner
        bs = r.block_size
        B = len(starts)
        Bp = tokens.shape[0]
        need = max(s // bs + 1 for s in starts)
        nb = pow2(need) if self.kernel else bucket(need)
        tab, slots = table_arrays(starts, [1] * B, tables, bs, Bp, nb)
        offsets = np.zeros(Bp, dtype=np.int32)
        offsets[:B] = starts
        parts = [p for i in self.order for p in r.pools[i].parts]
        for i in self.order:
            r.pools[i].parts = []  # the compiled scatters may then update the pools in place
        args = (tokens, mx.array(tab), mx.array(offsets), mx.array(slots.reshape(-1)), *parts)
        shape = (Bp, nb, lora is not None)
        new = shape not in self._shapes
        t0 = time.perf_counter()
        if lora is not None:
            rows = np.zeros(Bp, dtype=np.uint32)
            rows[:B] = lora
            out = self._fn_lora(mx.array(rows), *args)
        else:
            out = self._fn(*args)
        if new:
            # The call traced; run the step now, so that the time counted holds what the
            # first run of a new graph adds too (on CUDA, kernels compiled for it).
            mx.eval(out)
            self._shapes.add(shape)
            r.traces.add(time.perf_counter() - t0)
        del parts
        for i, p in self._by_layer(out[1:]).items():
            r.pools[i].parts = p
        logits = out[0]
        return logits if Bp == B else logits[:B]

    def warm(self, max_rows: int, max_tokens: int) -> int:
        """Trace now every shape a step of up to `max_rows` rows over contexts of up to
        `max_tokens` tokens takes (the rows' buckets by the tables' widths), each run once
        on the null block (its logits dropped); how many shapes."""
        bs = self.runner.block_size
        widen = pow2 if self.kernel else bucket
        rows = sorted({bucket(b) for b in range(1, max_rows + 1)})
        widths = sorted({widen(n) for n in range(1, -(-max_tokens // bs) + 1)})
        for n in rows:
            for width in widths:
                # Each row at the last block of a table `width` blocks wide, all of it block 0.
                starts = [(width - 1) * bs] * n
                self.forward(mx.zeros((n, 1), dtype=mx.int32), starts, [[0] * width] * n)
        return len(rows) * len(widths)

    def _by_layer(self, flat: Any) -> dict[int, list[mx.array]]:
        """The pools' arrays, as one flat sequence in `order`, back to a list per layer."""
        out, k = {}, 0
        for i, n in zip(self.order, self.counts):
            out[i] = list(flat[k : k + n])
            k += n
        return out

    @staticmethod
    def rows(B: int) -> int:
        return bucket(B)
