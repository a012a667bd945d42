"""The paged KV pool and the cache objects mlx-lm's model classes call.

Each attention layer owns a pool of `num_blocks * block_size` slots. For one
model call the runner builds a `BatchLayout` (where each new token's KV goes,
which blocks each sequence reads, the mask) and hands every layer a
`PagedLayerCache` view over its pool. The views speak the interface mlx-lm
models use (`offset`, `update_and_fetch`, `make_mask`), so the models run
unchanged: new keys and values are scattered into their slots, then each
sequence's KV is gathered from its block table into a dense tensor for
attention.

With quantised KV (`LayerSpec.bits`), the pool holds mx.quantize's three parts
(packed values, scales, biases) for keys and for values; the view then carries
`bits` and `group_size`, which makes mlx-lm's attention take the quantised path
(`quantized_scaled_dot_product_attention`, two quantised matmuls).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from pippin.kernels.paged_attention import Window


@dataclass
class LayerSpec:
    """Shape of one attention layer's KV, read off the model by a probe."""

    n_kv_heads: int
    k_dim: int
    v_dim: int
    dtype: mx.Dtype
    bits: int | None = None  # quantised KV: bits per element
    group_size: int = 64  # elements sharing one scale and bias

    def part_shapes(self) -> list[tuple[int, mx.Dtype]]:
        """Width and dtype of each array a slot holds: K then V, three parts each
        (packed uint32, scales, biases) when quantised."""
        if self.bits is None:
            return [(self.k_dim, self.dtype), (self.v_dim, self.dtype)]
        out: list[tuple[int, mx.Dtype]] = []
        for dim in (self.k_dim, self.v_dim):
            groups = dim // self.group_size
            out += [(dim * self.bits // 32, mx.uint32), (groups, self.dtype), (groups, self.dtype)]
        return out

    def slot_bytes(self) -> int:
        return sum(self.n_kv_heads * w * dt.size for w, dt in self.part_shapes())


class LayerPool:
    def __init__(self, spec: LayerSpec, num_blocks: int, block_size: int) -> None:
        slots = num_blocks * block_size
        self.spec = spec
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Head-major: a gather of blocks then yields [H, B, S, D] whose rows are
        # contiguous, which attention reads several times faster than a slot-major
        # gather's transpose.
        self.parts = [
            mx.zeros((spec.n_kv_heads, slots, w), dtype=dt) for w, dt in spec.part_shapes()
        ]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def with_parts(self, parts: list[mx.array]) -> LayerPool:
        """The same pool over other arrays (a compiled step's traced inputs)."""
        view = copy.copy(self)
        view.parts = parts
        return view

    def read(self, slots: mx.array) -> list[mx.array]:
        """Every part at `slots` ([H, n, width] each), for copying blocks out."""
        return [p[:, slots] for p in self.parts]

    def write(self, slots: mx.array, values: list[mx.array]) -> None:
        for i, v in enumerate(values):
            self.parts[i][:, slots] = v


def bytes_per_block(specs: list[LayerSpec], block_size: int) -> int:
    return sum(block_size * s.slot_bytes() for s in specs)


def table_arrays(
    starts: list[int],
    lengths: list[int],
    block_tables: list[list[int]],
    block_size: int,
    rows: int,
    width: int,
    pad_len: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Block tables [rows, width] (the blocks each row reads, 0 after them) and the slot of
    each new token [rows, max(max(lengths), pad_len)] (0, in the null block, for padding)."""
    bs = block_size
    tables = np.zeros((rows, width), dtype=np.int32)
    for b, (start, n, table) in enumerate(zip(starts, lengths, block_tables)):
        used = (start + n + bs - 1) // bs
        tables[b, :used] = table[:used]
    L = max(max(lengths), pad_len)
    n_rows = len(starts)
    col = np.arange(L)[None, :]
    pos = np.asarray(starts)[:, None] + col
    blocks = np.take_along_axis(tables[:n_rows], np.minimum(pos // bs, width - 1), axis=1)
    slots = np.zeros((rows, L), dtype=np.int32)
    slots[:n_rows] = np.where(col < np.asarray(lengths)[:, None], blocks * bs + pos % bs, 0)
    return tables, slots


# Fresh prompts attend to their own keys directly (tests turn it off to compare).
FRESH_PREFILL = True


@dataclass
class BatchLayout:
    """Where B sequences, each with `lengths[b]` new tokens from `starts[b]`, read and write."""

    starts: list[int]
    lengths: list[int]
    block_tables: list[list[int]]
    block_size: int
    pad_len: int = 0  # L, the new tokens of the longest row (the others are padded)
    kv_len: int = 0  # the longest row's keys
    kv_width: int = 0  # keys attention sees per row (padded rows are masked)
    offset: int | mx.array = 0
    write_slots: mx.array | None = None
    gather_blocks: mx.array | None = None
    # Set by `paged_attention.use_kernel` for a decode batch: attention reads the pools
    # through the block tables, so neither the gather nor a mask array is built.
    paged_kernel: bool = False
    paged_split: bool = False  # and splits each row's context over thread blocks
    fused_attention: bool = False  # decode rows through `fused_attention`'s kernel
    fused_layer: bool = False  # and each layer through `fused_layer`'s kernels
    offsets: mx.array | None = None
    # Every row starts at position 0 (a fresh prompt, no cached prefix): attention needs
    # only this call's keys, so they are used as computed, with no gather from the pool.
    fresh: bool = False
    _masks: dict[tuple[int | None, bool], mx.array | str | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        bs = self.block_size
        B = len(self.starts)
        L = max(self.lengths)
        self.pad_len = L
        self.kv_len = max(s + n for s, n in zip(self.starts, self.lengths))
        nb = (self.kv_len + bs - 1) // bs
        self.fresh = FRESH_PREFILL and not any(self.starts)
        # One row reads exactly its keys (so the causal mode needs no mask array); so do
        # fresh rows, right-padded to L: causal attention never sees the padding, and a
        # lone row's queries, aligned to its last key, see none either. Other rows read
        # whole blocks and the mask hides the rest.
        self.kv_width = max(self.starts) + L if B == 1 or self.fresh else nb * bs
        tables, slots = table_arrays(
            self.starts, self.lengths, self.block_tables, bs, B, nb, pad_len=L
        )
        self.gather_blocks = mx.array(tables)
        self.write_slots = mx.array(slots.reshape(-1))
        self.offset = self.starts[0] if B == 1 else mx.array(self.starts, dtype=mx.int32)

    def mask(
        self, window_size: int | None, as_array: bool = False
    ) -> mx.array | str | Window | None:
        if self.paged_kernel:
            return kernel_mask(window_size)
        key = (window_size, as_array)
        if key not in self._masks:
            self._masks[key] = self._make_mask(window_size, as_array)
        return self._masks[key]

    def _make_mask(self, window_size: int | None, as_array: bool) -> mx.array | str | None:
        B, L = len(self.starts), self.pad_len
        if (B == 1 or self.fresh) and window_size is None and not as_array:
            # One unpadded row, or fresh rows: the fused kernel's causal mode is exact.
            return "causal" if L > 1 else None
        starts = mx.array(self.starts, dtype=mx.int32)[:, None, None]
        ends = starts + mx.array(self.lengths, dtype=mx.int32)[:, None, None]
        q = starts + mx.arange(L, dtype=mx.int32)[None, :, None]  # query positions
        k = mx.arange(self.kv_width, dtype=mx.int32)[None, None, :]
        m = (k <= q) & (k < ends)
        if window_size is not None:
            m = m & (k > q - window_size)
        return m[:, None]  # [B, 1, L, S], broadcast over heads


class DecodeLayout:
    """A decode batch (one new token per row) whose every per-step value is an array,
    so one compiled trace serves every step of the same padded shape.

    tables [B, nb] block ids (unused entries 0, the null block); offsets [B] the tokens
    before each row's new one; write_slots [B] where each new token's KV goes."""

    pad_len = 1
    fresh = False
    fused_attention = False
    fused_layer = False
    traced = True  # a compiled step's: its attention stays in MLX

    def __init__(
        self,
        tables: mx.array,
        offsets: mx.array,
        write_slots: mx.array,
        block_size: int,
        paged_kernel: bool,
        paged_split: bool = False,
    ) -> None:
        self.gather_blocks = tables
        self.offsets = offsets
        self.offset = offsets
        self.write_slots = write_slots
        self.block_size = block_size
        self.paged_kernel = paged_kernel
        self.paged_split = paged_kernel and paged_split
        self.kv_width = tables.shape[1] * block_size

    def mask(self, window_size: int | None, as_array: bool = False) -> mx.array | Window | None:
        if self.paged_kernel:
            return kernel_mask(window_size)
        k = mx.arange(self.kv_width, dtype=mx.int32)[None, :]
        q = self.offsets[:, None]
        m = k <= q
        if window_size is not None:
            m = m & (k > q - window_size)
        return m[:, None, None, :]  # [B, 1, 1, S]


def kernel_mask(window_size: int | None) -> Window | None:
    """A layer's mask when the paged kernel attends: the kernel needs no array, only a
    sliding window's size."""
    return None if window_size is None else Window(window_size)


class PagedLayerCache:
    """One layer's view of the pool for one model call."""

    def __init__(self, pool: LayerPool, layout: BatchLayout | DecodeLayout) -> None:
        self.pool = pool
        self.layout = layout

    @property
    def offset(self) -> int | mx.array:
        return self.layout.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        lay, parts = self.layout, self.pool.parts
        B, H, L, _ = keys.shape
        parts[0][:, lay.write_slots] = keys.transpose(1, 0, 2, 3).reshape(H, B * L, -1)
        parts[1][:, lay.write_slots] = values.transpose(1, 0, 2, 3).reshape(H, B * L, -1)
        if lay.paged_kernel:
            return parts[0], parts[1]  # the paged kernel reads them in place
        if lay.fresh:
            return keys, values
        return self._gather(parts[0]), self._gather(parts[1])

    def _gather(self, flat: mx.array) -> mx.array:
        lay = self.layout
        H, _, D = flat.shape
        blocks = flat.reshape(H, self.pool.num_blocks, lay.block_size, D)
        dense = blocks[:, lay.gather_blocks]  # [H, B, nb, bs, D]
        _, B, nb, bs, _ = dense.shape
        dense = dense.reshape(H, B, nb * bs, D)
        if lay.kv_width < nb * bs:
            dense = dense[:, :, : lay.kv_width]
        return dense.transpose(1, 0, 2, 3)

    def make_mask(
        self, N: int, return_array: bool = False, window_size: int | None = None
    ) -> mx.array | str | Window | None:
        return self.layout.mask(window_size, return_array)

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


class QuantizedPagedLayerCache(PagedLayerCache):
    """A view over a quantised pool; `bits` and `group_size` are what mlx-lm's
    attention looks for to take its quantised path."""

    def __init__(self, pool: LayerPool, layout: BatchLayout | DecodeLayout) -> None:
        super().__init__(pool, layout)
        self.bits = pool.spec.bits
        self.group_size = pool.spec.group_size

    def update_and_fetch(  # type: ignore[override]
        self, keys: mx.array, values: mx.array
    ) -> tuple[tuple[mx.array, ...], tuple[mx.array, ...]]:
        lay, parts = self.layout, self.pool.parts
        B, H, L, _ = keys.shape
        new = [
            *mx.quantize(keys, group_size=self.group_size, bits=self.bits),
            *mx.quantize(values, group_size=self.group_size, bits=self.bits),
        ]
        for i, x in enumerate(new):
            parts[i][:, lay.write_slots] = x.transpose(1, 0, 2, 3).reshape(H, B * L, -1)
        if lay.fresh:
            return tuple(new[:3]), tuple(new[3:])
        gathered = tuple(self._gather(p) for p in parts)
        return gathered[:3], gathered[3:]
