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


def _load_http(name: str) -> dict[str, Any]:
    """A `serve_bench.py --out` file's summary."""
    return json.loads((RES / name).read_text())["summary"]


def _single_stream(a: Any) -> None:
    """Single-stream decode in-process, mlx-lm and pippin's settings side by side."""
    runs = json.loads((RES / "gpu-fused-layer-single.json").read_text())["tok_per_s"]
    models = list(runs)
    settings = list(runs[models[0]])
    width = 0.8 / len(settings)
    for i, setting in enumerate(settings):
        xs = [m + (i - (len(settings) - 1) / 2) * width for m in range(len(models))]
        a.bar(xs, [runs[m][setting] for m in models], width, label=setting)
    a.set_xticks(range(len(models)), models)
    a.set_ylabel("output tok/s")
    a.set_title("single-stream decode, in-process (first fused-layer runs)")
    a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    a.grid(alpha=0.3, axis="y")


def main() -> None:
    # The compiled decode step, pippin and mlx_lm.server in one run.
    comp = _load("gpu-compiled-http.json", "http")
    runs = json.loads((RES / "gpu-decode-profile.json").read_text())["runs"]
    cs, bs = [1, 16, 64, 256], [1, 32, 256]
    fig, ax = plt.subplots(1, 3, figsize=(15, 6))
    # Latest: 400 ops per CUDA graph, one process, with mlx_lm.server in the same run; then
    # the engine process (the default on CUDA now) against one process, in one later run.
    ops = _load("gpu-ops-per-buffer-inprocess-llama.json", "http")
    ep = _load_http("gpu-engine-process-http-llama.json")
    ax[0].plot(cs, [ops[str(c)]["pippin"]["tok_per_s"] for c in cs], "o-", label="pippin")
    eps = sorted(int(c) for c in ep)
    ax[0].plot(
        eps, [ep[str(c)]["pippin"]["tok_per_s"] for c in eps], "s", label="pippin, engine process"
    )
    # Fused projections (engine process): two runs at 256 (one wave per window).
    sep = _load("gpu-fused-proj-http-unfused.json", "http")
    fused = json.loads((RES / "gpu-fused-proj-http.json").read_text())["runs"]
    ax[0].plot(
        [1, 256],
        [sep[c]["pippin"]["tok_per_s"] for c in ("1", "256")],
        "^",
        label="pippin, separate projections",
    )
    ax[0].plot(
        [r["concurrency"] for r in fused],
        [r["tok_per_s"] for r in fused],
        "*",
        markersize=10,
        label="pippin, fused projections",
    )
    # The fused decode layer: the first run (its kernels compiled mid-run at 64, per batch
    # size), then two runs of the kernel built once for one row and once for the rest.
    fl = _load_http("gpu-fused-layer-http-llama.json")
    fcs = sorted(int(c) for c in fl)
    ax[0].plot(
        fcs,
        [fl[str(c)]["pippin"]["tok_per_s"] for c in fcs],
        "D",
        label="pippin, fused decode layer, first (64: compiles mid-run)",
    )
    # run3: only gate/up and down as the kernel; run5: only down (the default since).
    for run, style in (("run1", "o-"), ("run2", "s-"), ("run3", "^-"), ("run5", "v-")):
        r = _load_http(f"gpu-fused-layer-http-llama-{run}.json")
        for server, ls in (("pippin", style), ("mlx_lm", style.replace("-", "--"))):
            ax[0].plot(
                cs,
                [r[str(c)][server]["tok_per_s"] for c in cs],
                ls,
                linewidth=2,
                label=f"{'pippin' if server == 'pippin' else 'mlx_lm.server'}, latest {run}",
            )
    ax[0].plot(cs, [comp[str(c)]["pippin"]["tok_per_s"] for c in cs], "o:", label="pippin, earlier")
    ax[0].plot(
        cs, [ops[str(c)]["mlx_lm"]["tok_per_s"] for c in cs], "x:", label="mlx_lm.server, earlier"
    )
    ax[1].plot(bs, [runs[f"eager/{b}"] for b in bs], "o-", label="pippin, op by op")
    ax[1].plot(bs, [runs[f"compiled/{b}"] for b in bs], "o-", label="pippin, compiled step")
    for name, mark, label in (
        ("separate", "^", "separate projections"),
        ("fused", "*", "fused projections"),
    ):
        r = json.loads((RES / f"gpu-fused-proj-decode-{name}.json").read_text())["runs"]
        ax[1].plot([1, 256], [r["compiled/1"], r["compiled/256"]], mark, label=f"pippin, {label}")
    _single_stream(ax[2])
    titles = ("over HTTP, 512 -> 256 tokens", "in-process decode, 512 + 128 tokens")
    for a, title, xlabel in zip(ax, titles, ("concurrency", "batch")):
        a.set_xscale("log", base=2)
        a.set_xlabel(xlabel)
        a.set_ylabel("output tok/s")
        a.set_title(title)
        a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=2)
        a.grid(alpha=0.3)
    fig.suptitle("Random bf16 weights, NVIDIA H200 (left and middle: the Llama-3.2-1B config)")
    fig.tight_layout()
    fig.savefig(RES.parent.parent / "docs" / "gpu-bench.png", dpi=110)


if __name__ == "__main__":
    main()
