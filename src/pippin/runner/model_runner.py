"""Runs mlx-lm model classes unchanged over the paged KV pool.

Attention layers get `PagedLayerCache` views; layers that keep other state
(the recurrent layers of Qwen3-Next or Mamba hybrids, mlx-lm's `ArraysCache`)
keep it per sequence and have it stacked into a batch for each call.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from pippin import heap
from pippin.kernels import (
    cpu_prefill,
    fused_layer,
    head_rows,
    paged_attention,
    patches,
)
from pippin.kernels.config import KernelConfig
from pippin.runner import decode_graph, recurrent_state
from pippin.runner.batch import RunItem, equal_length_groups, length_groups
from pippin.runner.lora import Loaded, LoraSet
from pippin.runner.paged_cache import (
    BatchLayout,
    LayerPool,
    LayerSpec,
    PagedLayerCache,
    QuantizedPagedLayerCache,
    bytes_per_block,
)
from pippin.runner.recurrent_state import StateRow
from pippin.store.lora import Adapter


def machine_memory() -> int:
    """The device's memory in bytes (the host's where MLX does not say)."""
    try:
        info = mx.device_info()
        size = info.get("memory_size") or info.get("total_memory")
        if size:
            return int(size)
    except Exception:  # older mlx or a backend without the query
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _same_rows(lazy: list[tuple[int, mx.array, int]], rows: int) -> bool:
    """Whether each of the `rows` rows reads its own row of one array of `rows` tokens."""
    if not lazy or len(lazy) != rows:
        return False
    arr = lazy[0][1]
    if arr.ndim != 1 or arr.shape[0] != rows or arr.dtype != mx.int32:
        return False
    return all(b == i and r == i and a is arr for i, (b, a, r) in enumerate(lazy))


def _verify_positions(items: list[RunItem], rows: list[int]) -> tuple[list[int], list[int]]:
    """(rows, cols) of the positions whose logits the sampling rows return, in order: the
    last one of a plain row, the last 1 + len(draft) of a row with proposals."""
    out_rows: list[int] = []
    cols: list[int] = []
    for b in rows:
        it = items[b]
        n = 1 + len(it.draft)
        out_rows += [b] * n
        cols += range(it.length - n, it.length)
    return out_rows, cols


class UnsupportedModelError(Exception):
    pass


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        kernels: KernelConfig | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.num_caches = 0  # entries of the model's cache list, one per layer
        # Slots: one per cache entry, then one per part of each entry that is a
        # `CacheList` (Falcon-H1's layers run attention and a Mamba mixer side by side):
        # (entry, part or None). Pools, specs, state sizes and `Sequence.recurrent` are
        # indexed by slot.
        self.slots: list[tuple[int, int | None]] = []
        self.parts: dict[int, list[int]] = {}  # a CacheList entry: its parts' slots
        self.specs: dict[int, LayerSpec] = {}  # attention layers
        self.state_sizes: dict[int, int] = {}  # recurrent layers
        self.state_bytes = 0  # one sequence's recurrent state
        # Its arrays: (slot, index in the slot's list, shape, dtype) each, in slot order;
        # None when a layer leaves one unset (no fixed layout).
        self.state_layout: list[tuple[int, int, tuple[int, ...], mx.Dtype]] | None = []
        self.kernels = kernels if kernels is not None else KernelConfig.from_env()
        self._probe()
        self.pools: dict[int, LayerPool] = {}
        self.graph: decode_graph.DecodeGraph | None = None
        self.traces = decode_graph.Traces()
        self._view = QuantizedPagedLayerCache if kv_bits else PagedLayerCache
        if kv_bits:
            self._probe_quantized()
        # Every change to mlx-lm's model code is made (and documented) there.
        patched = patches.apply(model, self.kernels, self.specs, self.state_sizes, kv_bits)
        # Decode batches may read KV through the paged kernel; those that do take the
        # fused attention block, and small ones each layer in five kernels around it.
        self.paged_kernel = patched.paged_kernel
        self.fused_attention = patched.fused_attention
        self.fused_layer = patched.fused_layer
        # The most rows a decode batch takes the fused layers for.
        self.fused_rows = fused_layer.max_rows(model) if patched.fused_layer else 0
        self.head = patched.head
        # Models that take more than tokens per call (a vision model's image embeddings
        # and positions) say what through `step_inputs(items, tokens)`.
        self.step_inputs = getattr(model, "step_inputs", None)
        # With `keep_hidden`, each call leaves its final norm's output at every position
        # of every row in `hidden` ([B, L, hidden], lazy): a multi-token-prediction head
        # reads the target's (`pippin.engine.mtp`).
        self.keep_hidden = False
        self.hidden: mx.array | None = None
        # The scored positions' logits of the last call (`forward`'s `score`), lazy.
        self.scored: mx.array | None = None
        # LoRA adapters applied per row (`pippin.runner.lora`), once the first is added.
        self.lora: LoraSet | None = None

    def add_lora(self, name: str, adapter: Adapter) -> Loaded:
        """Serve `adapter` as `name` (its slot; `LoraError` if the model cannot take it)."""
        if self.lora is None:
            floats = [v for _, v in tree_flatten(self.model.parameters())]
            dtype = next((v.dtype for v in floats if mx.issubdtype(v.dtype, mx.floating)), None)
            self.lora = LoraSet(self.model, dtype or mx.float32)
            # The fused CUDA attention block and layers read the projections' weights
            # themselves, past the LoRA layers: adapters need mlx-lm's own calls.
            self.fused_attention = self.fused_layer = False
        loaded = self.lora.add(name, adapter)
        self._retrace()
        return loaded

    def remove_lora(self, name: str) -> None:
        assert self.lora is not None
        self.lora.remove(name)
        self._retrace()

    def _retrace(self) -> None:
        # Compiled traces hold the layers' stacks as constants: new stacks, new traces.
        if self.graph is not None:
            self.graph.close()
            self.graph = decode_graph.DecodeGraph(self)

    def lora_slots(self, items: list[RunItem]) -> list[int] | None:
        """Each row's adapter slot (0: none); None when no row has one."""
        if self.lora is None:
            return None
        slots = [it.seq.lora for it in items]
        return slots if any(slots) else None

    def mark_fused(self, layout: Any, rows: int) -> None:
        """Which fused kernels a batch of `rows` rows runs, once `layout.paged_kernel` says
        whether it is a decode batch that takes the paged kernel."""
        layout.fused_attention = layout.paged_kernel and self.fused_attention
        small = rows <= self.fused_rows
        layout.fused_layer = layout.fused_attention and self.fused_layer and small

    def share_inputs(self, inputs: mx.array) -> mx.array:
        """A call's token ids as every rank sees them (tensor parallel: rank 0's, through
        a collective, so they stay lazy); one device: as they are."""
        return inputs

    @property
    def has_state_layers(self) -> bool:
        return bool(self.state_sizes)

    @property
    def pads_state(self) -> bool:
        """Whether a call's shorter rows would take their padding into their recurrent
        state (families whose mixers ignore `ArraysCache.lengths`)."""
        return self.has_state_layers and not self.masks_padding

    def call_groups(self, items: list[Any], similar: bool = True) -> list[list[Any]]:
        """Rows in calls: of similar length (`length_groups`; all in one if not
        `similar`), or of equal length where padding would run through the state."""
        if self.pads_state:
            return equal_length_groups(items)
        return length_groups(items) if similar else [items]

    @property
    def kv_specs(self) -> list[LayerSpec]:
        return list(self.specs.values())

    def _probe(self) -> None:
        """Run two tokens through the model's own caches to learn each layer's KV shape."""
        caches = make_prompt_cache(self.model)
        self.model(mx.array([[1, 2]]), cache=caches)
        self.model(mx.array([[3]]), cache=caches)  # and a decode step: the state it keeps
        self.num_caches = len(caches)
        self.slots = [(i, None) for i in range(len(caches))]
        for i, c in enumerate(caches):
            if type(c) is CacheList:
                self.parts[i] = list(range(len(self.slots), len(self.slots) + len(c.caches)))
                self.slots += [(i, k) for k in range(len(c.caches))]
        for i, (entry, part) in enumerate(self.slots):
            if i in self.parts:
                continue
            c = caches[entry] if part is None else caches[entry][part]
            if type(c) in (KVCache, RotatingKVCache):  # not subclasses: they mean other layouts
                mx.eval(c.keys, c.values)
                _, h, _, dk = c.keys.shape
                dv = c.values.shape[-1]
                if self.kv_bits and (dk % self.kv_group_size or dv % self.kv_group_size):
                    raise UnsupportedModelError(
                        f"quantised KV needs head dims divisible by the group size "
                        f"{self.kv_group_size}; layer {i} has {dk} and {dv}"
                    )
                self.specs[i] = LayerSpec(h, dk, dv, c.keys.dtype, self.kv_bits, self.kv_group_size)
            elif isinstance(c, ArraysCache):
                self.state_sizes[i] = len(c.cache)
                self.state_bytes += sum(a.nbytes for a in c.cache if a is not None)
                if any(a is None for a in c.cache):
                    self.state_layout = None
                elif self.state_layout is not None:
                    self.state_layout += [
                        (i, j, tuple(a.shape), a.dtype) for j, a in enumerate(c.cache)
                    ]
            else:
                raise UnsupportedModelError(
                    f"layer {i} uses a {type(c).__name__}, which the paged engine does not run yet"
                )
        if not self.specs and not self.state_sizes:
            raise UnsupportedModelError("the model has no cache layers")
        self.masks_padding = bool(self.state_sizes) and self._state_masks_padding()

    def _state_masks_padding(self) -> bool:
        """Whether the recurrent layers keep a row's padding out of its state when told
        the rows' lengths (mlx-lm's `ArraysCache.lengths`; not every family's mixer
        reads them): then prompts of different lengths share a call."""
        alone = make_prompt_cache(self.model)
        self.model(mx.array([[5, 6, 7]]), cache=alone)
        batched = make_prompt_cache(self.model)
        for i in self.state_sizes:
            self._slot(batched, i).prepare(lengths=[3, 5])
        self.model(mx.array([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]]), cache=batched)
        for i in self.state_sizes:
            for a, b in zip(self._slot(alone, i).cache, self._slot(batched, i).cache):
                if a is None or b is None:
                    continue
                a, b = a.astype(mx.float32), b[:1].astype(mx.float32)
                scale = mx.abs(a).max().item() + 1e-6
                if mx.abs(a - b).max().item() > 0.05 * scale:
                    return False
        return True

    def _slot(self, caches: list[Any], i: int) -> Any:
        """Slot `i`'s cache in a list of the model's caches."""
        entry, part = self.slots[i]
        return caches[entry] if part is None else caches[entry][part]

    def _caches(self, make: Any) -> list[Any]:
        """The model's cache list, each slot's cache made by `make(slot)`."""
        made = {i: make(i) for i in range(len(self.slots)) if i not in self.parts}
        return [
            CacheList(*(made[j] for j in self.parts[i])) if i in self.parts else made[i]
            for i in range(self.num_caches)
        ]

    def _probe_quantized(self) -> None:
        """Models whose attention does not go through mlx-lm's shared
        `scaled_dot_product_attention` cannot read quantised KV: refuse them up front."""
        pools = {i: LayerPool(s, 2, self.block_size) for i, s in self.specs.items()}
        layout = BatchLayout([0], [2], [[1, 1]], self.block_size)

        def make(i: int) -> Any:
            return self._view(pools[i], layout) if i in pools else ArraysCache(self.state_sizes[i])

        caches = self._caches(make)
        try:
            mx.eval(self.model(mx.array([[1, 2]]), cache=caches))
        except Exception as e:
            raise UnsupportedModelError(
                f"this model's attention cannot read quantised KV ({type(e).__name__}: {e}); "
                "run it without --kv-bits"
            ) from None

    @property
    def weight_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))

    @property
    def pool_bytes(self) -> int:
        """The KV pools' size (0 before `allocate`)."""
        return sum(p.nbytes for p in self.pools.values())

    @staticmethod
    def cache_budget(budget_bytes: int | None, memory_share: float) -> int:
        """The KV cache's bytes: as configured, else that share of the device's memory."""
        return budget_bytes or int(machine_memory() * memory_share)

    def num_kv_blocks(
        self,
        *,
        max_num_seqs: int,
        max_model_len: int,
        budget_bytes: int | None,
        memory_share: float,
        draft_block_bytes: int = 0,
        draft_blocks: int = 0,
    ) -> int:
        """How many KV blocks to `allocate`: as many as `budget_bytes` hold (None: that
        share of the device's memory), no more than `max_num_seqs` sequences at full
        context need, and never fewer than one such sequence needs.

        A draft model's pool shares the budget: it gets a block of `draft_block_bytes`
        beside each of these, up to the `draft_blocks` it needs; past that, the rest of
        the budget is this pool's alone."""
        bs = self.block_size
        per_block = bytes_per_block(self.kv_specs, bs)
        # Enough for every sequence at full context; more only feeds the prefix cache.
        ceiling = max_num_seqs * (max_model_len // bs + 1) + 1
        if per_block == 0:  # no attention layers: blocks only count tokens
            return ceiling
        budget = self.cache_budget(budget_bytes, memory_share)
        if not draft_block_bytes:
            n = budget // per_block
        else:
            n = budget // (per_block + draft_block_bytes)
            if n > draft_blocks:
                n = (budget - draft_blocks * draft_block_bytes) // per_block
        min_blocks = max_model_len // bs + 2
        return max(min(n, ceiling), min_blocks)

    def allocate(self, num_blocks: int) -> None:
        self.pools = {i: LayerPool(s, num_blocks, self.block_size) for i, s in self.specs.items()}
        mx.eval([p.parts for p in self.pools.values()])
        # Recurrent state is stacked per call from each sequence's own arrays: not a
        # fixed graph, so those models run op by op.
        plain = not self.has_state_layers and self.step_inputs is None
        if decode_graph.enabled(self.kernels.compile) and plain:
            self.graph = decode_graph.DecodeGraph(self)

    def reset_pools(self, num_blocks: int) -> None:
        """Zeroed pools (and a new compiled step) in place of ones a failed step may have
        left half written or still tied to its unfinished graph. The old ones are let go
        first, so both are never held at once."""
        self.pools = {}
        if self.graph is not None:
            self.graph.close()
        self.graph = None
        heap.collect()
        mx.clear_cache()
        self.allocate(num_blocks)

    def block_slots(self, block_ids: list[int]) -> mx.array:
        bs = self.block_size
        return mx.array(
            (np.asarray(block_ids, dtype=np.int32)[:, None] * bs + np.arange(bs)).reshape(-1)
        )

    def read_blocks(self, block_ids: list[int]) -> list[mx.array]:
        """Every pool part of these blocks, layer by layer, each [H, n * block_size, width]."""
        slots = self.block_slots(block_ids)
        return [a for i in sorted(self.pools) for a in self.pools[i].read(slots)]

    def write_blocks(self, block_ids: list[int], parts: list[mx.array]) -> None:
        """The inverse of `read_blocks`."""
        slots = self.block_slots(block_ids)
        k = 0
        for i in sorted(self.pools):
            n = len(self.pools[i].parts)
            self.pools[i].write(slots, parts[k : k + n])
            k += n

    def forward(self, items: list[RunItem], score: dict[int, int] | None = None) -> mx.array | None:
        """Compute `items` (one row each) and return the logits of the rows that sample,
        in order, as [n, vocab]; None if no row samples.

        `score` (prompt logprobs): row -> how many of its first positions also keep
        their logits, left in `scored` ([positions, vocab], by row then position)."""
        self.scored = None
        starts = [it.start for it in items]
        lengths = [it.length for it in items]
        tables = [it.seq.table.block_ids for it in items]
        L = max(lengths)
        compiled = self.graph is not None and L == 1 and not self.keep_hidden and not score
        B = len(items)
        tokens = np.zeros((self.graph.rows(B) if compiled else B, L), dtype=np.int32)
        lazy: list[tuple[int, mx.array, int]] = []
        for b, it in enumerate(items):
            seq = it.seq
            if seq.pending and it.start == seq.num_known:
                # The input is the token the step in flight is sampling.
                arr, row = seq.pending[-1]
                lazy.append((b, arr, row))
                continue
            known = it.length - len(it.draft)
            tokens[b, :known] = seq.ids(it.start, it.start + known)
            tokens[b, known : it.length] = it.draft
        if _same_rows(lazy, tokens.shape[0]):
            # A steady decode batch: the previous step's sampled tokens are the inputs,
            # row for row, with no upload or scatter.
            inputs = lazy[0][1].reshape(-1, 1)
        else:
            inputs = mx.array(tokens)
            groups: dict[int, tuple[mx.array, list[int], list[int]]] = {}
            for b, arr, r in lazy:
                groups.setdefault(id(arr), (arr, [], []))
                groups[id(arr)][1].append(b)
                groups[id(arr)][2].append(r)
            for arr, dst, src in groups.values():
                inputs[mx.array(dst), 0] = arr[mx.array(src)]
        inputs = self.share_inputs(inputs)
        rows = [b for b, it in enumerate(items) if it.samples]

        lora = self.lora_slots(items)
        if compiled:
            assert self.graph is not None
            logits = self.graph.forward(inputs, starts, tables, lora)
            if not rows:
                return None
            return logits if len(rows) == B else logits[mx.array(rows)]

        layout = BatchLayout(starts, lengths, tables, self.block_size)
        if self.paged_kernel:
            k = self.kernels
            paged_attention.use_kernel(layout, k.paged_kernel == "1", k.paged_split)
            self.mark_fused(layout, B)
        made: dict[int, Any] = {}

        def make(i: int) -> Any:
            if i in self.pools:
                return self._view(self.pools[i], layout)
            made[i] = self._stack_state(i, items)
            return made[i]

        caches = self._caches(make)
        if any(items[b].draft for b in rows):
            # Verifying proposals: every position from the last known token on.
            rows, cols = _verify_positions(items, rows)
        else:
            cols = [lengths[b] - 1 for b in rows]
        # The scored positions follow the sampling ones through the LM head.
        score_rows = [b for b, n in (score or {}).items() for _ in range(n)]
        score_cols = [c for n in (score or {}).values() for c in range(n)]
        sel_rows, sel_cols = rows + score_rows, cols + score_cols
        selected = self.head is not None and bool(sel_rows) and L > 1
        extra = self.step_inputs(items, inputs) if self.step_inputs is not None else {}
        with cpu_prefill.in_runner(), self._lora_rows(lora, B):
            if self.keep_hidden:
                # The LM head sees the positions it would see through `self.head`.
                sel = (sel_rows, sel_cols) if selected else ([], [])
                with head_rows.capture(self.model, *sel, (B, L)) as captured:
                    logits = self.model(inputs, cache=caches, **extra)
                self.hidden = captured.hidden
            elif selected:
                # Only the sampling (and scored) positions go through the LM head.
                assert self.head is not None
                with self.head.select(sel_rows, sel_cols, (B, L)):
                    logits = self.model(inputs, cache=caches, **extra)
            else:
                logits = self.model(inputs, cache=caches, **extra)

        if self.state_sizes:
            for i in self.state_sizes:
                for it, row in zip(items, recurrent_state.unstack(made[i], len(items))):
                    if it.seq.recurrent is None:
                        it.seq.recurrent = [None] * len(self.slots)
                    it.seq.recurrent[i] = row

        if selected and logits.shape[:2] == (len(sel_rows), 1):  # the head ran on those
            if score_rows:
                self.scored = logits[len(rows) :, 0]
            return logits[: len(rows), 0] if rows else None
        if score_rows:
            self.scored = logits[mx.array(score_rows), mx.array(score_cols)]
        if not rows:
            return None
        if L == 1:
            return logits[mx.array(rows), 0] if len(rows) < len(items) else logits[:, 0]
        return logits[mx.array(rows), mx.array(cols)]

    def _lora_rows(self, slots: list[int] | None, rows: int) -> Any:
        if slots is None or self.lora is None:
            return contextlib.nullcontext()
        return self.lora.use(slots, rows)

    def _stack_state(self, layer: int, items: list[RunItem]) -> ArraysCache:
        entries = [None if it.seq.recurrent is None else it.seq.recurrent[layer] for it in items]
        return recurrent_state.stack(entries, self.state_sizes[layer], [it.length for it in items])

    def arrays_to_eval(self, items: list[RunItem]) -> list[Any]:
        """Everything a step wrote, so one eval materialises it."""
        out: list[Any] = [p.parts for p in self.pools.values()]
        if self.state_sizes:
            # Every row of a call shares its arrays: each once.
            seen: dict[int, mx.array] = {}
            for it in items:
                for entry in it.seq.recurrent or ():
                    arrays = entry.arrays if isinstance(entry, StateRow) else entry or ()
                    seen.update((id(a), a) for a in arrays if a is not None)
            out.extend(seen.values())
        return out
