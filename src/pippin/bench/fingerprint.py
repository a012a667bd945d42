"""Where a benchmark ran: the client machine's hardware and software, and each server's
own account of itself (`/version`, `/v1/models`)."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

PACKAGES = ("pippin", "mlx", "mlx-lm", "mlx-metal", "mlx-cuda-13", "vllm", "vllm-mlx", "httpx")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True
            )
            return out.stdout.strip()
        except OSError:
            pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return [line.strip() for line in out.stdout.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


def pippin_commit() -> str | None:
    """The commit of the checkout pippin runs from (`-dirty` with local changes), if any."""
    import pippin

    where = Path(pippin.__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def machine() -> dict[str, Any]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    mem = _memory_gib()
    return {
        "pippin_commit": pippin_commit(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1) if mem else None,
        "gpus": _gpus(),
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
        "python": platform.python_version(),
        "packages": versions,
    }


async def server_info(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> dict:
    info: dict[str, Any] = {"url": base_url}
    for key, path in (("version", "/version"), ("models", "/v1/models")):
        try:
            r = await client.get(f"{base_url}{path}", headers=headers, timeout=10)
            if r.status_code == 200:
                body = r.json()
                info[key] = (
                    body.get("version")
                    if key == "version"
                    else [m.get("id") for m in body.get("data", [])]
                )
        except (httpx.HTTPError, ValueError):
            pass
    return info
