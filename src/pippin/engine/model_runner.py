"""Runs mlx-lm model classes unchanged over the paged KV pool.

Attention layers get `PagedLayerCache` views; layers that keep other state
(the recurrent layers of Qwen3-Next or Mamba hybrids, mlx-lm's `ArraysCache`)
keep it per sequence and have it stacked into a batch for each call.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from pippin.engine import paged_attention
from pippin.engine.paged_cache import BatchLayout, LayerPool, LayerSpec, PagedLayerCache
from pippin.engine.scheduler import ScheduledSeq


class UnsupportedModelError(Exception):
    pass


class ModelRunner:
    def __init__(self, model: nn.Module, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.num_caches = 0  # entries of the model's cache list, one per layer
        self.specs: dict[int, LayerSpec] = {}  # attention layers
        self.state_sizes: dict[int, int] = {}  # recurrent layers
        self._probe()
        self.pools: dict[int, LayerPool] = {}
        self.paged_kernel = paged_attention.enabled_for(model, self.specs, self.state_sizes)

    @property
    def has_state_layers(self) -> bool:
        return bool(self.state_sizes)

    @property
    def kv_specs(self) -> list[LayerSpec]:
        return list(self.specs.values())

    def _probe(self) -> None:
        """Run two tokens through the model's own caches to learn each layer's KV shape."""
        caches = make_prompt_cache(self.model)
        self.model(mx.array([[1, 2]]), cache=caches)
        self.num_caches = len(caches)
        for i, c in enumerate(caches):
            if type(c) in (KVCache, RotatingKVCache):  # not subclasses: they mean other layouts
                mx.eval(c.keys, c.values)
                _, h, _, dk = c.keys.shape
                self.specs[i] = LayerSpec(h, dk, c.values.shape[-1], c.keys.dtype)
            elif isinstance(c, ArraysCache):
                self.state_sizes[i] = len(c.cache)
            else:
                raise UnsupportedModelError(
                    f"layer {i} uses a {type(c).__name__}, which the paged engine does not run yet"
                )
        if not self.specs and not self.state_sizes:
            raise UnsupportedModelError("the model has no cache layers")

    def allocate(self, num_blocks: int) -> None:
        self.pools = {i: LayerPool(s, num_blocks, self.block_size) for i, s in self.specs.items()}
        mx.eval([(p.k, p.v) for p in self.pools.values()])

    def forward(self, items: list[ScheduledSeq]) -> mx.array | None:
        """Compute `items` (one row each) and return the logits of the rows that sample,
        in order, as [n, vocab]; None if no row samples."""
        starts = [it.start for it in items]
        lengths = [it.length for it in items]
        tables = [it.seq.table.block_ids for it in items]
        layout = BatchLayout(starts, lengths, tables, self.block_size)
        L = layout.pad_len
        if self.paged_kernel:
            paged_attention.use_kernel(layout)
        tokens = np.zeros((len(items), L), dtype=np.int32)
        lazy: list[tuple[int, mx.array, int]] = []
        for b, it in enumerate(items):
            seq = it.seq
            if seq.pending and it.start == seq.num_known:
                # The input is the token the step in flight is sampling.
                arr, row = seq.pending[-1]
                lazy.append((b, arr, row))
                continue
            tokens[b, : it.length] = seq.ids(it.start, it.start + it.length)
        inputs = mx.array(tokens)
        groups: dict[int, tuple[mx.array, list[int], list[int]]] = {}
        for b, arr, r in lazy:
            groups.setdefault(id(arr), (arr, [], []))
            groups[id(arr)][1].append(b)
            groups[id(arr)][2].append(r)
        for arr, dst, src in groups.values():
            inputs[mx.array(dst), 0] = arr[mx.array(src)]

        caches: list[Any] = [
            PagedLayerCache(self.pools[i], layout)
            if i in self.pools
            else self._stack_state(i, items)
            for i in range(self.num_caches)
        ]
        logits = self.model(inputs, cache=caches)

        if self.state_sizes:
            for i in self.state_sizes:
                stacked: ArraysCache = caches[i]
                for b, it in enumerate(items):
                    if it.seq.state is None:
                        it.seq.state = [None] * self.num_caches
                    it.seq.state[i] = [c[b : b + 1] for c in stacked.cache]

        rows = [b for b, it in enumerate(items) if it.samples]
        if not rows:
            return None
        if L == 1:
            return logits[mx.array(rows), 0] if len(rows) < len(items) else logits[:, 0]
        cols = [lengths[b] - 1 for b in rows]
        return logits[mx.array(rows), mx.array(cols)]

    def _stack_state(self, layer: int, items: list[ScheduledSeq]) -> ArraysCache:
        size = self.state_sizes[layer]
        per_seq = []
        for it in items:
            c = ArraysCache(size)
            if it.seq.state is not None and it.seq.state[layer] is not None:
                c.cache = list(it.seq.state[layer])
            per_seq.append(c)
        if len(per_seq) == 1:
            return per_seq[0]
        return ArraysCache.merge(per_seq)

    def arrays_to_eval(self, items: list[ScheduledSeq]) -> list[Any]:
        """Everything a step wrote, so one eval materialises it."""
        out: list[Any] = [(p.k, p.v) for p in self.pools.values()]
        if self.state_sizes:
            out.extend(it.seq.state for it in items if it.seq.state is not None)
        return out
