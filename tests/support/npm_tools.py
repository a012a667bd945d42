"""Command-line clients from npm (Claude Code, Codex, ...) and PyPI (Aider), each installed
once, at a pinned version, into the user cache."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pippin"

# The agents the e2e tests run, each at one version.
CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.332"
CODEX = "@openai/codex@0.171.0"


@contextmanager
def _installing(folder: Path) -> Iterator[None]:
    """One installer at a time per folder: test files on two workers may share a client."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _installed_version(folder: Path, name: str) -> str | None:
    """The version of npm package `name` installed under `folder`, None if none is."""
    try:
        meta = json.loads((folder / "node_modules" / name / "package.json").read_text())
    except (OSError, ValueError):
        return None
    return str(meta.get("version")) if isinstance(meta, dict) else None


def npm_bin(package: str, command: str, what: str) -> Path:
    """The `command` executable of npm `package` (name@version); skips where npm cannot."""
    if shutil.which("npm") is None:
        pytest.skip(f"npm is not installed, so {what} cannot be installed")
    folder = CACHE / command
    exe = folder / "node_modules" / ".bin" / command
    name, _, version = package.rpartition("@")
    with _installing(folder):
        if not exe.exists() or _installed_version(folder, name) != version:
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


def pip_bin(requirement: str, command: str, what: str) -> Path:
    """The `command` script of PyPI `requirement` (name==version), installed into a venv of
    its own: its pinned dependencies would clash with pippin's. Skips where pip cannot."""
    folder = CACHE / command
    exe = folder / "bin" / command
    done = folder / f".installed-{requirement}"  # a half-done install is done again
    with _installing(folder):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)
            r = subprocess.run([sys.executable, "-m", "venv", str(folder)], capture_output=True)
            if r.returncode == 0:
                pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "-q", requirement]
                r = subprocess.run(pip, capture_output=True, text=True, timeout=900)
            if r.returncode != 0:
                pytest.skip(f"pip could not install {what} ({requirement}): {r.stderr[-500:]!r}")
            done.touch()
    return exe
