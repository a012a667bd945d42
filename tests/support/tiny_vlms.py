"""Tiny random-weight vision-language models, built at test time from mlx-vlm's classes.

Each is a folder laid out as the Hugging Face checkpoint of its family (``config.json``,
``model.safetensors``, ``preprocessor_config.json``, a tokenizer with the family's image
tokens and a chat template that writes them), so ``mlx_vlm.load`` reads it with its own
processor. The tokenizer is tiny_models' trained BPE with the image tokens added.

Families: ``qwen2_vl``, ``qwen2_5_vl`` (M-RoPE positions), ``qwen3_vl`` (M-RoPE and deepstack),
``llava`` (a Llama text model, plain positions), ``gemma3``, ``idefics2``, ``idefics3``
and ``smolvlm`` (tiles with markers between their runs), ``mistral3`` and ``pixtral``
(rows of image tokens with breaks). Images of 56x56 give 4
tokens (Qwen2.5-VL, Qwen3-VL at 64x64 after its resize) and 4x4 patches + CLS (LLaVA:
16 tokens).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from pippin.bench.vlm_models import TEMPLATE as VLM_TEMPLATE

from . import tiny_models

FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "llava",
    "gemma3",
    "qwen3_vl",
    "idefics3",
    "smolvlm",
    "idefics2",
    "mistral3",
    "pixtral",
)

_QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
_LLAVA_TOKENS = ("<image>",)
_IDEFICS_TOKENS = (
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)),
    "<end_of_utterance>",
)
_MISTRAL_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
_GEMMA_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")

# Qwen2-VL's template for image parts (and plain text), ChatML around it: the bench's.
QWEN_TEMPLATE = VLM_TEMPLATE
_LLAVA_TEMPLATE = QWEN_TEMPLATE.replace(
    "'<|vision_start|><|image_pad|><|vision_end|>'", "'<image>\\n'"
).replace("'<|vision_start|><|video_pad|><|vision_end|>'", "'<image>\\n'")

_IDEFICS_TEMPLATE = QWEN_TEMPLATE.replace(
    "'<|vision_start|><|image_pad|><|vision_end|>'", "'<image>'"
).replace("'<|vision_start|><|video_pad|><|vision_end|>'", "'<image>'")

_MISTRAL_TEMPLATE = QWEN_TEMPLATE.replace(
    "'<|vision_start|><|image_pad|><|vision_end|>'", "'[IMG]'"
).replace("'<|vision_start|><|video_pad|><|vision_end|>'", "'[IMG]'")

_GEMMA_TEMPLATE = QWEN_TEMPLATE.replace(
    "'<|vision_start|><|image_pad|><|vision_end|>'", "'<start_of_image>'"
).replace("'<|vision_start|><|video_pad|><|vision_end|>'", "'<start_of_image>'")

TEXT_HIDDEN = 64


def add_tokens(dest: Path, tokens: tuple[str, ...], template: str) -> dict[str, int]:
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in tokens])
    tok.save(str(dest / "tokenizer.json"))
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    for t in tokens:
        cfg["added_tokens_decoder"][str(tok.token_to_id(t))] = {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    cfg["chat_template"] = template
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    (dest / "chat_template.jinja").write_text(template)
    ids = {t: tok.token_to_id(t) for t in (*tiny_models.SPECIAL_TOKENS, *tokens)}
    ids["vocab"] = tok.get_vocab_size(with_added_tokens=True)
    return ids


def _text_config(ids: dict[str, int], model_type: str) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "hidden_size": TEXT_HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": ids["vocab"],
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }


# The image processor steps every family's tiny checkpoint takes.
_PREPROCESS = {"do_resize": True, "do_rescale": True, "do_normalize": True}


def _qwen_token_ids(ids: dict[str, int]) -> dict[str, int]:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids[tiny_models.EOS_TOKEN],
    }


def _qwen_files(ids: dict[str, int]) -> tuple[dict, dict]:
    config = {
        **_text_config(ids, "qwen2_5_vl"),
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        **_qwen_token_ids(ids),
        "vision_config": {
            "model_type": "qwen2_5_vl",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": TEXT_HIDDEN,
            "num_heads": 2,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
            "in_channels": 3,
        },
    }
    pre = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        **_PREPROCESS,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": 56 * 56,
        "max_pixels": 112 * 112,
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "resample": 3,
    }
    return config, pre


def _qwen2_files(ids: dict[str, int]) -> tuple[dict, dict]:
    """Qwen2-VL: Qwen2.5-VL's layout with the older vision tower (no window attention)."""
    config, pre = _qwen_files(ids)
    config["model_type"] = "qwen2_vl"
    config["architectures"] = ["Qwen2VLForConditionalGeneration"]
    config["vision_config"] = {
        "model_type": "qwen2_vl",
        "depth": 2,
        "embed_dim": 32,
        "hidden_size": TEXT_HIDDEN,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    return config, {**pre, "processor_class": "Qwen2VLProcessor"}


def _qwen3_files(ids: dict[str, int]) -> tuple[dict, dict]:
    """Qwen3-VL: M-RoPE, and deepstack (vision features of inner vision layers added to
    the first text layers' hidden states at the image positions)."""
    config = {
        "model_type": "qwen3_vl",
        "architectures": ["Qwen3VLForConditionalGeneration"],
        **_qwen_token_ids(ids),
        "tie_word_embeddings": False,
        "text_config": {
            **_text_config(ids, "qwen3_vl_text"),
            "head_dim": 16,
            "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3]},
        },
        "vision_config": {
            "model_type": "qwen3_vl",
            "depth": 3,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": TEXT_HIDDEN,
            "num_heads": 2,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0, 1],
            "in_channels": 3,
        },
    }
    pre = {
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "processor_class": "Qwen3VLProcessor",
        **_PREPROCESS,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 64 * 64, "longest_edge": 128 * 128},
        "min_pixels": 64 * 64,
        "max_pixels": 128 * 128,
        "patch_size": 16,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "resample": 3,
    }
    return config, pre


