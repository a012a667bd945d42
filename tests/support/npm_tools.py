"""Command-line clients from npm (Claude Code, Codex), installed once into the user cache."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pippin"


def npm_bin(package: str, command: str, what: str) -> Path:
    """The `command` executable of npm `package` (name@version); skips where npm cannot."""
    if shutil.which("npm") is None:
        pytest.skip(f"npm is not installed, so {what} cannot be installed")
    folder = CACHE / command
    exe = folder / "node_modules" / ".bin" / command
    if not exe.exists():
        folder.mkdir(parents=True, exist_ok=True)
        r = subprocess.run(
            ["npm", "install", "--silent", "--no-audit", "--no-fund", package],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if r.returncode != 0:
            pytest.skip(f"npm could not install {package}: {r.stderr[-500:]}")
    return exe
