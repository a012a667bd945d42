"""A rendered prompt and its images -> token ids and the `MultiModal` data (API side).

The chat template writes one placeholder token per image (the processor's `boi_token`
where it has one, as Gemma 3's, else its image token); the model's own processor decides
what each image becomes (how many image tokens, with which markers around them) and its
pixel arrays. Each image is processed alone (so its arrays are its own, and its content
key covers exactly them), then its placeholder in the prompt is replaced by that
expansion; the image's span runs from its first image token to its last (one run for
most families; Idefics3's tiles have markers between their runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np
from PIL import Image

from pippin.vision.inputs import ImageInput, MultiModal, content_key
from pippin.vision.load import VisionParts

_SKIP = frozenset({"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids"})


class PromptImageError(ValueError):
    """The prompt and its images do not agree (a template that drops image parts)."""


def placeholder(parts: VisionParts) -> str:
    """The text a chat template writes for one image."""
    proc = parts.processor
    return getattr(proc, "boi_token", None) or proc.image_token


def process_image(
    parts: VisionParts, tokenizer: Any, image: Image.Image
) -> tuple[list[int], int, int, dict[str, np.ndarray]]:
    """What one image's placeholder becomes: its tokens, where its span (first to last
    image token) starts and ends in them, and the image's encoder inputs."""
    out = parts.processor(text=[placeholder(parts)], images=[image])
    ids = [int(t) for t in np.asarray(out["input_ids"]).reshape(-1)]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and ids and ids[0] == bos:
        ids = ids[1:]  # the processor's tokenizer call adds it; the prompt has its own
    where = [i for i, t in enumerate(ids) if t == parts.image_token_id]
    if not where:
        raise PromptImageError("the processor gave the image no image tokens")
    arrays = {k: np.asarray(v) for k, v in out.items() if k not in _SKIP and v is not None}
    return ids, where[0], where[-1] + 1, arrays


def build(
    parts: VisionParts,
    tokenizer: Any,
    text: str,
    images: Sequence[tuple[Image.Image, str]],
) -> tuple[list[int], MultiModal | None]:
    """Token ids of `text` with each image token expanded, and the images' data.

    `images` are (picture, sha256 of its content) in prompt order."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not images:
        return ids, None
    marker = tokenizer.encode(placeholder(parts), add_special_tokens=False)
    if len(marker) != 1:
        raise PromptImageError("the model's image placeholder is not one token")
    where = [i for i, t in enumerate(ids) if t == marker[0]]
    if len(where) != len(images):
        raise PromptImageError(
            f"the chat template wrote {len(where)} image placeholders for {len(images)} images"
        )
    out: list[int] = []
    inputs: list[ImageInput] = []
    prev = 0
    for pos, (image, sha) in zip(where, images):
        expansion, first, last, arrays = process_image(parts, tokenizer, image)
        span = tuple(expansion[first:last])
        tokens = span if any(t != parts.image_token_id for t in span) else ()
        out.extend(ids[prev:pos])
        start = len(out) + first
        out.extend(expansion)
        inputs.append(
            ImageInput(content_key(sha, arrays), start, start + len(span), arrays, tokens=tokens)
        )
        prev = pos + 1
    out.extend(ids[prev:])
    positions, delta = None, 0
    if parts.mrope:
        grids = np.concatenate([im.arrays["image_grid_thw"] for im in inputs])
        pos, deltas = parts.vlm.language_model.get_rope_index(
            mx.array([out]), image_grid_thw=mx.array(grids)
        )
        positions = np.asarray(pos[:, 0, :]).astype(np.int32)
        delta = int(np.asarray(deltas).reshape(-1)[0])
    return out, MultiModal(tuple(inputs), positions, delta)
