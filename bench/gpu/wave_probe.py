"""One wave of fresh prompts through pippin's engine in-process: how long each step's
`mx.async_eval` takes on the host, and the device after it (bench only).

    PYTHONPATH=bench/gpu/probe_site:src PIPPIN_PROBE_EVAL=DIR PIPPIN_PROBE_SYNC=2 \\
        python bench/gpu/wave_probe.py MODEL [--rows 256 --prompt 512 --gen 16]

The probe (bench/gpu/probe_site) writes DIR/async-eval-PID.txt; a step holding a prompt chunk
shows whether MLX spends its time encoding it or the device running it.
"""

from __future__ import annotations

import argparse
import random
import sys

import checkout  # noqa: F401  (src on the path, pippin's MLX settings first)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=16)
    args = ap.parse_args()
    from mlx_lm.utils import load

    from pippin.bench.inproc import bare_core, drive, sampled

    model, _ = load(args.model)
    rng = random.Random(0)
    vocab = model.args.vocab_size
    for wave in ("warm-up", "measured"):
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.rows)]
        core = bare_core(model, prompts, args.gen)
        run = drive(core, sampled(prompts, args.gen), keep=False)
        print(f"{wave}: {run.steps} steps, {run.seconds:.2f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
