"""The CTranslate2 → MLX Whisper conversion of the real tiny.en: projections split as
Whisper's, timestamp tokens added, converted once and then reused from the cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.whisper_models import ct2_tiny_en_dir

from pippin.audio.ct2_convert import ensure_mlx_whisper, read_ct2_model

mx = pytest.importorskip("mlx.core")


def test_weights_split_and_tokens_added(tiny_en: Path) -> None:
    ct2 = read_ct2_model(ct2_tiny_en_dir() / "model.bin")
    ours = mx.load(str(tiny_en / "weights.safetensors"))
    fused = ct2["decoder/layer_1/self_attention/linear_0/weight"]  # q | k | v
    d = fused.shape[1]
    for i, name in enumerate(("query", "key", "value")):
        got = np.array(ours[f"decoder.blocks.1.attn.{name}.weight"])
        np.testing.assert_array_equal(got, fused[i * d : (i + 1) * d])
    kv = ct2["decoder/layer_0/attention/linear_1/weight"]  # cross-attention k | v
    np.testing.assert_array_equal(
        np.array(ours["decoder.blocks.0.cross_attn.value.weight"]), kv[d:]
    )
    assert "decoder.blocks.0.attn.key.bias" not in ours  # Whisper's key has no bias
    conv = ct2["encoder/conv1/weight"]  # (out, in, kernel) -> MLX (out, kernel, in)
    np.testing.assert_array_equal(np.array(ours["encoder.conv1.weight"]), conv.transpose(0, 2, 1))
    config = json.loads((tiny_en / "config.json").read_text())
    assert (config["n_vocab"], config["n_audio_layer"], config["n_text_head"]) == (51864, 4, 6)

    added = json.loads((tiny_en / "tokenizer.json").read_text())["added_tokens"]
    by_text = {t["content"]: t["id"] for t in added}
    assert by_text["<|notimestamps|>"] == 50362
    assert by_text["<|0.00|>"] == 50363 and by_text["<|30.00|>"] == 51863


def test_converted_once_into_the_cache(tmp_path: Path) -> None:
    src = ct2_tiny_en_dir()
    first = ensure_mlx_whisper(src, tmp_path)
    assert first.parent == tmp_path and (first / "weights.safetensors").exists()
    stamp = (first / "weights.safetensors").stat().st_mtime_ns
    assert ensure_mlx_whisper(src, tmp_path) == first
    assert (first / "weights.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if ".tmp" in p.name]
    # An MLX folder is used as it is.
    assert ensure_mlx_whisper(first, tmp_path) == first


def test_serve_refuses_a_missing_stt_model_in_one_line(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pippin.cli", "serve", "--stt-model", str(tmp_path / "nope")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3
    assert "cannot load the speech-to-text model" in r.stderr and "nope" in r.stderr
