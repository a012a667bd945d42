"""LoRA adapters applied per row, so that requests for different adapters (and for the
base model) share one batch, as S-LoRA and Punica do.

Each projection some adapter targets is wrapped once, in place, by a `LoraLinear`: the
base layer's output plus, for each row of the call, its adapter's low-rank product. The
adapters' matrices are stacked per layer, A as [slots, in, r_max] and B as
[slots, r_max, out] (ranks zero-padded, which adds exact zeros; each adapter's scale
folded into B; slot 0 and free slots all zeros), and each row picks its slot through
`mx.gather_mm`. The call's slot per row is set by the model runner around the model call
(`LoraSet.rows`); with no adapter in the call the term is skipped. Compiled decode steps
take the slots as an input array of the graph (`pippin.runner.decode_graph`).

Slots are stable while an adapter is loaded (sequences hold theirs); adding or removing
one restacks the layers it touches. Everything here runs on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import fused_proj
from pippin.store.lora import Adapter, LoraError


class RowSlots:
    """The slot of each row of the model call in progress ([B] uint32), or None when no
    row has an adapter (the LoRA term is skipped)."""

    idx: mx.array | None = None


def _dims(layer: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a dense or quantised linear layer, or of a fused projection's part;
    None for anything else (embeddings, experts: not served)."""
    if isinstance(layer, fused_proj.Part):
        layer = layer.shared.alone[layer.i]
    if isinstance(layer, nn.QuantizedLinear):
        out, packed = layer.weight.shape
        return packed * 32 // layer.bits, out
    if isinstance(layer, nn.Linear):
        out, inp = layer.weight.shape
        return inp, out
    return None


class LoraLinear(nn.Module):
    """A base projection plus its rows' adapters' products."""

    def __init__(self, base: nn.Module, rows: RowSlots, dims: tuple[int, int]) -> None:
        super().__init__()
        self.base = base
        self.dims = dims
        # Plain attributes, not parameters: the stacks change as adapters come and go.
        object.__setattr__(self, "_rows", rows)
        object.__setattr__(self, "_a", None)
        object.__setattr__(self, "_b", None)

    def restack(self, a: mx.array | None, b: mx.array | None) -> None:
        object.__setattr__(self, "_a", a)
        object.__setattr__(self, "_b", b)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.base(x)
        idx = self._rows.idx
        if idx is None or self._a is None:
            return y
        if x.ndim != 3 or x.shape[0] != idx.shape[0]:
            raise ValueError(f"a LoRA layer got input {x.shape} for {idx.shape[0]} rows")
        z = mx.gather_mm(x.astype(self._a.dtype), self._a, rhs_indices=idx)
        z = mx.gather_mm(z, self._b, rhs_indices=idx)
        return y + z.astype(y.dtype)


@dataclass
class Loaded:
    name: str
    key: str  # name and content digest: salts the prefix cache's keys
    slot: int
    adapter: Adapter


class LoraSet:
    """The adapters loaded on one model, their slots and its wrapped layers."""

    def __init__(self, model: nn.Module, dtype: mx.Dtype) -> None:
        self.model = model
        self.dtype = dtype  # of the stacks: the model's activations
        self.rows = RowSlots()
        self.by_name: dict[str, Loaded] = {}
        self.layers: dict[str, LoraLinear] = {}  # wrapped, by module path

    def slot(self, name: str) -> Loaded | None:
        return self.by_name.get(name)

    def add(self, name: str, adapter: Adapter) -> Loaded:
        """Load `adapter` as `name` (the same adapter again: its slot as it is)."""
        have = self.by_name.get(name)
        if have is not None:
            if have.adapter.digest == adapter.digest:
                return have
            raise LoraError(f"another adapter is loaded as {name!r}")
        modules = dict(self.model.named_modules())
        for path, w in adapter.modules.items():
            target = modules.get(path)
            if target is None:
                raise LoraError(f"the model has no module {path!r} (the adapter targets it)")
            if isinstance(target, LoraLinear):
                target = target.base
            dims = _dims(target)
            if dims is None:
                raise LoraError(f"module {path!r} is a {type(target).__name__}: not served")
            if (w.a.shape[0], w.b.shape[1]) != dims:
                raise LoraError(
                    f"module {path!r}: the adapter's shape ({w.a.shape[0]} in, "
                    f"{w.b.shape[1]} out) does not match the model's {dims}"
                )
        used = {x.slot for x in self.by_name.values()}
        slot = next(s for s in range(1, len(used) + 2) if s not in used)
        loaded = Loaded(name, f"{name}:{adapter.digest}", slot, adapter)
        for path in adapter.modules:
            if path not in self.layers:
                self._wrap(path, modules)
        self.by_name[name] = loaded
        self._restack()
        return loaded

    def remove(self, name: str) -> None:
        self.by_name.pop(name)
        self._restack()

    def _wrap(self, path: str, modules: dict[str, nn.Module]) -> None:
        parent_path, _, attr = path.rpartition(".")
        parent = modules[parent_path] if parent_path else self.model
        base = modules[path]
        dims = _dims(base)
        assert dims is not None
        layer = LoraLinear(base, self.rows, dims)
        if isinstance(parent, list):  # a list of layers: the attribute is an index
            parent[int(attr)] = layer
        else:
            setattr(parent, attr, layer)
        self.layers[path] = layer

    def _restack(self) -> None:
        """Every wrapped layer's stacks anew, from the loaded adapters: all of them, so
        that every stack has a slot for every row's index."""
        size = max((x.slot for x in self.by_name.values()), default=0) + 1
        out: list[mx.array] = []
        for path, layer in self.layers.items():
            users = [x for x in self.by_name.values() if path in x.adapter.modules]
            if not users:
                layer.restack(None, None)
                continue
            r = max(x.adapter.modules[path].rank for x in users)
            inp, outp = layer.dims
            a = mx.zeros((size, inp, r), self.dtype)
            b = mx.zeros((size, r, outp), self.dtype)
            for x in users:
                w = x.adapter.modules[path]
                a[x.slot, :, : w.rank] = w.a.astype(self.dtype)
                b[x.slot, : w.rank, :] = (w.scale * w.b.astype(mx.float32)).astype(self.dtype)
            layer.restack(a, b)
            out += [a, b]
        mx.eval(out)

    @contextmanager
    def use(self, slots: list[int], rows: int | None = None) -> Iterator[None]:
        """Rows' slots (0: none) for one model call, padded with 0 to `rows`."""
        if any(slots):
            padded = slots + [0] * ((rows or len(slots)) - len(slots))
            self.rows.idx = mx.array(padded, dtype=mx.uint32)
        try:
            yield
        finally:
            self.rows.idx = None

    @contextmanager
    def traced(self, idx: mx.array) -> Iterator[None]:
        """The slots as an array (a compiled graph's input)."""
        self.rows.idx = idx
        try:
            yield
        finally:
            self.rows.idx = None
