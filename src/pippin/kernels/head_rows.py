"""Run the LM head only on the positions that sample.

A prompt chunk of L tokens needs the logits of its last position only, but mlx-lm's
models apply the head (hidden × vocab, a fifth of a 1B model's work per token, and a
[B, L, vocab] output) to every position, and slicing the result does not prune that
work. The final norm sits just before the head in mlx-lm's models (`model.model.norm`
and the like); this swaps that one module's class for a subclass that, while a
selection is set, keeps only the selected positions, so the head sees [n, 1, hidden].

The swap keeps the module's parameters and their names, so loading weights and
adapters is untouched. With no selection (decode, the compiled step) it is the norm.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
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
