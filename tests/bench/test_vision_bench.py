"""bench/vision_bench.py's helpers: the images, the request bodies each server gets, the table."""

from __future__ import annotations

import importlib.util
import io
import json
import sys
from pathlib import Path

from PIL import Image

from pippin.bench.vlm_models import QWEN_MAX_PIXELS

BENCH = Path(__file__).resolve().parents[2] / "bench" / "vision_bench.py"


def _module():
    spec = importlib.util.spec_from_file_location("pippin_vision_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_images_are_1024x768_and_distinct_per_seed() -> None:
    vb = _module()
    a, b = vb.make_image(0), vb.make_image(1)
    assert Image.open(io.BytesIO(a)).size == (1024, 768)
    assert a != b and a == vb.make_image(0)


def test_mlx_vlm_gets_a_logit_bias_on_every_eos_id(tmp_path: Path) -> None:
    vb = _module()
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    eos = vb.eos_ids(tmp_path)
    assert eos == [5, 7, 9]
    msgs = [{"role": "user", "content": "x"}]
    peer = vb.body("mlx_vlm", msgs, 32, eos)
    assert peer["logit_bias"] == {"5": -100.0, "7": -100.0, "9": -100.0}
    assert "ignore_eos" not in peer
    ours = vb.body("pippin", msgs, 32, eos)
    assert ours["ignore_eos"] is True and "logit_bias" not in ours
    assert ours["max_tokens"] == peer["max_tokens"] == 32


def test_table_gives_the_ratio_at_each_concurrency() -> None:
    vb = _module()
    rows = [
        vb.Row("pippin", 4, 8, 0, 512, 64, 30.0, 0.5, 0.9, 1030, 2.0, 0.1, 1024),
        vb.Row("mlx_vlm", 4, 8, 0, 512, 64, 10.0, 1.5, 3.0, 1030, 3.0, 2.7, 0),
    ]
    table = vb.markdown(rows)
    assert "pippin / mlx_vlm tok/s at 4: **3.00x**" in table
    assert "100 / 2,000 = 0.05" in table


def test_tiny_build_keeps_a_1024x768_picture_near_its_size(tmp_path: Path) -> None:
    vb = _module()
    args = vb.argparse.Namespace(model=None, build_shape=None)
    model = vb.build_model(args, tmp_path)
    pre = json.loads((model / "preprocessor_config.json").read_text())
    assert pre["max_pixels"] == QWEN_MAX_PIXELS >= 1024 * 768
    assert vb.eos_ids(model)  # what mlx_vlm.server's logit_bias holds back
