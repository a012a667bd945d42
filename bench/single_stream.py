"""Single-stream decode in-process: mlx-lm's `generate_step` against pippin's `EngineCore`.

One prompt, then `--gen` tokens; tokens/s from the first decode step (prefill excluded),
`--repeat` times each, the engines taking turns so that a drift of the host's speed
touches all. An engine `pippin:NAME=VALUE+...` runs pippin with those environment
variables set (e.g. `pippin:PIPPIN_COMPILE=0`). Run it under py-spy (`bash
bench/gpu_probe.sh single`) to see where a step's host time goes.

    python3 bench/single_stream.py /tmp/pippin-gpu-models/llama-3.2-1b --repeat 3
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--engines", default="mlx_lm,pippin")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from mlx_lm.utils import load
    from paged_vs_contiguous import run_pippin

    model, _ = load(str(args.model))
    rng = random.Random(0)
    prompt = [rng.randrange(model.args.vocab_size) for _ in range(args.prompt)]

    def mlx_lm(gen: int) -> float:
        return mlx_lm_decode(model, prompt, gen)

    def pippin(gen: int) -> float:
        return run_pippin(model, [prompt], gen)

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
    for e in engines:
        run(e, 16)  # warm-up: kernels, traces
    got: dict[str, list[float]] = {e: [] for e in engines}
    for _ in range(args.repeat):
        for e in engines:
            got[e].append(run(e, args.gen))
            print(f"{e:12s} {got[e][-1]:7.1f} tok/s ({1e3 / got[e][-1]:.2f} ms/token)", flush=True)
    for e in engines:
        ts = sorted(got[e])
        print(f"{e:12s} median {ts[len(ts) // 2]:7.1f} tok/s over {len(ts)} runs", flush=True)
    first = sorted(got[engines[0]])[len(got[engines[0]]) // 2]
    for e in engines[1:]:
        mid = sorted(got[e])[len(got[e]) // 2]
        print(f"{e} / {engines[0]}: {mid / first:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
