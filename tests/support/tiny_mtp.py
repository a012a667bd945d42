"""Tiny checkpoints with multi-token-prediction (MTP) layers, in the Hugging Face layout
that real ones ship and mlx-lm drops on load, in a second shard (listed in
`model.safetensors.index.json`, as sharded checkpoints are): a `tiny_models` qwen3_next
folder with `mtp.*` tensors, and a deepseek_v3 one with its MTP layer as layer N."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .tiny_models import _init_weights, _to_hf_layout, get_tiny_model

MAIN = "model-00001-of-00002.safetensors"
MTP = "model-00002-of-00002.safetensors"


def qwen3_next_mtp_tensors(config: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """One MTP layer of a qwen3_next `config` (a full-attention decoder layer with its
    MoE, fc, the two pre-fc norms and the final norm), as the checkpoint stores it:
    experts one by one, zero-centred norms as w for 1 + w."""
    from mlx_lm.models import qwen3_next

    args = qwen3_next.ModelArgs.from_dict(config)
    idx = args.full_attention_interval - 1
    layer = qwen3_next.Qwen3NextDecoderLayer(args, idx)
    weights = {f"model.layers.{idx}.{k}": v for k, v in _init_weights(layer, config, seed).items()}
    out = {
        "mtp.layers.0." + k.split(".", 3)[3]: v
        for k, v in _to_hf_layout("qwen3_next", weights, config).items()
    }
    rng = np.random.default_rng(seed + 1000)
    H = config["hidden_size"]
    out["mtp.fc.weight"] = (rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H)).astype(np.float32)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = (0.1 * rng.standard_normal(H)).astype(np.float32)
    return out


def build_tiny_mtp(dest: Path, *, seed: int = 0, mtp: bool = True, **overrides: Any) -> Path:
    """A copy of the tiny qwen3_next (`overrides` as `tiny_models`') in `dest`, its
    weights in two shards with an index, the second holding `mtp.*` tensors (none
    with `mtp` False: the shard layout alone, as a conversion without them)."""
    src = get_tiny_model("qwen3_next", seed=seed, **overrides)
    shutil.copytree(src, dest)
    (dest / "model.safetensors").rename(dest / MAIN)
    config = json.loads((dest / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    weight_map = {k: MAIN for k in mx.load(str(dest / MAIN))}
    if mtp:
        tensors = qwen3_next_mtp_tensors(config, seed)
        mx.save_safetensors(
            str(dest / MTP),
            {k: mx.array(v) for k, v in sorted(tensors.items())},
            metadata={"format": "pt"},
        )
        weight_map.update((k, MTP) for k in tensors)
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dest


def deepseek_v3_config(vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict[str, Any]:
    """A tiny DeepSeek-V3: MLA attention with both LoRA ranks, a dense first layer then
    MoE (sigmoid routing, a shared expert), one MTP layer."""
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 32,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "v_head_dim": 32,
        "qk_nope_head_dim": 32,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
        "torch_dtype": "float32",
    }


def glm4_moe_config(vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict[str, Any]:
    """A tiny GLM-4.5 (glm4_moe): GQA attention with q/k norms and partial RoPE, a dense
    first layer then MoE (sigmoid routing, a shared expert), one MTP layer."""
    return {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "use_qk_norm": True,
        "partial_rotary_factor": 0.5,
        "n_shared_experts": 1,
        "n_routed_experts": 4,
        "routed_scaling_factor": 2.5,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "first_k_dense_replace": 1,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": None,
        "torch_dtype": "float32",
    }


NEXTN = {"deepseek_v3": deepseek_v3_config, "glm4_moe": glm4_moe_config}


def nextn_layer_class(family: str) -> Any:
    """mlx-lm's decoder layer class of a family with DeepSeek-V3's MTP layout."""
    from mlx_lm.models import deepseek_v3, glm4_moe

    return deepseek_v3.DeepseekV3DecoderLayer if family == "deepseek_v3" else glm4_moe.DecoderLayer


def hf_layer(weights: dict[str, np.ndarray], config: dict[str, Any]) -> dict:
    """A deepseek_v3 or glm4_moe decoder layer's arrays (mlx-lm's names, relative to the
    layer) as the checkpoint stores them: experts one by one, DeepSeek's `kv_b_proj` whole
    (mlx-lm splits it into `embed_q` and `unembed_out`)."""
    out: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if ".switch_mlp." in name:
            prefix, proj = name.split(".switch_mlp.")
            for e in range(w.shape[0]):
                out[f"{prefix}.experts.{e}.{proj}"] = np.ascontiguousarray(w[e])
        elif name.endswith(("embed_q.weight", "unembed_out.weight")):
            continue
        else:
            out[name] = w
    if "self_attn.embed_q.weight" not in weights:
        return out
    wk = weights["self_attn.embed_q.weight"]  # [heads, kv_lora, nope]
    wv = weights["self_attn.unembed_out.weight"]  # [heads, v, kv_lora]
    kv_b = np.concatenate([np.swapaxes(wk, 1, 2), wv], axis=1)
    out["self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, config["kv_lora_rank"])
    return out


def build_tiny_nextn_mtp(dest: Path, family: str = "deepseek_v3", *, seed: int = 0) -> Path:
    """A tiny deepseek_v3 or glm4_moe folder whose MTP layer is `model.layers.{N}` in the
    checkpoint layout (its decoder layer, `eh_proj`, `enorm`, `hnorm`, `shared_head.norm`,
    and the embedding and head copies they ship); the rest in mlx-lm's layout. mlx-lm
    0.32's deepseek_v3 drops only a layer 61, so that one loads with `strict=False`.
    Also writes `mtp_reference.safetensors`: the MTP layer's arrays as mlx-lm names them."""
    from mlx_lm.utils import _get_classes

    from .tiny_models import EOS_TOKEN, PAD_TOKEN, _token_ids, ensure_tokenizer

    dest.mkdir(parents=True)
    ensure_tokenizer(dest)
    vocab, ids = _token_ids(dest)
    config = NEXTN[family](vocab, ids[EOS_TOKEN], ids[PAD_TOKEN])
    model_class, args_class = _get_classes(config)
    args = args_class.from_dict(config)
    weights = _init_weights(model_class(args), config, seed)
    N = config["num_hidden_layers"]
    layer = nextn_layer_class(family)(args, N)
    own = _init_weights(layer, config, seed + 1)
    rng = np.random.default_rng(seed + 1000)
    H = config["hidden_size"]
    extra = {
        "eh_proj.weight": rng.standard_normal((H, 2 * H)) / np.sqrt(2 * H),
        "embed_tokens.weight": weights["model.embed_tokens.weight"],
        "shared_head.head.weight": weights["lm_head.weight"],
    }
    for name in ("enorm", "hnorm", "shared_head.norm"):
        extra[f"{name}.weight"] = 1.0 + 0.1 * rng.standard_normal(H)
    reference = {**own, **extra}
    mx.save_safetensors(
        str(dest / "mtp_reference.safetensors"),
        {k: mx.array(np.asarray(v, np.float32)) for k, v in reference.items()},
    )
    mtp = {f"model.layers.{N}.{k}": v for k, v in {**hf_layer(own, config), **extra}.items()}
    for name, tensors in ((MAIN, weights), (MTP, mtp)):
        mx.save_safetensors(
            str(dest / name),
            {k: mx.array(np.asarray(v, np.float32)) for k, v in sorted(tensors.items())},
            metadata={"format": "pt"},
        )
    weight_map = {k: MAIN for k in weights} | {k: MTP for k in mtp}
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    generation = {"eos_token_id": ids[EOS_TOKEN], "pad_token_id": ids[PAD_TOKEN]}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return dest
