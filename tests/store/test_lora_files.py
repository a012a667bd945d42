"""Adapter folders in mlx-lm's and PEFT's formats read into one form; what cannot be
served exactly is refused in one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support.lora_adapters import write_mlx, write_peft

from pippin.store import lora

PATHS = ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")


def mats(rank: int = 4) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return {p: (rng.normal(size=(16, rank)), rng.normal(size=(rank, 24))) for p in PATHS}


def same(a: mx.array, b: np.ndarray) -> bool:
    return bool(np.allclose(np.array(a), b.astype(np.float32)))


def test_mlx_and_peft_read_alike(tmp_path: Path) -> None:
    m = {k: (a.astype(np.float32), b.astype(np.float32)) for k, (a, b) in mats().items()}
    x = lora.read(write_mlx(tmp_path / "mlx", m, scale=2.5, num_layers=2))
    p = lora.read(write_peft(tmp_path / "peft", m, alpha=10.0))  # 10 / 4
    assert (x.format, p.format) == ("mlx", "peft")
    assert x.modules.keys() == p.modules.keys() == set(PATHS)
    for path, (a, b) in m.items():
        for got in (x.modules[path], p.modules[path]):
            assert same(got.a, a) and same(got.b, b) and got.scale == 2.5
    assert x.rank == p.rank == 4
    assert x.digest != p.digest
    assert lora.read(tmp_path / "mlx").digest == x.digest


def test_rslora_scale(tmp_path: Path) -> None:
    p = lora.read(write_peft(tmp_path / "rs", mats(), alpha=8.0, rslora=True))
    assert all(w.scale == 8.0 / math.sqrt(4) for w in p.modules.values())


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, "bias"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
        ({"peft_type": "IA3"}, "IA3"),
    ],
)
def test_peft_refusals(tmp_path: Path, extra: dict, words: str) -> None:
    write_peft(tmp_path / "x", mats(), alpha=8.0, **extra)
    with pytest.raises(lora.LoraError, match=words):
        lora.read(tmp_path / "x")


@pytest.mark.parametrize("kind", ["dora", "full"])
def test_mlx_refusals(tmp_path: Path, kind: str) -> None:
    d = write_mlx(tmp_path / "x", mats(), scale=1.0, num_layers=2)
    config = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": kind}))
    with pytest.raises(lora.LoraError, match=kind):
        lora.inspect(d)


def test_bad_tensors(tmp_path: Path) -> None:
    d = write_mlx(tmp_path / "x", mats(), scale=1.0, num_layers=2)
    t = mx.load(str(d / "adapters.safetensors"))
    del t[f"{PATHS[0]}.lora_b"]
    mx.save_safetensors(str(d / "adapters.safetensors"), t)
    with pytest.raises(lora.LoraError, match="lacks"):
        lora.read(d)
    t["model.embed_tokens.weight"] = mx.zeros((4, 4))
    mx.save_safetensors(str(d / "adapters.safetensors"), t)
    with pytest.raises(lora.LoraError, match="unsupported tensor"):
        lora.read(d)
    p = write_peft(tmp_path / "emb", mats(), alpha=4.0)
    t = mx.load(str(p / "adapter_model.safetensors"))
    t["base_model.model.model.embed_tokens.lora_embedding_A"] = mx.zeros((4, 4))
    mx.save_safetensors(str(p / "adapter_model.safetensors"), t)
    with pytest.raises(lora.LoraError, match="embeddings"):
        lora.read(p)


def test_not_an_adapter(tmp_path: Path) -> None:
    with pytest.raises(lora.LoraError, match="adapter_config.json"):
        lora.inspect(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{")
    with pytest.raises(lora.LoraError, match="cannot be read"):
        lora.inspect(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    with pytest.raises(lora.LoraError, match="adapter_model.safetensors"):
        lora.inspect(tmp_path)
