"""Tiny random-weight models of every hybrid (attention + recurrent) and recurrent family
that mlx-lm 0.32 ships, built at test time.

Each folder is laid out like an mlx-community conversion (``config.json`` with the keys of
the real checkpoints, ``model.safetensors`` in float32 under mlx-lm's own parameter names,
``generation_config.json`` and tiny_models' trained tokenizer), so ``mlx_lm.utils.load``
and pippin's loader both read it; every family's ``sanitize`` passes such weights through
unchanged. The real tokenizers (65k-200k tokens) are not installable offline, and their
embeddings alone would be tens of MB, so all families share the tiny one.

Every model has 2-4 layers of hidden size 64 (a few hundred KB) and mixes both layer
kinds: each hybrid has at least one attention layer and one recurrent layer (mamba and
mamba2 are recurrent only). Weights are drawn as in ``tiny_models`` (numpy, from a seed),
with the recurrent layers' decay set up as the reference inits do, so their state carries
over many tokens: a mistake in carrying it (across chunks, a preemption or a prefix hit)
changes the output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from mlx.utils import tree_flatten

from . import tiny_models
from .tiny_models import EOS_TOKEN, PAD_TOKEN, TinyModelCache

FAMILIES: tuple[str, ...] = (
    "qwen3_next",
    "qwen3_5",
    "qwen3_5_moe",
    "nemotron_h",
    "granitemoehybrid",
    "falcon_h1",
    "jamba",
    "lfm2",
    "lfm2_moe",
    "kimi_linear",
    "mamba",
    "mamba2",
)

_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "bos_token_id": None,
    "torch_dtype": "float32",
}


def _qwen3_5(moe: bool) -> dict[str, Any]:
    # Real Qwen3.5 checkpoints nest the text model's keys under text_config.
    text: dict[str, Any] = {
        "model_type": "qwen3_5_moe_text" if moe else "qwen3_5_text",
        **_COMMON,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        # Gated delta, full, gated delta, full.
        "full_attention_interval": 2,
        "rms_norm_eps": 1e-6,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "mrope_section": [2, 1, 1],
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
        },
    }
    if moe:
        text |= {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "norm_topk_prob": True,
        }
    name = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    return {
        "architectures": [name],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "tie_word_embeddings": False,
        "text_config": text,
    }


def _config(family: str) -> dict[str, Any]:
    """The config.json of a tiny ``family`` model, without the token ids."""
    if family in ("qwen3_5", "qwen3_5_moe"):
        return _qwen3_5(family == "qwen3_5_moe")
    if family == "nemotron_h":
        return {
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            **_COMMON,
            "intermediate_size": 128,
            # Mamba-2, attention, Mamba-2, MoE (the MoE and MLP layers keep no cache).
            "hybrid_override_pattern": "M*ME",
            "attention_bias": False,
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "conv_kernel": 4,
            "n_groups": 2,
            "mlp_bias": False,
            "layer_norm_epsilon": 1e-5,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_limit": [0.0, 100.0],
            "moe_intermediate_size": 32,
            "moe_shared_expert_intermediate_size": 32,
            "n_routed_experts": 4,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 1.0,
            "tie_word_embeddings": False,
        }
    if family == "granitemoehybrid":
        return {
            "architectures": ["GraniteMoeHybridForCausalLM"],
            "model_type": "granitemoehybrid",
            **_COMMON,
            "intermediate_size": 32,
            "num_hidden_layers": 4,
            "layer_types": ["mamba", "mamba", "attention", "mamba"],
            "attention_bias": False,
            # Granite's multipliers, of sizes that keep a tiny model's activations sane.
            "embedding_multiplier": 2.0,
            "attention_multiplier": 0.25,
            "logits_scaling": 0.5,
            "residual_multiplier": 0.5,
            "rms_norm_eps": 1e-5,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "shared_intermediate_size": 64,
            "mamba_n_heads": 4,
            "mamba_d_head": 16,
            "mamba_proj_bias": False,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 1,  # transformers checks heads x head size = expand x hidden
            "mamba_n_groups": 1,
            "mamba_conv_bias": True,
            # Granite 4.0-H runs without RoPE; RoPE here also checks the attention
            # layers' positions after chunks, preemption and prefix hits.
            "position_embedding_type": "rope",
            "rope_theta": 10000.0,
            "tie_word_embeddings": True,
        }
    if family == "falcon_h1":
        # Every layer runs attention and Mamba-2 side by side (a CacheList of both).
        return {
            "architectures": ["FalconH1ForCausalLM"],
            "model_type": "falcon_h1",
            **_COMMON,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "mamba_d_conv": 4,
            "mamba_d_head": 16,
            "mamba_d_ssm": 64,
            "mamba_d_state": 16,
            "mamba_expand": 1,
            "mamba_n_groups": 1,
            "mamba_n_heads": 4,
            "mamba_chunk_size": 16,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "tie_word_embeddings": False,
        }
    if family == "jamba":
        return {
            "architectures": ["JambaForCausalLM"],
            "model_type": "jamba",
            **_COMMON,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            # Mamba, Mamba, attention, Mamba; MoE feed-forward in layers 1 and 3.
            "attn_layer_period": 4,
            "attn_layer_offset": 2,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "mamba_d_conv": 4,
            "mamba_d_state": 16,
            "mamba_expand": 2,
            "mamba_dt_rank": "auto",
            "mamba_proj_bias": False,
            "mamba_conv_bias": True,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        }
    if family in ("lfm2", "lfm2_moe"):
        config: dict[str, Any] = {
            "architectures": ["Lfm2ForCausalLM"],
            "model_type": "lfm2",
            **_COMMON,
            "num_hidden_layers": 4,
            "layer_types": ["conv", "full_attention", "conv", "conv"],
            "norm_eps": 1e-5,
            "conv_bias": False,
            "conv_L_cache": 3,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
        }
        config.pop("head_dim")  # LFM2 derives it from hidden_size / heads
        if family == "lfm2":
            return config | {
                "block_dim": 64,
                "block_ff_dim": 128,
                "block_multiple_of": 32,
                "block_ffn_dim_multiplier": 1.0,
                "block_auto_adjust_ff_dim": True,
            }
        return config | {
            "architectures": ["Lfm2MoeForCausalLM"],
            "model_type": "lfm2_moe",
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "use_expert_bias": True,
            "num_dense_layers": 1,
            "tie_word_embeddings": False,
        }
    if family == "kimi_linear":
        return {
            "architectures": ["KimiLinearForCausalLM"],
            "model_type": "kimi_linear",
            **_COMMON,
            "num_key_value_heads": 4,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "rope_theta": 10000.0,
            "rms_norm_eps": 1e-5,
            "model_max_length": 4096,
            # Kimi Delta Attention in layers 1-3 (1-based), MLA in layer 4, as in the
            # real model's 3:1.
            "linear_attn_config": {
                "kda_layers": [1, 2, 3],
                "full_attn_layers": [4],
                "num_heads": 4,
                "head_dim": 16,
                "short_conv_kernel_size": 4,
            },
            "kv_lora_rank": 32,
            "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 8,
            "v_head_dim": 16,
            "mla_use_nope": True,
            "num_experts": 4,
            "num_experts_per_token": 2,
            "num_shared_experts": 1,
            "moe_intermediate_size": 32,
            "moe_router_activation_func": "sigmoid",
            "moe_renormalize": True,
            "routed_scaling_factor": 1.0,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "num_expert_group": 1,
            "topk_group": 1,
            "tie_word_embeddings": False,
        }
    if family == "mamba":
        return {
            "architectures": ["MambaForCausalLM"],
            "model_type": "mamba",
            "hidden_size": 64,
            "intermediate_size": 128,
            "state_size": 16,
            "num_hidden_layers": 2,
            "conv_kernel": 4,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_rank": "auto",
            "tie_word_embeddings": True,
            "bos_token_id": None,
            "torch_dtype": "float32",
        }
    if family == "mamba2":
        return {
            "architectures": ["Mamba2ForCausalLM"],
            "model_type": "mamba2",
            "hidden_size": 64,
            "num_heads": 8,
            "head_dim": 16,
            "intermediate_size": 128,
            "state_size": 16,
            "num_hidden_layers": 2,
            "layer_norm_epsilon": 1e-5,
            "conv_kernel": 4,
            "n_groups": 1,
            "use_bias": False,
            "use_conv_bias": True,
            "time_step_limit": [0.0, 100.0],
            "time_step_rank": "auto",
            "tie_word_embeddings": False,
            "bos_token_id": None,
            "torch_dtype": "float32",
        }
    raise ValueError(f"unknown hybrid family {family!r}; expected one of {FAMILIES}")


# Time steps as the reference Mamba/gated-delta inits draw them, log-uniform in
# [1e-3, 1e-1], stored through softplus's inverse; with decay rates A in [1, 16] the state
# then keeps a good share of itself from token to token (a bias of 1, as tiny_models uses,
# lets the state forget within a token or two).
_DT_MIN, _DT_MAX = 1e-3, 1e-1
_STATE_DECAY = ("A_log", "dt_bias", "dt_proj.bias")


def _init_weights(model: Any, text_config: dict, seed: int) -> dict[str, np.ndarray]:
    """Deterministic random weights for every parameter of ``model`` (MLX names), by
    tiny_models' rules, with the recurrent layers' decay and skip terms of those layers."""
    rng = np.random.default_rng(seed)
    hidden = text_config["hidden_size"]
    tied = bool(text_config.get("tie_word_embeddings"))
    out: dict[str, np.ndarray] = {}
    for name, param in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        shape = tuple(param.shape)
        final = ".layers." not in name
        if name.endswith("A_log"):
            w = np.log(rng.uniform(1.0, 16.0, size=shape))
        elif name.endswith(("dt_bias", "dt_proj.bias")):
            dt = np.exp(rng.uniform(np.log(_DT_MIN), np.log(_DT_MAX), size=shape))
            w = dt + np.log(-np.expm1(-dt))  # softplus^-1
        elif name.endswith(".D"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)  # the skip term, 1 in the reference
        elif len(shape) == 1 and "norm" in name:
            scale = 1.0
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                scale = tiny_models._QK_NORM_SCALE
            elif final and tied:
                # The final norm restores the logits' scale that small tied embeddings lose.
                scale = tiny_models._LOGIT_STD / (tiny_models._EMBED_STD * np.sqrt(hidden))
            w = scale * (1.0 + 0.1 * rng.standard_normal(shape))
        elif len(shape) == 1 or name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)
        elif "embed_tokens" in name or "embeddings" in name:
            w = tiny_models._EMBED_STD * rng.standard_normal(shape)
        elif "lm_head" in name:
            w = rng.standard_normal(shape) * (tiny_models._LOGIT_STD / np.sqrt(hidden))
        elif "conv" in name and len(shape) == 3 and shape[-1] == 1:
            # Depthwise Conv1d, MLX layout (channels, kernel, 1): fan-in is the kernel.
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        elif name.endswith(".weight"):
            gain = tiny_models._OUT_GAIN if name.endswith(tiny_models._OUT_PROJS) else 1.0
            w = gain * rng.standard_normal(shape) / np.sqrt(shape[-1])
        else:
            raise ValueError(f"no init rule for parameter {name} {shape}")
        out[name] = w.astype(np.float32)
    return out


def build_tiny_hybrid(family: str, dest: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Build a tiny random ``family`` model in ``dest`` and return ``dest``.

    ``overrides`` replace keys of the config (of ``text_config`` for Qwen3.5)."""
    if family == "qwen3_next":  # tiny_models has it: three gated-delta layers, one full
        return tiny_models.build_tiny_model(family, dest, seed=seed, **overrides)
    from mlx_lm.utils import _get_classes

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tiny_models.ensure_tokenizer(dest)
    vocab_size, ids = tiny_models._token_ids(dest)
    config = _config(family)
    text = config.get("text_config", config)
    text |= {"vocab_size": vocab_size, **overrides}
    config |= {"eos_token_id": ids[EOS_TOKEN], "pad_token_id": ids[PAD_TOKEN]}

    model_class, args_class = _get_classes(json.loads(json.dumps(config)))
    model = model_class(args_class.from_dict(json.loads(json.dumps(config))))
    weights = _init_weights(model, text, seed)
    if text.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)
    return tiny_models.write_checkpoint(dest, weights, config, ids, "mlx")


_caches: dict[Path, TinyModelCache] = {}


def get_tiny_hybrid(family: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Memoised :func:`build_tiny_hybrid`, under tiny_models' cache folder (the
    ``tiny_models`` fixture's, where a test set it up). Treat the folder as read-only."""
    root = tiny_models.cache_root()
    cache = _caches.setdefault(root, TinyModelCache(root, build=build_tiny_hybrid))
    return cache(family, seed=seed, **overrides)
