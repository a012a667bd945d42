"""LoRA adapter folders, read into one form whatever wrote them.

Two formats: mlx-lm's (`adapter_config.json` with `fine_tune_type`, `num_layers` and
`lora_parameters`, and `adapters.safetensors` with `<path>.lora_a` (in, r) and
`<path>.lora_b` (r, out)) and PEFT's (`adapter_config.json` with `r`, `lora_alpha`,
`target_modules`, ..., and `adapter_model.safetensors` with
`base_model.model.<path>.lora_A.weight` (r, in) and `lora_B.weight` (out, r)). Either
becomes an `Adapter`: per target module, named as in the mlx-lm model
(`model.layers.3.self_attn.q_proj`), A (in, r), B (r, out) and the scale, so that
y = base(x) + scale * (x @ A) @ B. What neither form can say exactly (DoRA, full
fine-tunes, extra trained modules, biases, embeddings) is refused with a one-line
`LoraError`.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

MLX_WEIGHTS = "adapters.safetensors"
PEFT_WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"
_PEFT_PREFIX = "base_model.model."


class LoraError(Exception):
    """An adapter that cannot be served; the message is one line."""


@dataclass(frozen=True)
class LoraWeights:
    a: mx.array  # (in, r)
    b: mx.array  # (r, out)
    scale: float

    @property
    def rank(self) -> int:
        return int(self.a.shape[1])


@dataclass(frozen=True)
class Adapter:
    path: str
    format: str  # "mlx" or "peft"
    modules: dict[str, LoraWeights]
    digest: str  # of the config and weight files: equal digests mean equal adapters

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.modules.values())


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter folder's format, config and weight file, checked without reading
    the weights (cheap: for the API side, before the engine loads it)."""

    format: str
    config: dict[str, Any]
    weights: Path


def inspect(path: str | Path) -> AdapterFiles:
    """The adapter folder at `path`, its config checked; `LoraError` if it is not one
    pippin serves."""
    folder = Path(path)
    cfg_path = folder / CONFIG
    if not cfg_path.is_file():
        raise LoraError(f"no {CONFIG} in the adapter folder {folder.name!r}")
    try:
        config = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"{CONFIG} cannot be read: {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{CONFIG} is not a JSON object")
    if (folder / PEFT_WEIGHTS).is_file() or "peft_type" in config or "lora_alpha" in config:
        _check_peft(config)
        fmt, weights = "peft", folder / PEFT_WEIGHTS
    else:
        _check_mlx(config)
        fmt, weights = "mlx", folder / MLX_WEIGHTS
    if not weights.is_file():
        raise LoraError(f"no {weights.name} in the adapter folder {folder.name!r}")
    return AdapterFiles(fmt, config, weights)


def _check_mlx(config: dict[str, Any]) -> None:
    kind = config.get("fine_tune_type", "dora" if config.get("use_dora") else "lora")
    if kind != "lora":
        raise LoraError(f"mlx-lm fine_tune_type {kind!r} is not supported (only 'lora')")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or "scale" not in params:
        raise LoraError("an mlx-lm adapter needs lora_parameters with a scale")


def _check_peft(config: dict[str, Any]) -> None:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoraError(f"PEFT type {peft_type!r} is not supported (only LORA)")
    if config.get("use_dora"):
        raise LoraError("DoRA adapters (use_dora) are not supported")
    if config.get("modules_to_save"):
        raise LoraError("adapters with modules_to_save are not supported")
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapters with bias {config['bias']!r} are not supported (only 'none')")
    if config.get("alpha_pattern"):
        raise LoraError("adapters with an alpha_pattern are not supported")
    if not config.get("r") or not config.get("lora_alpha"):
        raise LoraError("a PEFT adapter needs r and lora_alpha")


def read(path: str | Path) -> Adapter:
    """The adapter at `path` in the normalized form (A, B and scale per module)."""
    files = inspect(path)
    try:
        tensors = mx.load(str(files.weights))
    except Exception as e:  # a truncated or foreign file
        raise LoraError(f"{files.weights.name} cannot be read: {e}") from None
    assert isinstance(tensors, dict)
    if files.format == "peft":
        modules = _peft_modules(tensors, files.config)
    else:
        modules = _mlx_modules(tensors, files.config)
    if not modules:
        raise LoraError(f"{files.weights.name} holds no LoRA weights")
    h = hashlib.blake2b(digest_size=16)
    for f in (Path(path) / CONFIG, files.weights):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return Adapter(str(path), files.format, modules, h.hexdigest())


def _pairs(tensors: dict[str, mx.array], a_suffix: str, b_suffix: str) -> dict[str, tuple]:
    """(A tensor, B tensor) per module path; anything else is refused."""
    out: dict[str, list[Any]] = {}
    for key, value in tensors.items():
        for i, suffix in enumerate((a_suffix, b_suffix)):
            if key.endswith(suffix):
                out.setdefault(key[: -len(suffix)], [None, None])[i] = value
                break
        else:
            raise LoraError(f"unsupported tensor {key!r} in the adapter (only LoRA A and B)")
    for name, (a, b) in out.items():
        if a is None or b is None:
            raise LoraError(f"module {name!r} lacks its LoRA A or B matrix")
    return {k: (a, b) for k, (a, b) in out.items()}


def _mlx_modules(tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, LoraWeights]:
    scale = float(config["lora_parameters"]["scale"])
    out = {}
    for name, (a, b) in _pairs(tensors, ".lora_a", ".lora_b").items():
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise LoraError(f"module {name!r}: LoRA shapes {a.shape} and {b.shape} do not chain")
        out[name] = LoraWeights(a, b, scale)
    return out


def _peft_modules(tensors: dict[str, mx.array], config: dict[str, Any]) -> dict[str, LoraWeights]:
    if any("lora_embedding" in k for k in tensors):
        raise LoraError("adapters on embeddings are not supported")
    alpha = float(config["lora_alpha"])
    rslora = bool(config.get("use_rslora"))
    out = {}
    for name, (a, b) in _pairs(tensors, ".lora_A.weight", ".lora_B.weight").items():
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"module {name!r}: LoRA shapes {a.shape} and {b.shape} do not chain")
        r = a.shape[0]  # the module's own rank (rank_pattern may differ from `r`)
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        out[name.removeprefix(_PEFT_PREFIX)] = LoraWeights(a.T, b.T, scale)
    return out
