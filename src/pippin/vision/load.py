"""Loading a vision-language model with mlx-vlm, and the language model the engine runs.

mlx-vlm's `Model` is a vision tower plus a language model shaped like mlx-lm's (layers
that call a cache's `offset`, `update_and_fetch` and `make_mask`). The engine runs only
`LanguageAdapter`, which wraps that language model in mlx-lm's calling convention
(`model(tokens, cache=...)` returns logits) and takes, per step, the image embeddings
and positions that `step_inputs` builds from the scheduled rows. The vision tower runs
apart, in `encoder`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

# Families whose language model takes M-RoPE positions ([3, B, L]: time, height, width).
MROPE_FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})
# Families whose image placeholders become one span per image (a run of the image token,
# or Idefics3's tile runs with markers between), filled by the image's features, which
# `encoder` can compute for many images in one call.
SUPPORTED_FAMILIES = frozenset(
    {
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
        "llava",
        "gemma3",
        "idefics3",
        "smolvlm",
        "idefics2",
        "mistral3",
        "pixtral",
    }
)
# Text models of a supported family that pippin cannot batch correctly yet: Ministral 3's
# and Mistral 4's attention scale depends on the position, and mlx-vlm computes it from
# the first row's cache offset for the whole batch.
UNSUPPORTED_TEXT_MODELS = frozenset({"ministral3", "mistral4"})


def text_model_type(path: Path) -> str | None:
    try:
        text = json.loads((path / "config.json").read_text()).get("text_config")
    except (OSError, ValueError, AttributeError):
        return None
    return str(text.get("model_type", "")) if isinstance(text, dict) else None


def vision_family(path: Path) -> str | None:
    """The model type of a vision-language checkpoint in `path` (a config with a vision
    part), None for a text model."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not isinstance(config.get("vision_config"), dict):
        return None
    return str(config.get("model_type", ""))


def is_vlm_folder(path: Path) -> bool:
    """Whether `path` holds a checkpoint that pippin serves as a vision-language model: a
    supported family, with mlx-vlm installed. Others (a family not supported yet, or no
    `vision` extra) load as before, through mlx-lm, as text models."""
    family = vision_family(path)
    if text_model_type(path) in UNSUPPORTED_TEXT_MODELS:
        return False
    audio = family in AUDIO_FAMILIES and has_audio_tower(path)
    return (family in SUPPORTED_FAMILIES or audio) and vision_available()


def vision_available() -> bool:
    try:
        import mlx_vlm  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(eq=False)
class VisionParts:
    """What serving a VLM needs beyond its language model: the whole mlx-vlm model (for
    its vision tower and `get_input_embeddings`), its processor and the family facts."""

    vlm: Any  # mlx_vlm Model
    processor: Any
    family: str
    image_token_id: int
    video_token_id: int | None
    mrope: bool
    # The audio placeholder token of a model that takes audio in chat (`omni`), else None.
    audio_token_id: int | None = None
    takes_images: bool = True
    # Qwen3-VL's deepstack: how many inner vision layers' features are added to the first
    # text layers' hidden states at the image positions (0 for other families). The
    # encoder's output per image token is then [main | layer 0 | layer 1 ...] on one row.
    deepstack: int = 0


