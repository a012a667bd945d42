"""Random LoRA adapters for tiny models, in mlx-lm's and PEFT's formats, and mlx-lm's
own generation with one applied (fused, as `mlx_lm.fuse` does, or as LoRA layers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.tuner.utils import load_adapters

ALL_KEYS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def _dims(layer: nn.Module) -> tuple[int, int]:
    out, inp = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        inp = inp * 32 // layer.bits
    return inp, out


def random_lora(
    model: nn.Module, *, rank: int, seed: int, keys: tuple[str, ...] = ALL_KEYS
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """A (in, r) and B (r, out) per targeted module of every layer, big enough that the
    adapter changes the model's greedy tokens."""
    rng = np.random.default_rng(seed)
    modules = dict(model.named_modules())
    out = {}
    n = len(model.layers)
    for i in range(n):
        for k in keys:
            path = f"model.layers.{i}.{k}"
            inp, outp = _dims(modules[path])
            a = rng.normal(0, 1 / np.sqrt(inp), (inp, rank)).astype(np.float32)
            b = rng.normal(0, 0.5, (rank, outp)).astype(np.float32)
            out[path] = (a, b)
    return out


def write_mlx(
    dest: Path, mats: dict[str, tuple[np.ndarray, np.ndarray]], scale: float, num_layers: int
) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    rank = next(iter(mats.values()))[0].shape[1]
    keys = sorted({p.split(".", 3)[3] for p in mats})
    config = {
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": keys},
    }
    (dest / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for path, (a, b) in mats.items():
        tensors[f"{path}.lora_a"] = mx.array(a)
        tensors[f"{path}.lora_b"] = mx.array(b)
    mx.save_safetensors(str(dest / "adapters.safetensors"), tensors)
    return dest


def write_peft(
    dest: Path,
    mats: dict[str, tuple[np.ndarray, np.ndarray]],
    alpha: float,
    rslora: bool = False,
    **extra: Any,
) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    rank = next(iter(mats.values()))[0].shape[1]
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": sorted({p.rsplit(".", 1)[1] for p in mats}),
        "use_rslora": rslora,
        "use_dora": False,
        "modules_to_save": None,
        "bias": "none",
        **extra,
    }
    (dest / "adapter_config.json").write_text(json.dumps(config))
    tensors = {}
    for path, (a, b) in mats.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = mx.array(a.T.copy())
        tensors[f"base_model.model.{path}.lora_B.weight"] = mx.array(b.T.copy())
    mx.save_safetensors(str(dest / "adapter_model.safetensors"), tensors)
    return dest


def with_adapter(model: nn.Module, adapter: Path, fuse: bool = True) -> nn.Module:
    """`model` with mlx-lm's LoRA layers from an mlx-lm adapter folder, fused into the
    weights as `mlx_lm.fuse` does (`fuse`), else left as layers (`--adapter-path`)."""
    load_adapters(model, str(adapter))
    if fuse:
        fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
        model.update_modules(tree_unflatten(fused))
    mx.eval(model.parameters())
    return model


def reference(
    model: nn.Module, prompt: list[int], n: int
) -> tuple[list[int], list[float], list[float]]:
    """mlx-lm's greedy tokens, their logprobs, and the gap between the top two logprobs."""
    tokens, lps, gaps = [], [], []
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    for tok, lp in steps:
        top2 = mx.sort(lp)[-2:].tolist()
        tokens.append(int(tok))
        lps.append(lp[int(tok)].item())
        gaps.append(top2[1] - top2[0])
    return tokens, lps, gaps
