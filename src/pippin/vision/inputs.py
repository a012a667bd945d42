"""The plain data a request's images become on their way to the engine.

Everything here is numpy and built-in types, so it pickles to an engine process.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ImageInput:
    """One image (or video frame group) of a prompt, preprocessed by the model's processor."""

    # Content key: the picture's sha256 with how it was preprocessed (its pixel shape and
    # grid), so equal keys mean equal encoder outputs.
    key: str
    start: int  # the span of prompt positions its placeholder tokens take
    end: int
    # The encoder's inputs for this image alone (pixel_values, image_grid_thw, ...).
    arrays: dict[str, np.ndarray]
    # The placeholder token of its span when not the model's image token (an audio clip:
    # the audio token, with input_features in its arrays instead of pixels).
    token_id: int | None = None
    # The span's token ids where they are not all the image token: Idefics3 / SmolVLM
    # tiles, whose runs of image tokens have row/column markers between them (the
    # markers' embeddings are then part of the encoder's output). Empty: all image tokens.
    tokens: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def key_id(self) -> int:
        """What the image's positions count as in block keys: a negative id (no real token
        has one) derived from the content key, so different images never share KV."""
        return -1 - int(self.key[:15], 16)


def content_key(sha256: str, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.sha256(sha256.encode())
    for name in sorted(arrays):
        a = arrays[name]
        h.update(f"{name}{a.shape}{a.dtype}".encode())
        if name != "pixel_values":  # grids and sizes are small; the pixels are the sha
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class MultiModal:
    """A prompt's images, and its M-RoPE positions for the families that use them."""

    images: tuple[ImageInput, ...]
    # [3, prompt_len] int32 positions (temporal, height, width) for M-RoPE models; the
    # positions after the prompt are `index + rope_delta`.
    positions: np.ndarray | None = None
    rope_delta: int = 0

    @property
    def num_image_tokens(self) -> int:
        return sum(im.num_tokens for im in self.images)


@dataclass(eq=False)
class SeqMedia:
    """A sequence's images on the engine side: the keyed prompt (image positions replaced
    by their key ids, for the block hashes) and the encoder outputs it still needs."""

    mm: MultiModal
    key_prompt: list[int]
    # Image index -> encoder output [num_tokens, hidden], held until the prefill passes it.
    features: dict[int, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, mm: MultiModal, prompt_ids: list[int]) -> SeqMedia:
        keyed = list(prompt_ids)
        for im in mm.images:
            keyed[im.start : im.end] = [im.key_id] * im.num_tokens
        return cls(mm, keyed)

    def overlapping(self, start: int, end: int) -> list[int]:
        """Indices of the images whose span meets [start, end)."""
        return [i for i, im in enumerate(self.mm.images) if im.start < end and start < im.end]

    def positions(self, start: int, length: int) -> np.ndarray:
        """M-RoPE positions [3, length] of tokens start..start+length."""
        pos = self.mm.positions
        assert pos is not None
        p = pos.shape[1]
        out = np.empty((3, length), dtype=np.int32)
        k = max(0, min(length, p - start))
        if k:
            out[:, :k] = pos[:, start : start + k]
        if k < length:
            out[:, k:] = np.arange(start + k, start + length, dtype=np.int32) + self.mm.rope_delta
        return out
