"""MLX settings pippin picks before MLX first computes (MLX reads them once, then)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from pippin import envs

# Ops MLX's CUDA backend records into one CUDA graph before launching it. MLX lets at
# most ten launched graphs be unfinished before `eval`/`async_eval` wait for one, so with
# its small default a step of a thousand ops waits for the device mid-step, and the
# host's work for the next step no longer overlaps the device's. Measured on an H200
# (Llama-3.2-1B, bf16; docs/benchmarks.md): a 256-row decode step 17.7k -> 35.3k tok/s,
# an in-process closed loop under 256 clients 16.0k -> 22.0k, single stream 395 -> 419.
OPS_PER_BUFFER_CUDA = "400"

# What `apply` set (not what the user did): benchmarks take these out of the environment
# of the peer servers they start, which should run on their own defaults.
SET: dict[str, str] = {}


def cuda_build() -> bool:
    """Whether the installed MLX is the CUDA build (an `mlx-cuda-*` distribution beside
    the `mlx` package), found without importing MLX."""
    spec = importlib.util.find_spec("mlx")
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    return any(any(Path(f).parent.glob("mlx_cuda*.dist-info")) for f in folders)


def apply() -> None:
    """Set pippin's defaults for what the user left unset. Metal keeps MLX's own: its
    command buffers follow other rules, and nobody here can measure them."""
    if envs.MLX_MAX_OPS_PER_BUFFER is None and cuda_build():
        os.environ["MLX_MAX_OPS_PER_BUFFER"] = SET["MLX_MAX_OPS_PER_BUFFER"] = OPS_PER_BUFFER_CUDA