def _idefics_files(ids: dict[str, int], family: str) -> tuple[dict, dict]:
    """Idefics3 / SmolVLM: a picture is cut into tiles (2x2 of 56 px here) plus a global
    view, each 4 image tokens, with row/column markers between the tiles' runs."""
    text = {**_text_config(ids, "llama")}
    if family == "smolvlm":
        text["head_dim"] = 16
    config = {
        "model_type": family,
        "architectures": [
            "SmolVLMForConditionalGeneration"
            if family == "smolvlm"
            else "Idefics3ForConditionalGeneration"
        ],
        "image_token_id": ids["<image>"],
        "scale_factor": 2,
        "eos_token_id": ids[tiny_models.EOS_TOKEN],
        "text_config": text,
        "vision_config": {
            "model_type": f"{family}_vision",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
        },
    }
    cls = "SmolVLM" if family == "smolvlm" else "Idefics3"
    pre = {
        "image_processor_type": f"{cls}ImageProcessor",
        "processor_class": f"{cls}Processor",
        **_PREPROCESS,
        "do_convert_rgb": True,
        "do_pad": True,
        "do_image_splitting": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "max_image_size": {"longest_edge": 56},
        "size": {"longest_edge": 112},
        "resample": 1,
    }
    return config, pre


def _idefics2_files(ids: dict[str, int]) -> tuple[dict, dict]:
    """Idefics2: a perceiver resampler gives each picture (and each of its 4 tiles plus
    itself) 4 latents, each run between <fake_token_around_image> markers."""
    config = {
        "model_type": "idefics2",
        "architectures": ["Idefics2ForConditionalGeneration"],
        "image_token_id": ids["<image>"],
        "eos_token_id": ids[tiny_models.EOS_TOKEN],
        "text_config": _text_config(ids, "mistral"),
        "vision_config": {
            "model_type": "idefics2",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
        },
        "perceiver_config": {
            "model_type": "idefics2",
            "resampler_depth": 1,
            "resampler_head_dim": 16,
            "resampler_n_heads": 2,
            "resampler_n_latents": 4,
            "num_key_value_heads": 1,
        },
    }
    pre = {
        "image_processor_type": "Idefics2ImageProcessor",
        "processor_class": "Idefics2Processor",
        **_PREPROCESS,
        "do_convert_rgb": True,
        "do_pad": True,
        "do_image_splitting": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "size": {"shortest_edge": 56, "longest_edge": 56},
        "resample": 2,
    }
    return config, pre


