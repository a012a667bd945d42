"""Where a decode step's time goes: pippin's engine with the step compiled or built op by op.

In-process on one model folder (e.g. one `bench/gpu/gpu_bench.py` built): decode tokens/s of
mlx-lm's `generate_step` (single stream) and of pippin's `EngineCore` at each batch size,
eager (`PIPPIN_COMPILE=0`) against compiled, and a cProfile of the compiled engine's steps
at the smallest and largest batch (what the host does while the device runs).

    python3 bench/gpu/decode_profile.py --model /tmp/pippin-gpu-models/llama-3.2-1b --out $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
from pathlib import Path

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--modes", default="eager,compiled")
    ap.add_argument("--out", type=Path, default=Path(".tmp/decode-profile"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import mlx.core as mx
    from mlx_lm.utils import load

    import pippin.engine.core as core_mod
    from pippin.bench.inproc import decode_rate, mlx_lm_decode

    model, _ = load(str(args.model))
    vocab = model.args.vocab_size
    rng = random.Random(0)
    res: dict = {"model": str(args.model), "device": str(mx.default_device()), "runs": {}}
    p = [rng.randrange(vocab) for _ in range(args.prompt)]

    mlx_lm_decode(model, p, args.gen)
    res["mlx_lm_single"] = mlx_lm_decode(model, p, args.gen)
    print(f"mlx-lm single stream {res['mlx_lm_single']:.0f} tok/s", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = {
        b: [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(b)] for b in batches
    }
    for mode in args.modes.split(","):
        os.environ["PIPPIN_COMPILE"] = "0" if mode == "eager" else "1"
        for b in batches:
            decode_rate(model, prompts[b], 8)  # warm-up: traces and kernels
            tps = decode_rate(model, prompts[b], args.gen)
            res["runs"][f"{mode}/{b}"] = tps
            print(
                f"{mode:9s} batch {b:4d}: {tps:8.0f} tok/s ({b / tps * 1e3:.2f} ms/step)",
                flush=True,
            )
            if mode == "compiled" and b in (batches[0], batches[-1]):
                prof = cProfile.Profile()
                real_step = core_mod.EngineCore.step

                def step(self, _real=real_step, _prof=prof):  # type: ignore[no-untyped-def]
                    return _prof.runcall(_real, self)

                core_mod.EngineCore.step = step  # type: ignore[method-assign]
                try:
                    decode_rate(model, prompts[b], 64)
                finally:
                    core_mod.EngineCore.step = real_step  # type: ignore[method-assign]
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
                text = buf.getvalue()
                (args.out / f"profile-{b}.txt").write_text(text)
                print(text[:3500], flush=True)
    (args.out / "decode_profile.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
