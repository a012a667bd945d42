"""Load a Whisper model for mlx-audio's Whisper: an MLX Whisper folder (config.json and
safetensors, as mlx-community publishes them) or a CTranslate2 one, converted once
(`ct2_convert`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from pippin.audio.ct2_convert import ensure_mlx_whisper


class WhisperLoadError(ValueError):
    pass


def load_whisper(path: Path, cache: Path, dtype: mx.Dtype = mx.float32) -> Any:
    """mlx-audio's Whisper `Model` in ``dtype`` (float32 by default: fastest on CPU and
    exact; float16 halves the memory on a GPU)."""
    from mlx_audio.stt.models.whisper.whisper import Model, ModelDimensions

    if not path.is_dir():
        raise WhisperLoadError(f"{path}: not a model folder")
    folder = ensure_mlx_whisper(path, cache)
    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type", "whisper") != "whisper":
        raise WhisperLoadError(f"{path}: model_type {config['model_type']!r} is not whisper")
    files = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("weights.npz"))
    if not files:
        raise WhisperLoadError(f"{path}: no weights (*.safetensors) found")
    model = Model(ModelDimensions.from_dict(config), dtype=dtype)
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))  # type: ignore[arg-type]
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    mx.eval(model.parameters())
    model.eval()
    model = Model.post_load_hook(model, folder)
    if getattr(model, "_processor", None) is None:
        raise WhisperLoadError(f"{path}: no tokenizer (tokenizer.json) beside the weights")
    return model
