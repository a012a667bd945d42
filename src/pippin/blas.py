"""Use an optimised BLAS for MLX's CPU backend on Linux.

The `mlx[cpu]` wheel for Linux bundles the reference (netlib) BLAS, whose
matmuls run at about 2 GFLOP/s; OpenBLAS runs the same shapes 10-20x faster.
MLX resolves `cblas_*` symbols through the dynamic linker, so preloading the
system OpenBLAS (Debian: `libopenblas0-pthread`) makes MLX use it unchanged.
The preload must happen before the process starts, hence the re-exec; it is
done before MLX is imported and only once (the environment marks it).

OpenBLAS picks its kernels by the CPU's model number, and a release older than the CPU
falls back to generic SSE3 code ("Prescott"): Debian 12's 0.3.21 does so on the
AVX-512 Xeons of this project's CI machines, where a float32 matmul then ran at 35-55
GFLOP/s instead of 280. Where the kernels it picked are below what the CPU's flags
allow, the re-exec names the right ones (`OPENBLAS_CORETYPE`), unless the user did.
"""

from __future__ import annotations

import ctypes
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


# OpenBLAS x86-64 kernel families, by the instructions they use (higher: wider).
CORE_RANK = {
    "Sandybridge": 1,
    "Haswell": 2,
    "Zen": 2,
    "SkylakeX": 3,
    "Cooperlake": 4,
    "SapphireRapids": 5,
}


def wanted_core(flags: set[str]) -> str | None:
    """The widest OpenBLAS kernel family the CPU's `flags` (/proc/cpuinfo) run."""
    if {"avx512f", "avx512_bf16"} <= flags:
        return "Cooperlake"
    if {"avx512f", "avx512bw", "avx512vl"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return None


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def detected_core(lib: str) -> str | None:
    """The kernel family `lib` picks on this CPU (openblas_get_corename), if it says."""
    try:
        fn = ctypes.CDLL(lib).openblas_get_corename
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_char_p
    name = fn()
    return name.decode() if name else None


def core_override(lib: str) -> str | None:
    """A better OPENBLAS_CORETYPE for `lib` on this CPU, or None to keep its choice."""
    if os.uname().machine != "x86_64":
        return None
    want = wanted_core(cpu_flags())
    got = detected_core(lib)
    if want is None or got is None:
        return None
    return want if CORE_RANK.get(got, 0) < CORE_RANK[want] else None


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
    if envs.OPENBLAS_CORETYPE is None:
        core = core_override(lib)
        if core is not None:
            env["OPENBLAS_CORETYPE"] = core
    args = argv if argv is not None else sys.argv
    os.execve(sys.executable, [sys.executable, "-m", "pippin.cli", *args[1:]], env)
