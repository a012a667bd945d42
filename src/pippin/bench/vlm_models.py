"""A random-weight Qwen2.5-VL for the vision benchmark (`bench/vision_bench.py`).

Qwen's real vocabulary (Qwen2.5-VL's is Qwen3's: 151,643 byte-level ids, the vision tokens
among the added ones; `pippin.bench.models.qwen3_tokenizer`), Qwen2.5-VL's processor with
its own pixel bound (a 1024x768 picture is about 1,000 image tokens) and a chat template
that places image parts. Weights from mlx-vlm's own classes, seeded: unit norms, matrices
scaled by their fan-in, so activations stay in range at any depth. Shapes:

- `tiny`: two text layers of width 64 and a two-block vision tower of width 32, float32
  (for the CPU);
- `qwen2.5-vl-3b`: Qwen2.5-VL-3B-Instruct's configuration, bfloat16 (for the GPU).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pippin.bench.models import QWEN3_EOS, qwen3_tokenizer
from pippin.bench.tiktoken_json import QWEN3_FIRST_SPECIAL, QWEN3_SPECIAL

# Qwen2.5-VL's processor bound: a 1024x768 picture stays near its size.
QWEN_MAX_PIXELS = 12845056
VOCAB = 151936  # Qwen2.5-VL's embedding rows (the tokenizer's ids, padded)
IDS = {  # among Qwen's added tokens
    f"{name}_token_id": QWEN3_FIRST_SPECIAL + QWEN3_SPECIAL.index(token)
    for name, token in (
        ("vision_start", "<|vision_start|>"),
        ("vision_end", "<|vision_end|>"),
        ("image", "<|image_pad|>"),
        ("video", "<|video_pad|>"),
    )
}

# Qwen2-VL's template for image parts (and plain text), ChatML around it.
TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'image' or part['type'] == 'image_url' -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_VISION = {
    "model_type": "qwen2_5_vl",
    "patch_size": 14,
    "spatial_patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
}
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "torch_dtype": "float32",
        "vision_config": {
            **_VISION,
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "out_hidden_size": 64,
            "num_heads": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1],
        },
    },
    # Qwen2.5-VL-3B-Instruct's config.json (hidden 2048, 36 layers, GQA 16/2, a 32-block
    # vision tower of width 1280).
    "qwen2.5-vl-3b": {
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "max_position_embeddings": 128000,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
        "torch_dtype": "bfloat16",
        "vision_config": {
            **_VISION,
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "out_hidden_size": 2048,
            "num_heads": 16,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
        },
    },
}


def build_qwen25_vl(dest: Path, shape: str = "tiny", seed: int = 0) -> Path:
    """The folder `dest` with a random Qwen2.5-VL of `shape` (built unless it is there)."""
    if (dest / "config.json").exists():
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    qwen3_tokenizer(dest)
    tok_cfg = json.loads((dest / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = TEMPLATE
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    (dest / "chat_template.jinja").write_text(TEMPLATE)
    pre = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
        "min_pixels": 56 * 56,
        "max_pixels": QWEN_MAX_PIXELS,
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "resample": 3,
    }
    (dest / "preprocessor_config.json").write_text(json.dumps(pre, indent=2))
    config = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        **SHAPES[shape],
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB,
        # Untied (the 3B's real one is tied; a step reads the same bytes either way): a
        # random tied head repeats the prompt's last token, a newline, which streams no text.
        "tie_word_embeddings": False,
        "eos_token_id": QWEN3_EOS[0],
        **IDS,
    }
    (dest / "generation_config.json").write_text(json.dumps({"eos_token_id": QWEN3_EOS}))
    _write_weights(dest, config, seed)
    # Last: its presence marks a finished build.
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def _write_weights(dest: Path, config: dict[str, Any], seed: int) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    cfg = json.loads(json.dumps(config))
    cfg.setdefault("text_config", {})
    arch, _ = get_model_and_args(cfg)
    mc = update_module_configs(arch.ModelConfig.from_dict(cfg), arch, cfg, ["text", "vision"])
    model = arch.Model(mc)
    dtype = getattr(mx, config["torch_dtype"])
    mx.random.seed(seed)
    params = {}
    for k, v in tree_flatten(model.parameters()):
        if v.ndim == 1:
            w = mx.ones(v.shape) if "norm" in k else mx.zeros(v.shape)
        else:
            fan_in = 1
            for d in v.shape[1:]:
                fan_in *= d
            w = mx.random.normal(v.shape) * (1.0 if "embed" in k else fan_in**-0.5)
        params[k] = w.astype(dtype)
        mx.eval(params[k])
    mx.save_safetensors(str(dest / "model.safetensors"), params, metadata={"format": "mlx"})
