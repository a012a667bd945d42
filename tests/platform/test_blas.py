"""The OpenBLAS preload (`pippin.blas`): the re-exec's environment, and the kernel family
named where the preloaded OpenBLAS picks narrower ones than the CPU runs."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from pippin import blas


@pytest.mark.parametrize(
    "flags,core",
    [
        ({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma"}, "Cooperlake"),
        ({"avx512f", "avx512bw", "avx512vl", "avx2", "fma"}, "SkylakeX"),
        ({"avx2", "fma", "avx"}, "Haswell"),
        ({"sse4_2", "avx"}, None),
        (set(), None),
    ],
)
def test_wanted_core(flags: set[str], core: str | None) -> None:
    assert blas.wanted_core(flags) == core


@pytest.mark.parametrize(
    "detected,override",
    [
        ("Prescott", "Cooperlake"),  # an OpenBLAS older than the CPU: generic SSE3 kernels
        ("Haswell", "Cooperlake"),
        ("Cooperlake", None),
        ("SapphireRapids", None),  # already wider: kept
        (None, None),  # a library that does not say
    ],
)
def test_core_override(
    monkeypatch: pytest.MonkeyPatch, detected: str | None, override: str | None
) -> None:
    monkeypatch.setattr(blas, "cpu_flags", lambda: {"avx512f", "avx512_bf16", "avx2", "fma"})
    monkeypatch.setattr(blas, "detected_core", lambda lib: detected)
    monkeypatch.setattr(blas.os, "uname", lambda: type("U", (), {"machine": "x86_64"})())
    assert blas.core_override("libopenblas.so.0") == override


def _reexec_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    seen: dict[str, Any] = {}

    def execve(path: str, args: list[str], env: dict[str, str]) -> None:
        seen["env"] = env

    monkeypatch.setattr(blas.sys, "platform", "linux")
    monkeypatch.setattr(blas, "find_openblas", lambda: "/lib/libopenblas.so.0")
    monkeypatch.setattr(blas, "core_override", lambda lib: "Cooperlake")
    monkeypatch.setattr(blas.os, "execve", execve)
    for name in ("PIPPIN_BLAS_PRELOADED", "PIPPIN_NO_OPENBLAS", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    # MLX is imported in this process: the check that it is not comes first.
    monkeypatch.setattr(sys, "modules", {k: v for k, v in sys.modules.items() if "mlx" not in k})
    blas.maybe_reexec_with_openblas(["pippin", "serve"])
    return seen["env"]


def test_reexec_names_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    env = _reexec_env(monkeypatch)
    assert env["LD_PRELOAD"] == "/lib/libopenblas.so.0"
    assert env["OPENBLAS_CORETYPE"] == "Cooperlake"
    assert env[blas.MARK] == "/lib/libopenblas.so.0"


def test_reexec_keeps_the_users_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    assert _reexec_env(monkeypatch)["OPENBLAS_CORETYPE"] == "Haswell"


@pytest.mark.skipif(blas.find_openblas() is None, reason="no system OpenBLAS here")
def test_the_system_openblas_says_its_kernels() -> None:
    lib = blas.find_openblas()
    assert lib is not None
    assert blas.detected_core(lib)  # a name: the comparison above has something to compare