class LanguageAdapter(nn.Module):
    """An mlx-vlm language model in mlx-lm's calling convention."""

    def __init__(self, language_model: nn.Module, mrope: bool, deepstack: int = 0) -> None:
        super().__init__()
        self.language_model = language_model
        self._mrope = mrope
        self._deepstack = deepstack

    @property
    def layers(self) -> list[nn.Module]:
        return self.language_model.layers

    @property
    def mrope(self) -> bool:
        return self._mrope

    def make_cache(self) -> list[Any]:
        """mlx-lm cache classes (the engine's probe reads their kind) of the language
        model's own layout."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        own = getattr(self.language_model, "make_cache", None)
        if own is None:
            return [KVCache() for _ in self.layers]
        out: list[Any] = []
        for c in own():
            if type(c).__name__ == "RotatingKVCache":
                out.append(RotatingKVCache(max_size=c.max_size, keep=c.keep))
            elif type(c).__name__ == "KVCache":
                out.append(KVCache())
            else:
                raise ValueError(f"unsupported cache {type(c).__name__} in a vision model")
        return out

    def embed(self, tokens: mx.array) -> mx.array:
        # Idefics3's language model holds its embeddings itself, not in an inner `model`.
        inner = getattr(self.language_model, "model", self.language_model)
        return inner.embed_tokens(tokens)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
        position_ids: mx.array | None = None,
        visual_pos_masks: mx.array | None = None,
        deepstack_visual_embeds: list[mx.array] | None = None,
    ) -> mx.array:
        lm = self.language_model
        if not self._mrope:
            return lm(inputs, inputs_embeds=input_embeddings, cache=cache).logits
        if position_ids is None:  # plain text positions (the engine's probe)
            B, L = inputs.shape
            off = cache[0].offset if cache else 0
            position_ids = mx.broadcast_to(mx.arange(off, off + L)[None, None], (3, B, L))
        # The inner model directly, with explicit positions: the outer one keeps
        # per-generation rope state that a batch of unrelated sequences cannot share.
        ds = {}
        if deepstack_visual_embeds is not None:
            ds = {
                "visual_pos_masks": visual_pos_masks,
                "deepstack_visual_embeds": deepstack_visual_embeds,
            }
        h = lm.model(
            inputs, inputs_embeds=input_embeddings, cache=cache, position_ids=position_ids, **ds
        )
        if lm.args.tie_word_embeddings:
            return lm.model.embed_tokens.as_linear(h)
        return lm.lm_head(h)

    def step_inputs(self, items: list[Any], inputs: mx.array) -> dict[str, mx.array]:
        """The extra inputs of one model call over `items` (rows of `inputs` [B, L]):
        image embeddings in place of the placeholder tokens' (sliced to each row's chunk),
        and M-RoPE positions."""
        kw: dict[str, mx.array] = {}
        B, L = inputs.shape
        if self._mrope:
            pos = np.zeros((3, B, L), dtype=np.int32)
            for b, it in enumerate(items):
                media = it.seq.media
                if media is not None and media.mm.positions is not None:
                    pos[:, b, : it.length] = media.positions(it.start, it.length)
                else:
                    pos[:, b, : it.length] = np.arange(it.start, it.start + it.length)
            kw["position_ids"] = mx.array(pos)
        rows = []
        for b, it in enumerate(items):
            media = it.seq.media
            if media is None or it.length == 0:
                continue
            end = it.start + it.length
            for i in media.overlapping(it.start, end):
                rows.append((b, it.start, end, media.mm.images[i], media.features[i]))
        if rows:
            emb = self.embed(inputs)
            H = emb.shape[-1]
            mask = np.zeros((B, L), dtype=bool)
            stack: list[mx.array] = []  # deepstack rows, batch-major as the model reads them
            for b, start, end, im, feats in rows:
                lo, hi = max(start, im.start), min(end, im.end)
                part = feats[lo - im.start : hi - im.start]
                emb[b, lo - start : hi - start] = part[:, :H].astype(emb.dtype)
                mask[b, lo - start : hi - start] = True
                stack.append(part[:, H:])
            kw["input_embeddings"] = emb
            if self._deepstack:
                ds = mx.concatenate(stack).astype(emb.dtype)  # rows are in batch, then span order
                kw["visual_pos_masks"] = mx.array(mask)
                kw["deepstack_visual_embeds"] = [
                    ds[:, k * H : (k + 1) * H] for k in range(self._deepstack)
                ]
        return kw


# Families whose audio tower pippin runs (audio in chat: `omni`), with their adapters;
# served through mlx-vlm only with an `audio_config` (others load as before).
AUDIO_FAMILIES = frozenset({"gemma4"})


def has_audio_tower(path: Path) -> bool:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("audio_config"), dict)


class Gemma4Adapter(LanguageAdapter):
    def __init__(self, language_model: Any, media_token_ids: Sequence[int]) -> None:
        super().__init__(language_model, mrope=False)
        self._media_ids = tuple(media_token_ids)

    def embed(self, tokens: mx.array) -> mx.array:
        m = self.language_model.model
        return m.embed_tokens(tokens) * m.embed_scale

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        input_embeddings: mx.array | None = None,
        position_ids: mx.array | None = None,
    ) -> mx.array:
        lm = self.language_model
        per_layer = None
        if lm.model.hidden_size_per_layer_input:
            text = inputs
            for t in self._media_ids:
                text = mx.where(text == t, 0, text)
            per_layer = lm.model.get_per_layer_inputs(text)
        out = lm(inputs, inputs_embeds=input_embeddings, cache=cache, per_layer_inputs=per_layer)
        return out.logits


def _eval_hidden_arrays(root: nn.Module) -> None:
    """Evaluate the arrays a model keeps outside its parameters (Gemma 4's audio attention
    builds its relative-position timescales lazily, on a private sub-module): here, on the
    loading thread, since a lazy array cannot be evaluated on another thread (the engine's)
    without the stream it was made on."""
    seen: set[int] = set()
    found: list[mx.array] = []

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            found.append(obj)
        elif isinstance(obj, nn.Module):
            for v in (*vars(obj).values(), *obj.values()):
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)

    walk(root)
    mx.eval(found)


def adapt_audio_family(parts: VisionParts) -> LanguageAdapter:
    """The language adapter of an audio family; fills in `parts`' audio facts."""
    _eval_hidden_arrays(parts.vlm)
    cfg = parts.vlm.config
    parts.audio_token_id = int(cfg.audio_token_id)
    parts.takes_images = False
    ids = [parts.image_token_id, int(cfg.audio_token_id)]
    if getattr(cfg, "video_token_id", None) is not None:
        ids.append(int(cfg.video_token_id))
    return Gemma4Adapter(parts.vlm.language_model, ids)


def load_vlm(path: Path, weights: bool = True) -> tuple[LanguageAdapter, VisionParts, dict]:
    """The language adapter, the vision parts and the config of the VLM folder `path`."""
    from mlx_vlm.utils import load_config, load_image_processor, load_model, load_processor

    config = load_config(path)
    family = config.get("model_type", "")
    if (family not in SUPPORTED_FAMILIES and family not in AUDIO_FAMILIES) or text_model_type(
        path
    ) in UNSUPPORTED_TEXT_MODELS:
        raise ValueError(
            f"vision model family {family!r} is not supported yet "
            f"(supported: {', '.join(sorted(SUPPORTED_FAMILIES))})"
        )
    vlm = load_model(path, lazy=not weights)
    processor = load_processor(path, True, eos_token_ids=config.get("eos_token_id"))
    image_processor = load_image_processor(path)
    if image_processor is not None:
        processor.image_processor = image_processor
    cfg = vlm.config
    image_token = getattr(cfg, "image_token_id", None)
    if image_token is None:
        image_token = getattr(cfg, "image_token_index", None)
    if image_token is None:
        raise ValueError(f"the {family} config names no image token")
    mrope = family in MROPE_FAMILIES
    deepstack = len(getattr(cfg.vision_config, "deepstack_visual_indexes", None) or [])
    parts = VisionParts(
        vlm=vlm,
        processor=processor,
        family=family,
        image_token_id=int(image_token),
        video_token_id=getattr(cfg, "video_token_id", None),
        mrope=mrope,
        deepstack=deepstack,
    )
    if weights:
        mx.eval(vlm.parameters())
    if family in AUDIO_FAMILIES:
        return adapt_audio_family(parts), parts, config
    return LanguageAdapter(vlm.language_model, mrope, deepstack), parts, config
