"""Registers and spills of the fused layer's matrix-vector kernel, per build, without a
GPU: each build launched as the engine launches it (Llama-3.2-1B's projections, bf16),
recorded and compiled by NVRTC for sm_90 (`pippin.bench.kernel_compile`, as
`tests/kernels/test_cuda_kernels_compile.py` does),
with ptxas's report.

An SM holds 65,536 registers, so a build using R a thread keeps at most
min(64, 65,536 / (32 R)) warps resident. Needs NVRTC's wheels (the test extra on Linux
x86-64: nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12):

    python3 bench/gpu/kernel_regs.py
"""

from __future__ import annotations

import re
import sys

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)
import mlx.core as mx
import mlx.nn as nn
from gpu_bench import CONFIGS
from kernel_time import projection_shapes

from pippin.bench.kernel_compile import Recorder, compile_launch, nvrtc
from pippin.kernels import device, fused_layer


def main() -> int:
    found = nvrtc()
    if found is None:
        raise SystemExit("needs nvidia-cuda-nvrtc-cu12 and nvidia-cuda-runtime-cu12")
    rec = Recorder()
    device.cuda_kernel = rec
    dt = mx.bfloat16
    print("projection rows MAXB registers warps/SM  spills (each distinct build once)")
    for name, (rows_w, k, norm, swiglu, res) in projection_shapes(CONFIGS["llama-3.2-1b"]).items():
        rms = nn.RMSNorm(k) if norm else None
        p = fused_layer.Gemv(mx.zeros((rows_w, k), dtype=dt), norm=rms, swiglu=swiglu)
        n = p.width
        seen: set[int] = set()
        for rows in range(1, fused_layer.MAX_ROWS + 1):
            rec.launches = []
            x = mx.zeros((rows, k), dtype=dt)
            fused_layer.gemv(p, x, mx.zeros((rows, n), dtype=dt) if res else None)
            (launch,) = rec.launches
            maxb = dict(launch.template)["MAXB"]
            if maxb in seen:
                continue
            seen.add(maxb)
            ok, log = compile_launch(*found, launch, ("--ptxas-options=-v",))
            assert ok, log
            regs = int(re.search(r"Used (\d+) registers", log).group(1))
            spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
            warps = min(64, 65536 // (32 * regs))
            print(f"{name:10s} {rows:4d} {maxb:4d} {regs:9d} {warps:8d}  {spills.group(0)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
