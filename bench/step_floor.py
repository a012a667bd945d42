"""What a decode step costs however small its model: the fixed part and the part per layer.

Two measurements, in-process, for the single-stream question of issue 9 (is the step's host
time in its nodes, or in what every step pays?):

- `--layers 1,4,16`: the model of `--model` rebuilt with that many layers (random weights,
  its dtype), single-stream decode tokens/s of mlx-lm's `generate_step` and pippin's
  `EngineCore`, in turns. A line through ms/token against layers gives each engine's fixed
  cost per step and its cost per layer.
- `--ops 0,100,400`: compiled chains of N nodes of one kind, launched back to back as a
  decode loop launches its steps (`mx.async_eval` on the previous output): views
  (reshape and transpose, no kernel), RMSNorms (one kernel each), small matmuls. The slope
  is MLX's host cost per node of that kind on this machine.

    python3 bench/step_floor.py --model /tmp/pippin-gpu-models/llama-3.2-1b
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)


def _model(path: Path, layers: int) -> Any:
    from gpu_bench import random_model

    config = json.loads((path / "config.json").read_text())
    bf16 = config.get("torch_dtype") == "bfloat16"
    return random_model({**config, "num_hidden_layers": layers}, bf16)


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    n = len(xs)
    mx_, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx_) ** 2 for x in xs)
    slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - slope * mx_, slope


def by_layers(path: Path, layers: list[int], prompt: int, gen: int, repeat: int) -> None:
    from paged_vs_contiguous import run_pippin
    from single_stream import in_turns, mlx_lm_decode

    ms: dict[str, list[float]] = {"mlx_lm": [], "pippin": []}
    for n in layers:
        model = _model(path, n)
        rng = random.Random(0)
        p = [rng.randrange(model.args.vocab_size) for _ in range(prompt)]
        runs: dict[str, Callable[[int], float]] = {
            "mlx_lm": lambda g, model=model, p=p: mlx_lm_decode(model, p, g),
            "pippin": lambda g, model=model, p=p: run_pippin(model, [p], g),
        }
        for e, tps in in_turns(runs, gen, repeat, label=f"layers {n:3d}  ").items():
            ms[e].append(1e3 / tps)
    for e, ys in ms.items():
        fixed, per = _line(layers, ys)
        print(f"{e:7s} fixed {fixed:.2f} ms/step + {per * 1e3:.0f} µs/layer", flush=True)


def by_ops(counts: list[int], steps: int) -> None:
    import mlx.core as mx

    w = mx.random.normal((256, 256)).astype(mx.bfloat16) * 0.05
    norm_w = mx.ones((256,), dtype=mx.bfloat16)
    mx.eval(w, norm_w)

    def views(x: mx.array, n: int) -> mx.array:
        for _ in range(n // 2):
            x = x.reshape(16, 16).T  # two nodes, no kernel
        return x.reshape(1, 256) + 1

    def norms(x: mx.array, n: int) -> mx.array:
        for _ in range(n):
            x = mx.fast.rms_norm(x, norm_w, 1e-5)
        return x + 1

    def matmuls(x: mx.array, n: int) -> mx.array:
        for _ in range(n):
            x = x @ w
        return x + 1

    for name, body in (("views", views), ("rms_norm", norms), ("matmul", matmuls)):
        us = []
        for n in counts:
            fn = mx.compile(lambda x, n=n, body=body: body(x, n))
            x = mx.zeros((1, 256), dtype=mx.bfloat16)
            for _ in range(5):
                x = fn(x)
                mx.eval(x)
            t0 = time.perf_counter()
            for _ in range(steps):
                x = fn(x)
                mx.async_eval(x)
            mx.eval(x)
            us.append((time.perf_counter() - t0) / steps * 1e6)
            print(f"{name:8s} {n:5d} nodes  {us[-1]:8.1f} µs/step", flush=True)
        fixed, per = _line(counts, us)
        print(f"{name:8s} fixed {fixed:.0f} µs/step + {per:.2f} µs/node", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--layers", default="1,4,16")
    ap.add_argument("--ops", default="0,100,400")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    if args.ops:
        by_ops([int(n) for n in args.ops.split(",")], args.steps)
    if args.model and args.layers:
        layers = [int(n) for n in args.layers.split(",")]
        by_layers(args.model, layers, args.prompt, args.gen, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
