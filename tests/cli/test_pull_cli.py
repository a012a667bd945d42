"""`pippin pull` (`pippin.cli.pull`) as a user runs it, against a fake Hugging Face hub
(HF_ENDPOINT): the model in the library and its name on stdout, a one-line error and exit
code 1, and Ctrl-C mid-download (130), after which the next pull resumes the file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.fake_hub import FakeHub, fake_hub
from support.server_utils import SRC_DIR
from support.waiting import wait_for

from pippin.store.library import ModelLibrary
from pippin.store.loaded import ModelLoadError
from pippin.store.loader import default_model_path

GGUF = "SmolLM2-135M-Instruct-Q4_1.gguf"


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    with fake_hub() as h:
        h.add_repo("org/tags-GGUF", {"m-Q4_K_M.gguf": b"GGUF4", "m-Q8_0.gguf": b"GGUF8"})
        yield h


def _cmd(hub: FakeHub, models: Path, *args: str) -> tuple[list[str], dict[str, str]]:
    # The subcommand on its own (`pippin pull` runs the same function).
    cmd = [sys.executable, "-m", "pippin.cli.pull", *args, "--models-dir", str(models)]
    env = dict(os.environ, HF_ENDPOINT=hub.url, PYTHONPATH=str(SRC_DIR))
    env.pop("HF_TOKEN", None)
    return cmd, env


def _pull(hub: FakeHub, models: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd, env = _cmd(hub, models, *args)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_pull_and_errors(hub: FakeHub, tmp_path: Path) -> None:
    done = _pull(hub, tmp_path, "hf.co/org/tags-GGUF")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "hf.co/org/tags-GGUF:latest\n"
    lines = done.stderr.splitlines()
    assert lines[0] == "pulling manifest" and lines[-1] == "success"
    assert "pulling m-Q4_K_M.gguf: 5 bytes" in lines  # no terminal: a line per file
    assert ModelLibrary(tmp_path).require("hf.co/org/tags-GGUF").entry == "m-Q4_K_M.gguf"
    failed = _pull(hub, tmp_path, "hf.co/org/tags-GGUF:Q2_K")
    assert failed.returncode == 1 and failed.stdout == ""
    assert failed.stderr.splitlines()[-1] == (
        "pippin pull: org/tags-GGUF has no GGUF file tagged 'Q2_K'; its tags: Q4_K_M, Q8_0 "
        "(pull e.g. hf.co/org/tags-GGUF:Q4_K_M)"
    )
    missing = _pull(hub, tmp_path, "org/nothing", "--revision", "v1")
    assert missing.returncode == 1 and "repository org/nothing not found" in missing.stderr


def test_interrupted_pull_resumes(hub: FakeHub, tmp_path: Path) -> None:
    try:
        hub.add_repo("org/smol-GGUF", {GGUF: default_model_path()})
    except ModelLoadError as e:
        pytest.skip(str(e))
    release = hub.hold("org/smol-GGUF", GGUF, 25_000_000)
    cmd, env = _cmd(hub, tmp_path, "hf.co/org/smol-GGUF:Q4_1")
    # Ctrl-C as at a terminal: a suite run as a background job (`cmd &` in a script) has
    # SIGINT ignored, which its children inherit, and the pull would then run to the end.
    proc = subprocess.Popen(
        cmd,
        env=env,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    partial = tmp_path / "partial"

    def written() -> int:
        return sum(p.stat().st_size for p in partial.rglob("*.incomplete"))

    try:
        wait_for(lambda: written() > 0, "part of the file written")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        release.set()
        proc.kill()
    assert proc.returncode == 130
    assert err.splitlines()[-1] == "pippin pull: interrupted; pull again to resume"
    assert ModelLibrary(tmp_path).list() == []
    kept = written()
    done = _pull(hub, tmp_path, "hf.co/org/smol-GGUF:Q4_1")
    assert done.returncode == 0, done.stderr
    first, again = hub.gets("org/smol-GGUF", GGUF)
    assert again.range == f"bytes={kept}-"
    assert again.sent == hub.repos["org/smol-GGUF"].files[GGUF].size - kept
