"""One matmul for the projections that read the same input.

On a GPU a small model's decode step is bound by host time per op (5-10 µs each on
CUDA), and mlx-lm's attention runs three matmuls on one input (`q_proj`, `k_proj`,
`v_proj`) and its MLP two (`gate_proj`, `up_proj`). As vLLM's QKVParallelLinear and
MergedColumnParallelLinear do, this runs one matmul on their weights concatenated by
output rows and hands each projection its columns of the product. Quantisation groups
run along the input dimension, so stacking the rows of packed weights, scales and
biases is exact.

mlx-lm's classes stay as they are: each projection attribute becomes a `Part` that asks
a holder shared with its siblings. The models call `self.q_proj(x)`, `self.k_proj(x)`,
`self.v_proj(x)` on one array object (a tracer under `mx.compile`), so the first part
computes the fused product and keeps it with its input, and the others, given that same
object, take their slices; once all have, the holder lets go of both, so no graph outlives
the call. A part given any other input computes its own rows alone, so the result is
right in any call order.

Parameter names change: `self_attn.q_proj.weight` (and `k_proj`, `v_proj`) become
`self_attn.qkv_proj.weight` holding the rows of all three; likewise `mlp.gate_up_proj`.
Install this once the weights are final (nothing loads weights after the engine starts):
the parts keep views of the fused arrays. `PIPPIN_FUSED_PROJ=0` leaves the model alone
(for measuring).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Fused attribute name, then the projections it replaces, in row order.
GROUPS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))
# Exact classes only: subclasses (LoRA, MoE's SwitchLinear) compute something else.
KINDS = (nn.Linear, nn.QuantizedLinear)
_QUANT = ("group_size", "bits", "mode")


class Shared:
    """The fused layer's product for the input its parts are reading now."""

    def __init__(self, fused: nn.Module, bounds: list[tuple[int, int]], alone: list[Any]) -> None:
        self.fused = fused
        self.bounds = bounds  # each part's output columns
        self.alone = alone  # each part's rows as a layer of their own (views, no copies)
        self.x: mx.array | None = None
        self.y: mx.array | None = None
        self.due: set[int] = set()  # parts yet to take their slice of y
        self.fuse = True

    def rebind(self) -> None:
        """The parts' own layers made views of the fused layer's arrays again, after those
        were replaced (sleep mode moves them to the host and back): the old views would
        keep the old buffers alive."""
        arrays = _arrays(self.fused)
        self.alone = [
            _layer(self.fused, {k: v[a:b] for k, v in arrays.items()}) for a, b in self.bounds
        ]
        self.x = self.y = None

    def __call__(self, i: int, x: mx.array) -> mx.array:
        a, b = self.bounds[i]
        if self.y is not None:
            y = self.y
            if x is self.x and i in self.due:
                self.due.discard(i)
                if not self.due:
                    self.x = self.y = None
                return y[..., a:b]
            if i in self.due:  # another input while the kept one is still due
                return self.alone[i](x)
            # Part i comes round again before its siblings took theirs: this module does
            # not read them all from one input (Gemma 3n's KV-shared layers call q_proj
            # alone), so the fused product would be wasted work: stop fusing here.
            self.x = self.y = None
            self.fuse = False
        if not self.fuse:
            return self.alone[i](x)
        self.x, self.y = x, self.fused(x)
        self.due = set(range(len(self.bounds))) - {i}
        return self.y[..., a:b]


class Part(nn.Module):
    """One projection of a fused group: its columns of the shared product."""

    def __init__(self, shared: Shared, i: int) -> None:
        super().__init__()
        # Plain attributes, not children: the fused layer's arrays are counted once,
        # under the parent's fused attribute.
        self.shared = shared
        self.i = i

    def __call__(self, x: mx.array) -> mx.array:
        return self.shared(self.i, x)

    def _extra_repr(self) -> str:
        a, b = self.shared.bounds[self.i]
        return f"rows={a}:{b}"


def _arrays(layer: nn.Module) -> dict[str, mx.array]:
    return {k: v for k, v in layer.items() if isinstance(v, mx.array)}


def _fusable(layers: list[Any]) -> bool:
    first = layers[0]
    kind = type(first)
    if kind not in KINDS or any(type(m) is not kind for m in layers):
        return False
    ref = _arrays(first)
    if len(ref) != len(first):
        return False
    for m in layers[1:]:
        arrs = _arrays(m)
        if arrs.keys() != ref.keys() or len(arrs) != len(m):
            return False
        # Same trailing shape: same input width (and packing), same bias presence.
        if any(
            arrs[k].dtype != v.dtype or arrs[k].shape[1:] != v.shape[1:] for k, v in ref.items()
        ):
            return False
        if any(getattr(m, q, None) != getattr(first, q, None) for q in _QUANT):
            return False
    return True


def _layer(like: nn.Module, arrays: dict[str, mx.array]) -> nn.Module:
    """A layer of `like`'s class and quantisation settings holding `arrays`."""
    layer = type(like).__new__(type(like))  # no __init__: it would draw random weights
    nn.Module.__init__(layer)
    for q in _QUANT:
        if hasattr(like, q):
            setattr(layer, q, getattr(like, q))
    for k, v in arrays.items():
        setattr(layer, k, v)
    if isinstance(like, nn.QuantizedLinear):
        layer.freeze()  # as its own __init__ does
    return layer


def fuse(parent: nn.Module, fused_name: str, names: tuple[str, ...]) -> bool:
    if fused_name in parent:
        return False
    layers = [getattr(parent, n) for n in names]
    if not _fusable(layers):
        return False
    arrays = {k: mx.concatenate([m[k] for m in layers]) for k in _arrays(layers[0])}
    ends = [0]
    for m in layers:
        ends.append(ends[-1] + m["weight"].shape[0])
    bounds = list(zip(ends[:-1], ends[1:]))
    alone = [_layer(layers[0], {k: v[a:b] for k, v in arrays.items()}) for a, b in bounds]
    # Evaluated now, one group at a time: the old layers go when this returns, so the
    # peak stays one group's weights above the model (row slices share the fused buffer).
    mx.eval(arrays, [m.parameters() for m in alone])
    shared = Shared(_layer(layers[0], arrays), bounds, alone)
    setattr(parent, fused_name, shared.fused)
    for i, n in enumerate(names):
        setattr(parent, n, Part(shared, i))
    return True
