"""The default model on the CPU, its quantised weights packed (MLX's quantised matmul) or
unpacked to float32 (BLAS): one prompt's prefill and a short decode through EngineCore.
The switch is `PIPPIN_CPU_UNPACK` (0: packed); `--only` runs one of the two.

    .venv/bin/pippin ... # (the CLI re-execs with OpenBLAS; run this the same way:)
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python bench/cpu_unpack.py --prompt 3786 --gen 16
"""

from __future__ import annotations

import argparse
import os

from pippin.bench.inproc import drive
from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.engine.types import SamplingParams
from pippin.store import loader


def run(unpack: bool, prompt: int, gen: int) -> tuple[float, float]:
    os.environ["PIPPIN_CPU_UNPACK"] = "auto" if unpack else "0"  # read at load
    loaded = loader.load_model(None)
    core = EngineCore(loaded, EngineConfig(max_num_batched_tokens=prompt))
    ids = [(i * 7919) % 40000 + 100 for i in range(prompt)]
    params = SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True)
    drive(core, [("warm", ids[:32], SamplingParams(max_tokens=2, temperature=0.0))])
    run = drive(core, [("r", ids, params)])
    return run.first_token_s, run.seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--only", choices=("packed", "unpacked"))
    args = ap.parse_args()
    for name, unpack in (("packed", False), ("unpacked", True)):
        if args.only not in (None, name):
            continue
        ttft, total = run(unpack, args.prompt, args.gen)
        print(f"{name:9s} first token {ttft:6.2f} s, {args.gen} tokens done in {total:6.2f} s")


if __name__ == "__main__":
    main()
