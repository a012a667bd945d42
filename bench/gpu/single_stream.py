"""Single-stream decode in-process: mlx-lm's `generate_step` against pippin's `EngineCore`.

One prompt, then `--gen` tokens; tokens/s from the first decode step (prefill excluded),
`--repeat` times each, the engines taking turns so that a drift of the host's speed
touches all. An engine `pippin:NAME=VALUE+...` runs pippin with those environment
variables set (e.g. `pippin:PIPPIN_COMPILE=0`). Run it under py-spy (`bash
bench/gpu/gpu_probe.sh single`) to see where a step's host time goes. `--batch N` decodes N
prompts together instead (aggregate tok/s; mlx-lm's `BatchGenerator` for mlx-lm): which
projections should run as the fused layer's kernel at a few rows.

    python3 bench/gpu/single_stream.py /tmp/pippin-gpu-models/llama-3.2-1b --repeat 3
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)


def mlx_lm_decode(model: Any, prompt: list[int], gen: int) -> float:
    """Decode tokens/s of mlx-lm's `generate_step` on `prompt`, from its first decode step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=gen)
    next(steps)
    t0 = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / (time.perf_counter() - t0)


def in_turns(
    runs: dict[str, Callable[[int], float]], gen: int, repeat: int, label: str = ""
) -> dict[str, float]:
    """Each run's median tokens/s over `repeat` runs of `gen` tokens, the runs taking turns
    (after one short warm-up each: kernels, traces); every result printed as it comes."""
    for fn in runs.values():
        fn(16)
    got: dict[str, list[float]] = {e: [] for e in runs}
    for _ in range(repeat):
        for e, fn in runs.items():
            got[e].append(fn(gen))
            print(
                f"{label}{e:12s} {got[e][-1]:7.1f} tok/s ({1e3 / got[e][-1]:.2f} ms/token)",
                flush=True,
            )
    mids = {e: sorted(ts)[len(ts) // 2] for e, ts in got.items()}
    for e, mid in mids.items():
        print(f"{label}{e:12s} median {mid:7.1f} tok/s over {repeat} runs", flush=True)
    return mids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--engines", default="mlx_lm,pippin")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--batch", type=int, default=1, help="decode this many prompts together (aggregate tok/s)"
    )
    args = ap.parse_args()

    from mlx_lm.utils import load
    from paged_vs_contiguous import run_mlx_lm, run_pippin

    model, _ = load(str(args.model))
    rng = random.Random(0)
    prompts = [
        [rng.randrange(model.args.vocab_size) for _ in range(args.prompt)]
        for _ in range(args.batch)
    ]

    def mlx_lm(gen: int) -> float:
        if args.batch > 1:
            return run_mlx_lm(model, prompts, gen)
        return mlx_lm_decode(model, prompts[0], gen)

    def pippin(gen: int) -> float:
        return run_pippin(model, prompts, gen)

    def run(engine: str, gen: int) -> float:
        if engine == "mlx_lm":
            return mlx_lm(gen)
        name, _, env = engine.partition(":")
        assert name == "pippin", engine
        sets = dict(kv.split("=", 1) for kv in env.split("+") if kv)
        old = {k: os.environ.get(k) for k in sets}
        os.environ.update(sets)
        try:
            return pippin(gen)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    engines = args.engines.split(",")
    mids = in_turns({e: lambda g, e=e: run(e, g) for e in engines}, args.gen, args.repeat)
    for e in engines[1:]:
        print(f"{e} / {engines[0]}: {mids[e] / mids[engines[0]]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
