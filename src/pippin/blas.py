"""Use an optimised BLAS for MLX's CPU backend on Linux.

The `mlx[cpu]` wheel for Linux bundles the reference (netlib) BLAS, whose
matmuls run at about 2 GFLOP/s; OpenBLAS runs the same shapes 10-20x faster.
MLX resolves `cblas_*` symbols through the dynamic linker, so preloading the
system OpenBLAS (Debian: `libopenblas0-pthread`) makes MLX use it unchanged.
The preload must happen before the process starts, hence the re-exec; it is
done before MLX is imported and only once (the environment marks it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from pippin import envs

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)
MARK = "PIPPIN_BLAS_PRELOADED"


def find_openblas() -> str | None:
    for path in CANDIDATES:
        if Path(path).exists():
            return path
    return None


def maybe_reexec_with_openblas(argv: list[str] | None = None) -> None:
    """Re-exec this process with OpenBLAS preloaded when that helps; else return."""
    if (
        not sys.platform.startswith("linux")
        or envs.PIPPIN_BLAS_PRELOADED
        or envs.PIPPIN_NO_OPENBLAS
    ):
        return
    if "mlx" in sys.modules or "mlx.core" in sys.modules:
        return  # too late to change how MLX's library binds
    lib = find_openblas()
    if lib is None:
        return
    env = dict(os.environ)
    env[MARK] = lib
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    args = argv if argv is not None else sys.argv
    os.execve(sys.executable, [sys.executable, "-m", "pippin.cli", *args[1:]], env)