def _mistral3_files(ids: dict[str, int], family: str) -> tuple[dict, dict]:
    """Mistral Small 3.1 (``mistral3``: patches merged 2x2) and Pixtral (``pixtral``: one
    token a patch): a Pixtral vision tower (2D RoPE over patches), one row of image
    tokens per patch row with [IMG_BREAK] between, [IMG_END] last."""
    config = {
        "model_type": family,
        "architectures": [
            "Mistral3ForConditionalGeneration"
            if family == "mistral3"
            else "LlavaForConditionalGeneration"
        ],
        "image_token_index": ids["[IMG]"],
        "spatial_merge_size": 2 if family == "mistral3" else 1,
        "vision_feature_layer": -1,
        "eos_token_id": ids[tiny_models.EOS_TOKEN],
        "text_config": {**_text_config(ids, "mistral"), "head_dim": 16},
        "vision_config": {
            "model_type": "pixtral",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "head_dim": 16,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
            "rope_theta": 10000.0,
        },
    }
    pre = {
        "image_processor_type": "PixtralImageProcessor",
        "processor_class": "Mistral3Processor" if family == "mistral3" else "PixtralProcessor",
        **_PREPROCESS,
        "do_convert_rgb": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "patch_size": {"height": 14, "width": 14},
        "size": {"longest_edge": 56},
        "resample": 3,
    }
    return config, pre


def _llava_files(ids: dict[str, int]) -> tuple[dict, dict]:
    config = {
        "model_type": "llava",
        "architectures": ["LlavaForConditionalGeneration"],
        "image_token_index": ids["<image>"],
        "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default",
        "eos_token_id": ids[tiny_models.EOS_TOKEN],
        "text_config": _text_config(ids, "llama"),
        "vision_config": {
            "model_type": "clip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "image_size": 56,
            "patch_size": 14,
            "projection_dim": 32,
            "num_channels": 3,
            "layer_norm_eps": 1e-5,
        },
    }
    pre = {
        "image_processor_type": "CLIPImageProcessor",
        "processor_class": "LlavaProcessor",
        "crop_size": {"height": 56, "width": 56},
        "size": {"shortest_edge": 56},
        "do_center_crop": True,
        **_PREPROCESS,
        "do_convert_rgb": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "resample": 3,
    }
    return config, pre


def _gemma_files(ids: dict[str, int]) -> tuple[dict, dict]:
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "image_token_index": ids["<image_soft_token>"],
        "boi_token_index": ids["<start_of_image>"],
        "eoi_token_index": ids["<end_of_image>"],
        "mm_tokens_per_image": 4,
        "hidden_size": TEXT_HIDDEN,
        "pad_token_id": ids[tiny_models.PAD_TOKEN],
        "eos_token_id": ids[tiny_models.EOS_TOKEN],
        "text_config": {
            **_text_config(ids, "gemma3_text"),
            "head_dim": 16,
            "query_pre_attn_scalar": 16,
            # Gemma 3's own bases (as its checkpoints write them): mlx-vlm reads none of
            # rope_theta and uses these; transformers reads rope_theta for global layers.
            "rope_theta": 1_000_000.0,
            "rope_local_base_freq": 10_000.0,
            # Small windows, so prompts cross them: sliding layers read only their window.
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "mm_tokens_per_image": 4,
        },
        "vision_config": {
            "model_type": "siglip_vision_model",
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "patch_size": 14,
            "image_size": 56,
        },
    }
    pre = {
        "image_processor_type": "Gemma3ImageProcessor",
        "processor_class": "Gemma3Processor",
        "size": {"height": 56, "width": 56},
        **_PREPROCESS,
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "resample": 2,
        "image_seq_length": 4,
    }
    return config, pre


