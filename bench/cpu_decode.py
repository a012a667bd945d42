"""One stream's decode on the CPU over contexts of several lengths: pippin's engine
against mlx-lm's `generate_step`, the same loaded weights (the default model unless
`--model`: its GGUF unpacked to float32 as the CPU loads it), token ids, the engines
taking turns.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python bench/cpu_decode.py --contexts 256 4000

(`pippin serve` preloads OpenBLAS itself; a script must be started that way.) pippin
gathers each row's KV out of its paged pool every step, where mlx-lm reads one contiguous
cache; past `cpu_prefill.DECODE_KEYS` keys pippin's decode attention runs in numpy.
Reading a lone row's consecutive blocks as one slice of the pool instead of gathering
them was tried on 2026-12-07 and changed nothing measurable at 4,000 tokens (0.999x).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a path or id (default: pippin's default)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[256, 4000])
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from pippin.bench.inproc import decode_rate, in_turns, mlx_lm_decode
    from pippin.store.loader import load_model

    model = load_model(args.model).model
    rng = random.Random(0)
    for ctx in args.contexts:
        prompt = [rng.randrange(1000, 40000) for _ in range(ctx)]
        runs = {
            "mlx_lm": lambda g, p=prompt: mlx_lm_decode(model, p, g),
            "pippin": lambda g, p=prompt: decode_rate(model, [p], g),
        }
        rates = in_turns(runs, args.gen, args.repeat, label=f"ctx {ctx:5d}  ")
        print(f"context {ctx}: pippin / mlx_lm {rates['pippin'] / rates['mlx_lm']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
