"""A checkpoint's multi-token-prediction (MTP) weights, which mlx-lm drops on load.

Two layouts ship them:
- Qwen3-Next / Qwen3.5: `mtp.fc` (2H -> H), `mtp.pre_fc_norm_embedding`,
  `mtp.pre_fc_norm_hidden`, `mtp.layers.{j}.*` (a decoder layer), `mtp.norm`;
- DeepSeek-V3 style (`num_nextn_predict_layers`): layer N of `model.layers` (N the
  model's layer count) with `eh_proj`, `enorm`, `hnorm`, `shared_head.norm` beside the
  decoder layer's own, and copies of the embedding and LM head (`embed_tokens`,
  `shared_head.head`), which the head shares with the target instead.

`read` gives them under one set of names, those of `pippin.runner.mtp_head`'s body:
`fc.weight`, `pre_fc_norm_embedding.weight`, `pre_fc_norm_hidden.weight`, `norm.weight`
and `layers.0.<the decoder layer's own names>`, converted as the target's own layers
were: through the family's `sanitize` (experts stacked, fp8 dequantised and so on,
under the name of one of the target's layers), with the norms shifted as the target's
final norm was (Qwen's zero-centred RMSNorms store w for 1 + w: mlx-lm adds the 1 on
load), cast to the target's dtype.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from .loaded import ModelLoadError

# The final norm's name in a checkpoint, by layout (the shift is read off it).
_FINAL_NORMS = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
)


class NoMtpWeightsError(ModelLoadError):
    """The checkpoint has no MTP layers; the message says why and what to use."""


@dataclass(frozen=True)
class Layout:
    """Where a family keeps its MTP weights: names under `prefix`; `renames` the parts
    outside the decoder layer (checkpoint name prefix -> the body's); the decoder
    layer's names start with `layer`; `shared` those the head takes from the target."""

    prefix: str
    renames: dict[str, str]
    layer: str
    shared: tuple[str, ...] = field(default=())


# The body's parts outside its decoder layer.
_BODY = ("fc.", "pre_fc_norm_embedding.", "pre_fc_norm_hidden.", "norm.")


def qwen_layout() -> Layout:
    return Layout("mtp.", {p: p for p in _BODY}, "layers.0.")


def deepseek_layout(num_hidden_layers: int) -> Layout:
    renames = dict(zip(("eh_proj.", "enorm.", "hnorm.", "shared_head.norm."), _BODY))
    return Layout(
        f"model.layers.{num_hidden_layers}.", renames, "", ("embed_tokens.", "shared_head.head.")
    )


def tensor_files(folder: Path) -> dict[str, Path]:
    """Every tensor of the folder's safetensors and the file that holds it (from the
    index where there is one, else from each file's header)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return {k: folder / v for k, v in weight_map.items()}
    out: dict[str, Path] = {}
    for path in sorted(folder.glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        out.update((k, path) for k in header if k != "__metadata__")
    return out


def _load(files: dict[str, Path], names: list[str]) -> dict[str, mx.array]:
    """The named tensors (lazy: `mx.load` reads only what is evaluated)."""
    by_file: dict[Path, list[str]] = {}
    for n in names:
        by_file.setdefault(files[n], []).append(n)
    out: dict[str, mx.array] = {}
    for path, keys in by_file.items():
        arrays = mx.load(str(path))
        out.update((k, arrays[k]) for k in keys)
    return out


def _body_name(key: str, layout: Layout) -> str | None:
    """The body's name for a checkpoint tensor; None if not one of the first MTP layer's
    or one the target shares."""
    at = key.find(layout.prefix)
    if at < 0 or (at > 0 and key[at - 1] != "."):
        return None
    name = key[at + len(layout.prefix) :]
    if name.startswith(layout.shared):
        return None
    for old, new in layout.renames.items():
        if name.startswith(old):
            return new + name[len(old) :]
    if not name.startswith(layout.layer):
        return None  # a further MTP layer: the first proposes every token (as vLLM's one)
    return "layers.0." + name[len(layout.layer) :]


def _norm_shift(files: dict[str, Path], final_norm: mx.array) -> float:
    """1.0 where loading added 1 to the target's norms (zero-centred RMSNorm weights),
    else 0.0: read off the final norm, as stored and as loaded."""
    key = next((k for k in _FINAL_NORMS if k in files), None)
    if key is None:
        return 0.0
    stored = _load(files, [key])[key].astype(mx.float32)
    loaded = final_norm.astype(mx.float32)
    off = mx.abs(loaded - stored).max().item()
    return 1.0 if mx.abs(loaded - stored - 1.0).max().item() < off else 0.0


def read(
    folder: Path,
    layout: Layout,
    *,
    sanitize: Callable[[dict[str, mx.array]], dict[str, mx.array]],
    layer_name: str,
    final_norm: mx.array,
    dtype: mx.Dtype,
) -> dict[str, mx.array]:
    """The MTP weights of the checkpoint in `folder` under the body's names (see the
    module). `sanitize`: the target's; `layer_name`: one of the target's decoder layers
    as its checkpoint names it ("model.layers.3."), under which `sanitize` converts the
    rest; `final_norm`: the target's loaded final norm weight."""
    files = tensor_files(folder)
    names = {k: n for k in files if (n := _body_name(k, layout)) is not None}
    if not names:
        raise NoMtpWeightsError(
            f"{folder.name} has no MTP layers (no {layout.prefix}* tensors), which "
            "--speculative-config method 'mtp' needs; mlx-lm conversions (mlx-community's "
            "among them) drop them: use the original Hugging Face checkpoint"
        )
    raw = _load(files, list(names))
    shift = _norm_shift(files, final_norm)
    out: dict[str, mx.array] = {}
    rest: dict[str, mx.array] = {}
    for k, v in raw.items():
        name = names[k]
        if v.ndim == 1 and "norm" in name.rsplit(".", 2)[-2]:
            out[name] = v + shift if shift else v
        else:
            rest[layer_name + name.removeprefix("layers.0.")] = v
    marker = "layers." + layer_name.split("layers.", 1)[1]
    for k, v in sanitize(rest).items():
        name = k.split(marker, 1)[1]
        out[name if name.startswith(_BODY) else "layers.0." + name] = v
    return {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in out.items()
    }
