"""The vision tower as its own step: the images a step's prompt chunks reach, encoded in
one call, with a bounded LRU of encoder outputs keyed by content.

An image's output is the embeddings of its span, computed by mlx-vlm's own
`get_input_embeddings` over a row made of the span's tokens (image tokens, and any tile
markers between them): whatever the family does to merge features (projectors, scaling)
is its own code. Several images go in one call as one row of their spans back to back,
with their pixel arrays concatenated (images whose arrays agree in shape past the first
axis), which every family in `load.SUPPORTED_FAMILIES` merges in order.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import mlx.core as mx
import numpy as np

from pippin.vision.inputs import ImageInput, SeqMedia
from pippin.vision.load import VisionParts

DEFAULT_CACHE_ENTRIES = 64


class EncoderCache:
    """Encoder outputs by content key, least recently used evicted first."""

    def __init__(self, max_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        self.max_entries = max_entries
        self._items: OrderedDict[str, mx.array] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> mx.array | None:
        v = self._items.get(key)
        if v is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return v

    def put(self, key: str, value: mx.array) -> None:
        if self.max_entries <= 0:
            return
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()


def _concat(images: list[ImageInput]) -> dict[str, mx.array]:
    names = images[0].arrays.keys()
    return {n: mx.array(np.concatenate([im.arrays[n] for im in images])) for n in names}


class VisionEncoder:
    """Runs on the engine thread, before a step's model call (`prepare`)."""

    def __init__(self, parts: VisionParts, cache_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        self.parts = parts
        self.cache = EncoderCache(cache_entries)
        self.images_encoded = 0
        self.calls = 0

    def encode(self, images: list[ImageInput]) -> list[mx.array]:
        """Each image's span embeddings [num_tokens, hidden], in one call per group of
        images that carry the same arrays."""
        out: list[mx.array | None] = [None] * len(images)
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, im in enumerate(images):
            # Arrays concatenate along their first axis, so a group's other axes agree
            # (audio clips of different lengths go in calls of their own).
            shapes = tuple((n, im.arrays[n].shape[1:]) for n in sorted(im.arrays))
            groups.setdefault((im.token_id, shapes), []).append(i)
        for idx in groups.values():
            batch = [images[i] for i in idx]
            row = [t for im in batch for t in self._span(im)]
            ids = mx.array([row])
            arrays = _concat(batch)
            pixels = arrays.pop("pixel_values", None)
            got = self.parts.vlm.get_input_embeddings(ids, pixels, mask=mx.ones_like(ids), **arrays)
            emb = got.inputs_embeds[0]
            if self.parts.deepstack:
                # Qwen3-VL: each layer's deepstack rows beside the token's embedding.
                emb = mx.concatenate([emb, *got.deepstack_visual_embeds], axis=-1)
            self.calls += 1
            self.images_encoded += len(batch)
            k = 0
            for i, im in zip(idx, batch):
                out[i] = emb[k : k + im.num_tokens]
                k += im.num_tokens
        return [o for o in out if o is not None]

    def _span(self, im: ImageInput) -> tuple[int, ...]:
        placeholder = self.parts.image_token_id if im.token_id is None else im.token_id
        return im.tokens or (placeholder,) * im.num_tokens

    def prepare(self, items: list[Any]) -> None:
        """Make sure every image that the rows `items` (start, length, seq with `media`)
        reach has its encoder output on its sequence: from the sequence, the cache, or
        one batched encoder call for the rest. Outputs a sequence's prefill has passed
        are let go."""
        need: dict[str, ImageInput] = {}
        waiting: list[tuple[SeqMedia, int]] = []
        for it in items:
            media: SeqMedia | None = it.seq.media
            if media is None:
                continue
            end = it.start + it.length
            for i in list(media.features):
                if media.mm.images[i].end <= it.start:
                    del media.features[i]
            for i in media.overlapping(it.start, end):
                if i in media.features:
                    continue
                im = media.mm.images[i]
                cached = self.cache.get(im.key)
                if cached is not None:
                    media.features[i] = cached
                else:
                    need.setdefault(im.key, im)
                    waiting.append((media, i))
        if not need:
            return
        encoded = dict(zip(need, self.encode(list(need.values()))))
        mx.eval(list(encoded.values()))
        for key, value in encoded.items():
            self.cache.put(key, value)
        for media, i in waiting:
            media.features[i] = encoded[media.mm.images[i].key]

    def stats(self) -> dict[str, int]:
        return {
            "vision_encoder_calls": self.calls,
            "vision_images_encoded": self.images_encoded,
            "vision_encoder_cache_hits": self.cache.hits,
            "vision_encoder_cache_entries": len(self.cache),
        }
