"""A tiny random-weight Gemma 4 with an audio tower, built at test time from mlx-vlm's
classes (see tiny_vlms for the layout): kv-shared layers, per-layer inputs, sliding and
full attention, a two-layer conformer audio encoder. 1 s of 16 kHz audio gives 25 audio
tokens (40 ms each)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from . import tiny_models, tiny_vlms

FAMILY = "gemma4"
AUDIO_TOKEN = "<audio_soft>"
_TOKENS = ("<boi>", "<eoi>", "<image_soft>", "<boa>", "<eoa>", AUDIO_TOKEN)
# ChatML with Gemma 4's placeholders: the audio token (the processor expands it) and the
# image token.
_TEMPLATE = tiny_vlms.QWEN_TEMPLATE.replace(
    "'<|vision_start|><|image_pad|><|vision_end|>'", "'<image_soft>'"
).replace(
    "{%- elif part['type'] == 'video' -%}",
    "{%- elif part['type'] == 'audio' or part['type'] == 'input_audio' -%}"
    "{{- '" + AUDIO_TOKEN + "' -}}{%- elif part['type'] == 'video' -%}",
)
HIDDEN = 64


def _config(ids: dict[str, int]) -> dict:
    return {
        "model_type": FAMILY,
        "architectures": ["Gemma4ForConditionalGeneration"],
        "image_token_id": ids["<image_soft>"],
        "audio_token_id": ids[AUDIO_TOKEN],
        "boi_token_id": ids["<boi>"],
        "eoi_token_id": ids["<eoi>"],
        "boa_token_id": ids["<boa>"],
        "eoa_token_id": ids["<eoa>"],
        "hidden_size": HIDDEN,
        "pad_token_id": ids[tiny_models.PAD_TOKEN],
        "eos_token_id": ids[tiny_models.EOS_TOKEN],
        "vocab_size": ids["vocab"],
        "text_config": {
            "model_type": "gemma4_text",
            "hidden_size": HIDDEN,
            "num_hidden_layers": 4,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "head_dim": 16,
            "global_head_dim": 16,
            "num_key_value_heads": 2,
            "vocab_size": ids["vocab"],
            "vocab_size_per_layer_input": ids["vocab"],
            "num_kv_shared_layers": 2,
            "hidden_size_per_layer_input": 8,
            # Small windows, so prompts cross them.
            "sliding_window": 8,
            "sliding_window_pattern": 2,
            "max_position_embeddings": 2048,
            "pad_token_id": ids[tiny_models.PAD_TOKEN],
        },
        "vision_config": {
            "model_type": "gemma4_vision",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "global_head_dim": 16,
            "patch_size": 16,
            "position_embedding_size": 64,
            "pooling_kernel_size": 3,
            "default_output_length": 4,
        },
        "audio_config": {
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "subsampling_conv_channels": [16, 8],
            "output_proj_dims": 48,
        },
        "audio_soft_tokens_per_image": 750,
        "audio_ms_per_token": 40,
    }


def _init(model: Any, seed: int) -> dict[str, mx.array]:
    """Deterministic weights. Gemma 4's RMSNorms scale by their weight as it is (not
    1 + w, as Gemma 3's), its layers end in a `layer_scalar` and token embeddings are
    multiplied by sqrt(hidden): norms and scalars near 1, embeddings scaled down."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        shape = tuple(p.shape)
        if name.endswith("layer_scalar"):
            w = np.ones(shape)
        elif len(shape) == 1 and "norm" in name:
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            w = 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name:
            w = HIDDEN**-0.5 * rng.standard_normal(shape)
        else:
            fan_in = int(np.prod(shape[1:]))
            w = rng.standard_normal(shape) / np.sqrt(fan_in)
        out[name] = mx.array(w.astype(np.float32))
    return out


def build_tiny_omni(dest: Path, *, seed: int = 0) -> Path:
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tiny_models.ensure_tokenizer(dest)
    ids = tiny_vlms.add_tokens(dest, _TOKENS, _TEMPLATE)
    cfg = json.loads((dest / "tokenizer_config.json").read_text())
    cfg["extra_special_tokens"] = {
        "image_token": "<image_soft>",
        "boi_token": "<boi>",
        "eoi_token": "<eoi>",
        "audio_token": AUDIO_TOKEN,
        "boa_token": "<boa>",
        "eoa_token": "<eoa>",
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    config = _config(ids)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    (dest / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "Gemma4Processor",
                "audio_seq_length": 750,
                "audio_ms_per_token": 40,
                "image_processor": {"patch_size": 16, "max_soft_tokens": 4},
            }
        )
    )
    (dest / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ids[tiny_models.EOS_TOKEN], "bos_token_id": None})
    )
    c = json.loads(json.dumps(config))
    module, _ = get_model_and_args(c)
    mc = module.ModelConfig.from_dict(c)
    mc = update_module_configs(mc, module, c, ["text", "vision", "audio"])
    weights = _init(module.Model(mc), seed)
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dest


def clip(seed: int, seconds: float = 0.5, rate: int = 16000) -> np.ndarray:
    """A deterministic noisy chirp, mono float32 in [-1, 1]."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f = 200 + 150 * seed
    x = 0.5 * np.sin(2 * np.pi * f * t * (1 + t)) + 0.1 * rng.standard_normal(t.size)
    return x.astype(np.float32)


_lock = threading.Lock()
_built: dict[tuple[int, str], Path] = {}


def get_tiny_omni(root: Path, *, seed: int = 0) -> Path:
    key = (seed, str(root))
    with _lock:
        if key not in _built:
            _built[key] = build_tiny_omni(Path(root) / f"omni-{FAMILY}-s{seed}", seed=seed)
        return _built[key]
