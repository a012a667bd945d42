"""Run the LM head only on the positions that sample.

A prompt chunk of L tokens needs the logits of its last position only, but mlx-lm's
models apply the head (hidden × vocab, a fifth of a 1B model's work per token, and a
[B, L, vocab] output) to every position, and slicing the result does not prune that
work. The final norm sits just before the head in mlx-lm's models (`model.model.norm`
and the like); this swaps that one module's class for a subclass that, while a
selection is set, keeps only the selected positions, so the head sees [n, 1, hidden].

The swap keeps the module's parameters and their names, so loading weights and
adapters is untouched. With no selection (decode, the compiled step) it is the norm.

`capture` also records the norm's output at every position for one call: the target's
last hidden states, which a multi-token-prediction head reads (`pippin.engine.mtp`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

# Where mlx-lm's models keep the final norm, from the outer model.
_PATHS = (("model", "norm"), ("language_model", "model", "norm"), ("model", "final_norm"))


class HeadRows:
    """The selection the final norm applies: rows and columns of its [B, L, D] input."""

    def __init__(self) -> None:
        self.rows: mx.array | None = None
        self.cols: mx.array | None = None
        self.shape: tuple[int, int] = (0, 0)

    @contextmanager
    def select(self, rows: list[int], cols: list[int], shape: tuple[int, int]) -> Iterator[None]:
        """Within the block, the model returns logits [len(rows), 1, vocab]: position
        (rows[i], cols[i]) of its [B, L] input for each i."""
        self.rows, self.cols, self.shape = mx.array(rows), mx.array(cols), shape
        try:
            yield
        finally:
            self.rows = self.cols = None


def final_norm(model: nn.Module) -> tuple[nn.Module, str] | None:
    for path in _PATHS:
        parent: Any = model
        for name in path[:-1]:
            parent = getattr(parent, name, None)
            if not isinstance(parent, nn.Module):
                break
        else:
            norm = getattr(parent, path[-1], None)
            if isinstance(norm, nn.Module):
                return parent, path[-1]
    return None


@dataclass
class Captured:
    """What `capture` recorded: the final norm's output at every position, [B, L, D]."""

    hidden: mx.array | None = None


class _Stand(nn.Module):
    """Stands in for the final norm while `capture` runs (a module, so that it takes the
    norm's place among its parent's children and gives it back)."""

    def __init__(self, call: Callable[..., mx.array]) -> None:
        super().__init__()
        self._call = call

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        return self._call(x, *args, **kwargs)


@contextmanager
def capture(
    model: nn.Module, rows: list[int], cols: list[int], shape: tuple[int, int]
) -> Iterator[Captured]:
    """Within the block, the model's final norm records its output at every position
    (lazy: it costs only what is evaluated of it); with `rows`, the head sees only the
    positions (rows[i], cols[i]) of its [B, L] = `shape` input, as `HeadRows.select`
    gives them (the same ops, so the same logits)."""
    found = final_norm(model)
    if found is None:
        raise ValueError("the model has no final norm known to pippin")
    parent, name = found
    norm = getattr(parent, name)
    out = Captured()
    picked = (mx.array(rows), mx.array(cols)) if rows else None

    def call(x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out.hidden = norm(x, *args, **kwargs)
        if picked is not None and x.ndim == 3 and tuple(x.shape[:2]) == shape:
            return norm(x[picked[0], picked[1]][:, None, :], *args, **kwargs)
        return out.hidden

    setattr(parent, name, _Stand(call))
    try:
        yield out
    finally:
        setattr(parent, name, norm)