def _init(model: Any, seed: int, gemma: bool = False) -> dict[str, mx.array]:
    """Deterministic weights; Gemma's RMSNorms scale by (1 + w) and its embeddings are
    multiplied by sqrt(hidden), so theirs are centred and scaled down to match."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        shape = tuple(p.shape)
        one_plus = gemma and not name.startswith("vision_tower")
        if len(shape) == 1 and ("norm" in name or name.endswith("_ln.weight")):
            w = (0.0 if one_plus else 1.0) + 0.1 * rng.standard_normal(shape)
            if one_plus and name.endswith(
                ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
            ):
                w = w + 3.0  # Gemma's sublayer outputs get their gain here
        elif len(shape) == 1:
            w = 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name or "embedding" in name:
            scale = TEXT_HIDDEN**-0.5 if one_plus and "embed_tokens" in name else 1.0
            w = scale * rng.standard_normal(shape)
        else:
            fan_in = int(np.prod(shape[1:]))
            w = rng.standard_normal(shape) / np.sqrt(fan_in)
            if "deepstack_merger_list" in name and "linear_fc2" in name:
                w = 4.0 * w  # strong enough that a model without deepstack answers otherwise
        out[name] = mx.array(w.astype(np.float32))
    return out


def build_tiny_vlm(family: str, dest: Path, *, seed: int = 0) -> Path:
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tiny_models.ensure_tokenizer(dest)
    if family == "qwen2_5_vl":
        ids = add_tokens(dest, _QWEN_TOKENS, QWEN_TEMPLATE)
        config, pre = _qwen_files(ids)
    elif family == "qwen2_vl":
        ids = add_tokens(dest, _QWEN_TOKENS, QWEN_TEMPLATE)
        config, pre = _qwen2_files(ids)
    elif family == "qwen3_vl":
        ids = add_tokens(dest, _QWEN_TOKENS, QWEN_TEMPLATE)
        config, pre = _qwen3_files(ids)
    elif family in ("idefics3", "smolvlm"):
        ids = add_tokens(dest, _IDEFICS_TOKENS, _IDEFICS_TEMPLATE)
        config, pre = _idefics_files(ids, family)
        (dest / "processor_config.json").write_text(
            json.dumps({"processor_class": pre["processor_class"], "image_seq_len": 4})
        )
    elif family == "idefics2":
        ids = add_tokens(dest, _IDEFICS_TOKENS, _IDEFICS_TEMPLATE)
        config, pre = _idefics2_files(ids)
        (dest / "processor_config.json").write_text(
            json.dumps({"processor_class": "Idefics2Processor", "image_seq_len": 4})
        )
    elif family in ("mistral3", "pixtral"):
        ids = add_tokens(dest, _MISTRAL_TOKENS, _MISTRAL_TEMPLATE)
        config, pre = _mistral3_files(ids, family)
        (dest / "processor_config.json").write_text(
            json.dumps(
                {
                    "processor_class": pre["processor_class"],
                    "patch_size": 14,
                    "spatial_merge_size": config["spatial_merge_size"],
                    "image_token": "[IMG]",
                    "image_break_token": "[IMG_BREAK]",
                    "image_end_token": "[IMG_END]",
                }
            )
        )
    elif family == "llava":
        ids = add_tokens(dest, _LLAVA_TOKENS, _LLAVA_TEMPLATE)
        config, pre = _llava_files(ids)
        (dest / "processor_config.json").write_text(
            json.dumps(
                {
                    "processor_class": "LlavaProcessor",
                    "patch_size": 14,
                    "vision_feature_select_strategy": "default",
                    "num_additional_image_tokens": 1,
                    "image_token": "<image>",
                }
            )
        )
    elif family == "gemma3":
        ids = add_tokens(dest, _GEMMA_TOKENS, _GEMMA_TEMPLATE)
        config, pre = _gemma_files(ids)
        cfg = json.loads((dest / "tokenizer_config.json").read_text())
        cfg["extra_special_tokens"] = {
            "image_token": "<image_soft_token>",
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
        }
        (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
        (dest / "processor_config.json").write_text(
            json.dumps({"processor_class": "Gemma3Processor", "image_seq_length": 4})
        )
    else:
        raise ValueError(family)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    (dest / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ids[tiny_models.EOS_TOKEN], "bos_token_id": None})
    )
    cfg = json.loads(json.dumps(config))
    module, _ = get_model_and_args(cfg)
    cfg.setdefault("text_config", {})
    mc = module.ModelConfig.from_dict(cfg)
    parts = ["text", "vision", *(["perceiver"] if "perceiver_config" in cfg else [])]
    mc = update_module_configs(mc, module, cfg, parts)
    model = module.Model(mc)
    weights = _init(model, seed, gemma=family == "gemma3")
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dest


_lock = threading.Lock()
_built: dict[tuple[str, int, str], Path] = {}


def get_tiny_vlm(family: str, root: Path, *, seed: int = 0) -> Path:
    key = (family, seed, str(root))
    with _lock:
        if key not in _built:
            _built[key] = build_tiny_vlm(family, Path(root) / f"vlm-{family}-s{seed}", seed=seed)
        return _built[key]
