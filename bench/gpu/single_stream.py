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
from pathlib import Path

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)


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

    from pippin.bench.inproc import decode_rate, in_turns, mlx_lm_batch_rate, mlx_lm_decode

    model, _ = load(str(args.model))
    # Multimodal configs (Qwen3.5) keep the text model's fields in text_config.
    vocab = getattr(model.args, "vocab_size", None) or model.args.text_config["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.batch)]

    def mlx_lm(gen: int) -> float:
        if args.batch > 1:
            return mlx_lm_batch_rate(model, prompts, gen)
        return mlx_lm_decode(model, prompts[0], gen)

    def pippin(gen: int) -> float:
        return decode_rate(model, prompts, gen)

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
