"""Tiny random-weight VLMs: mlx-vlm's logits (the model pippin's greedy tokens are shown to
equal in test_vision_engine) against transformers' implementation of the same family, on
the same weights and the same processor outputs (token ids and pixel values)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_vlm")
torch = pytest.importorskip(
    "torch", reason="torch is needed for the reference: pip install torch==2.13.0"
)

import mlx.core as mx  # noqa: E402
from support.tiny_vlms import get_tiny_vlm  # noqa: E402
from test_vision_engine import prompt  # noqa: E402

from pippin.store.loader import load_model  # noqa: E402

AGREE = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "gemma3")
# Not yet explained: agree on text, differ once an image is in (max abs ~1.9 of ~4): the
# Pixtral tower, the patch merger or the projector; strict, so a fix shows up here.
IMAGES_UNEXPLAINED = ("mistral3",)
# Not compared yet: idefics2, idefics3, smolvlm and pixtral need more of the name mapping
# (and config reading) than _mlx_name does.


def _mlx_name(name: str, mlx_names: set[str]) -> str:
    """transformers 5's parameter name -> the MLX checkpoint's (mlx-vlm's sanitize, inverted)."""
    if name == "lm_head.weight":
        return "language_model.lm_head.weight"
    name = name.removeprefix("model.")
    if name.startswith("language_model."):
        return "language_model.model." + name.removeprefix("language_model.")
    if name.startswith("visual."):
        return "vision_tower." + name.removeprefix("visual.")
    if name not in mlx_names and name.startswith("vision_tower."):
        return "vision_tower.vision_model." + name.removeprefix("vision_tower.")
    return name


def hf_model(path, loaded):
    import transformers
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    cfg = AutoConfig.from_pretrained(path)
    # Tie as mlx-vlm does: its Gemma 3 always uses the embeddings as lm_head (its sanitize
    # replaces the checkpoint's), the others the checkpoint's own lm_head.
    lm = loaded.vision.vlm.language_model
    tied = bool(mx.array_equal(lm.lm_head.weight, lm.model.embed_tokens.weight))
    cfg.tie_word_embeddings = tied
    cfg.get_text_config().tie_word_embeddings = tied
    cls = getattr(transformers, cfg.architectures[0])
    model = cls._from_config(cfg, dtype=torch.float32).eval()
    weights = {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
    state = {}
    if tied:
        weights.pop("language_model.lm_head.weight")
    for name, ref in model.state_dict().items():
        if name == "lm_head.weight" and "language_model.lm_head.weight" not in weights:
            continue  # tied: loaded as the embeddings
        key = _mlx_name(name, set(weights))
        if key not in weights:
            continue  # parts the family's forward never uses (SigLIP's pooling head)
        w = weights.pop(key)
        if w.shape != tuple(ref.shape):
            w = np.moveaxis(w, -1, 1)  # MLX convolutions keep channels last
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    assert not weights, f"MLX weights transformers has no place for: {sorted(weights)}"
    model.load_state_dict(state, strict=False)
    return cfg, model


@pytest.fixture(
    scope="module",
    params=[*AGREE, *IMAGES_UNEXPLAINED],
)
def pair(request, tmp_path_factory):
    path = get_tiny_vlm(request.param, tmp_path_factory.mktemp("vlm"))
    loaded = load_model(str(path))
    return loaded, *hf_model(path, loaded)


@pytest.mark.parametrize("n_images", [0, 1, 2])
def test_logits_match_transformers(request, pair, n_images: int) -> None:
    loaded, cfg, model = pair
    if n_images and loaded.vision.vlm.config.model_type in IMAGES_UNEXPLAINED:
        request.applymarker(pytest.mark.xfail(strict=True, raises=AssertionError))
    ids, mm = prompt(loaded, n_images, "What is in this picture?", list(range(1, n_images + 1)))
    arrays = (
        {k: np.concatenate([im.arrays[k] for im in mm.images]) for k in mm.images[0].arrays}
        if mm is not None
        else {"pixel_values": None}
    )
    vlm = loaded.vision.vlm
    if hasattr(vlm.language_model, "_position_ids"):
        vlm.language_model._position_ids = None
        vlm.language_model._rope_deltas = None
    x = mx.array([ids])
    kw = {k: None if v is None else mx.array(v) for k, v in arrays.items()}
    pixels = kw.pop("pixel_values")
    if loaded.vision.vlm.config.model_type == "gemma3":
        # mlx-vlm's Gemma 3 `__call__` hands its text model an all-ones 4-D mask (no causal
        # mask); pippin takes only the embeddings and runs the text model causally, as here.
        emb = vlm.get_input_embeddings(x, pixels, mx.ones_like(x)).inputs_embeds
        out = vlm.language_model(x, inputs_embeds=emb, mask=None)
    else:
        # No mask: the text models make their own causal one (LLaVA's takes a given one as is).
        out = vlm(x, pixels, mask=None, **kw)
    got = np.array(out.logits[0])
    image_token = getattr(cfg, "image_token_id", None) or cfg.image_token_index
    inputs = {k: torch.from_numpy(v) for k, v in arrays.items() if v is not None}
    t_ids = torch.tensor([ids])
    with torch.no_grad():
        ref = model(
            input_ids=t_ids,
            attention_mask=torch.ones_like(t_ids),
            mm_token_type_ids=(t_ids == image_token).long(),
            **inputs,
        ).logits[0]
    ref = ref.numpy()
    scale = float(np.abs(ref).max())
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-3 * scale)


def test_gemma3_image_tokens_attend_both_ways_in_transformers(tmp_path) -> None:
    """By design, not a bug: transformers' Gemma 3 lets an image's tokens attend to each other
    both ways when given the processor's token_type_ids; mlx-vlm (and so pippin) attends
    causally. Without token_type_ids (above) the two agree; with them they must differ, so
    this test notices if either side changes."""
    path = get_tiny_vlm("gemma3", tmp_path)
    loaded = load_model(str(path))
    cfg, model = hf_model(path, loaded)
    ids, mm = prompt(loaded, 1, "What is in this picture?", [1])
    t_ids = torch.tensor([ids])
    types = (t_ids == cfg.image_token_index).long()
    pixels = torch.from_numpy(mm.images[0].arrays["pixel_values"])
    with torch.no_grad():
        causal = model(input_ids=t_ids, pixel_values=pixels).logits[0, -1]
        both_ways = model(input_ids=t_ids, pixel_values=pixels, token_type_ids=types).logits[0, -1]
    assert float((causal - both_ways).abs().max()) > 1e-2
