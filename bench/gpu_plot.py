"""Plot docs/gpu-bench.png from the GPU results in bench/results/: python bench/gpu_plot.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RES = Path(__file__).resolve().parent / "results"
MODEL = "llama-3.2-1b"


def _load(name: str, part: str) -> dict[str, Any]:
    data = json.loads((RES / name).read_text())["models"][MODEL]
    return data["http"]["summary"] if part == "http" else data["in_process"]["batches"]


def main() -> None:
    pip, mlx = _load("gpu-after-http-pippin.json", "http"), _load("gpu-http-mlx_lm.json", "http")
    before = _load("gpu-before-inprocess.json", "in_process")
    after = _load("gpu-after-inprocess.json", "in_process")
    cs, bs = [1, 16, 64, 256], [32, 128, 256]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot(cs, [pip[str(c)]["pippin"]["tok_per_s"] for c in cs], "o-", label="pippin")
    ax[0].plot(cs, [mlx[str(c)]["mlx_lm"]["tok_per_s"] for c in cs], "o-", label="mlx_lm.server")
    ax[1].plot(bs, [before[str(b)]["pippin"] for b in bs], "o-", label="pippin, gather path")
    ax[1].plot(bs, [after[str(b)]["pippin"] for b in bs], "o-", label="pippin, paged kernel")
    ax[1].plot(bs, [after[str(b)]["mlx_lm"] for b in bs], "o--", label="mlx-lm BatchGenerator")
    titles = ("over HTTP, 512 -> 256 tokens", "in-process decode, 512 + 256 tokens")
    for a, title, xlabel in zip(ax, titles, ("concurrency", "batch")):
        a.set_xscale("log", base=2)
        a.set_xlabel(xlabel)
        a.set_ylabel("output tok/s")
        a.set_title(title)
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle("Llama-3.2-1B config, random bf16 weights, NVIDIA H200")
    fig.tight_layout()
    fig.savefig(RES.parent.parent / "docs" / "gpu-bench.png", dpi=110)


if __name__ == "__main__":
    main()
