"""What a decode step costs however small its model: the fixed part and the part per layer.

Three measurements, in-process, for the single-stream question (is the step's host time in
its nodes, or in what every step pays?):

- `--layers 1,4,16`: the model of `--model` rebuilt with that many layers (random weights,
  its dtype), single-stream decode tokens/s of mlx-lm's `generate_step` and pippin's
  `EngineCore`, in turns. A line through ms/token against layers gives each engine's fixed
  cost per step and its cost per layer.
- `--widths 2048,256`: the model at those hidden sizes (heads and MLP scaled, same layers
  and graph). The same tokens/s at a fraction of the bytes means the host bounds the step.
- `--ops 0,200`: compiled chains of N links of one kind, each run with the device drained
  first: the host's time in the compiled call and in `mx.async_eval` per link. Kinds:
  views (three nodes, no kernel), RMSNorm, a one-row matmul as `nn.Linear` runs it, and
  on CUDA a trivial custom kernel.

    python3 bench/gpu/step_floor.py --model /tmp/pippin-gpu-models/llama-3.2-1b --widths 2048,256
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


def _engines(model: Any, prompt: int) -> dict[str, Callable[[int], float]]:
    """Single-stream decode of `model` on a seeded random prompt: mlx-lm's and pippin's."""
    from pippin.bench.inproc import decode_rate, mlx_lm_decode

    rng = random.Random(0)
    p = [rng.randrange(model.args.vocab_size) for _ in range(prompt)]
    return {
        "mlx_lm": lambda g: mlx_lm_decode(model, p, g),
        "pippin": lambda g: decode_rate(model, [p], g),
    }


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope."""
    n = len(xs)
    mx_, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx_) ** 2 for x in xs)
    slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    return my - slope * mx_, slope


def by_layers(path: Path, layers: list[int], prompt: int, gen: int, repeat: int) -> None:
    from pippin.bench.inproc import in_turns

    ms: dict[str, list[float]] = {"mlx_lm": [], "pippin": []}
    for n in layers:
        runs = _engines(_model(path, n), prompt)
        for e, tps in in_turns(runs, gen, repeat, label=f"layers {n:3d}  ").items():
            ms[e].append(1e3 / tps)
    for e, ys in ms.items():
        fixed, per = _line(layers, ys)
        print(f"{e:7s} fixed {fixed:.2f} ms/step + {per * 1e3:.0f} µs/layer", flush=True)


def by_ops(counts: list[int], steps: int) -> None:
    import statistics

    import mlx.core as mx

    d = 2048
    w = (mx.random.normal((d, d)) * 0.02).astype(mx.bfloat16)
    norm_w = mx.ones((d,), dtype=mx.bfloat16)
    mx.eval(w, norm_w)
    kernel = None
    if hasattr(mx.fast, "cuda_kernel") and mx.default_device() == mx.gpu:
        kernel = mx.fast.cuda_kernel(
            name="step_floor_scale",
            input_names=["inp"],
            output_names=["out"],
            source="""
                unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
                if (i < N) out[i] = inp[i] * (T)1.0001f;
            """,
        )

    def custom(x: mx.array) -> mx.array:
        assert kernel is not None
        return kernel(
            inputs=[x],
            template=[("T", x.dtype), ("N", d)],
            grid=(d, 1, 1),
            threadgroup=(256, 1, 1),
            output_shapes=[x.shape],
            output_dtypes=[x.dtype],
        )[0]

    kinds: dict[str, Callable[[mx.array], mx.array]] = {
        "views": lambda x: x.reshape(32, 64).reshape(1, d)[:, :d],  # 3 nodes, no kernel
        "rms_norm": lambda x: mx.fast.rms_norm(x, norm_w, 1e-5),
        "gemv": lambda x: x @ w.T,  # as nn.Linear computes one row
    }
    if kernel is not None:
        kinds["custom"] = custom
    for name, body in kinds.items():
        res = {}
        for n in counts:

            def chain(x: mx.array, n: int = n, body: Callable = body) -> mx.array:
                for _ in range(n):
                    x = body(x)
                return x + 1

            fn = mx.compile(chain)
            x = mx.zeros((1, d), dtype=mx.bfloat16)
            for _ in range(5):
                x = fn(x)
                mx.eval(x)
            call, launch, done = [], [], []
            for _ in range(steps):
                mx.synchronize()  # the host's own time below, not waiting on the device
                t0 = time.perf_counter()
                y = fn(x)
                t1 = time.perf_counter()
                mx.async_eval(y)
                t2 = time.perf_counter()
                mx.eval(y)
                call.append(t1 - t0)
                launch.append(t2 - t1)
                done.append(time.perf_counter() - t0)
                x = y
            res[n] = [statistics.median(v) * 1e6 for v in (call, launch, done)]
        lo, hi = min(counts), max(counts)
        per = [(res[hi][i] - res[lo][i]) / (hi - lo) for i in range(3)]
        print(
            f"{name:8s} µs per link: compiled call {per[0]:.2f}, async_eval {per[1]:.2f}, "
            f"call to done {per[2]:.2f}",
            flush=True,
        )


def by_width(path: Path, widths: list[int], prompt: int, gen: int, repeat: int) -> None:
    """The model at its own width and narrower (same layers and graph, a fraction of the
    bytes): if a step costs the same, it is bound by the host, not the device."""
    from pippin.bench.inproc import in_turns

    config = json.loads((path / "config.json").read_text())
    bf16 = config.get("torch_dtype") == "bfloat16"
    d = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    for width in widths:
        heads = max(1, width // d)
        kv = max(1, heads * config["num_key_value_heads"] // config["num_attention_heads"])
        ratio = config["intermediate_size"] / config["hidden_size"]
        cfg = {
            **config,
            "hidden_size": width,
            "intermediate_size": int(width * ratio),
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": d,
        }
        from gpu_bench import random_model

        runs = _engines(random_model(cfg, bf16), prompt)
        in_turns(runs, gen, repeat, label=f"width {width:5d}  ")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--layers", default="1,4,16")
    ap.add_argument("--ops", default="0,200")
    ap.add_argument("--widths", default="", help="e.g. 2048,256: the model at these widths")
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
    if args.model and args.widths:
        widths = [int(n) for n in args.widths.split(",")]
        by_width(args.model, widths, args.prompt, args.gen, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
