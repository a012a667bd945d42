"""A rendered prompt and its images -> token ids and the `MultiModal` data (API side).

The chat template writes one image token per image; the model's own processor decides
how many tokens each image takes and its pixel arrays. Each image is processed alone
(so its arrays are its own, and its content key covers exactly them), then its token in
the prompt is expanded to that many copies.
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


def process_image(parts: VisionParts, image: Image.Image) -> tuple[int, dict[str, np.ndarray]]:
    """How many placeholder tokens `image` takes, and its encoder inputs."""
    proc = parts.processor
    out = proc(text=[proc.image_token], images=[image])
    ids = np.asarray(out["input_ids"]).reshape(-1)
    n = int((ids == parts.image_token_id).sum())
    arrays = {k: np.asarray(v) for k, v in out.items() if k not in _SKIP and v is not None}
    return n, arrays


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
    where = [i for i, t in enumerate(ids) if t == parts.image_token_id]
    if len(where) != len(images):
        raise PromptImageError(
            f"the chat template wrote {len(where)} image placeholders for {len(images)} images"
        )
    out: list[int] = []
    inputs: list[ImageInput] = []
    prev = 0
    for pos, (image, sha) in zip(where, images):
        n, arrays = process_image(parts, image)
        out.extend(ids[prev:pos])
        start = len(out)
        out.extend([parts.image_token_id] * n)
        inputs.append(ImageInput(content_key(sha, arrays), start, start + n, arrays))
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
