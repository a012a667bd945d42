"""Cutting speech input into pieces at sentence ends, so that the first sentence's audio
can be sent while the rest is still being synthesised."""

from __future__ import annotations

import re

# A sentence ends at . ! ? … (and their CJK forms), with any closing quotes or brackets,
# before whitespace; a line break ends one too (as mlx-audio's own pipelines split).
_END = re.compile(r"([.!?…。！？][\"'”’)\]]*)\s+|\s*\n\s*")


def _sentences(text: str) -> list[str]:
    parts = _END.split(text)  # text, end mark (or None), text, ...
    ends = [*parts[1::2], ""]
    return [body + (end or "") for body, end in zip(parts[0::2], ends, strict=True)]


def pieces(text: str, max_chars: int = 400) -> list[str]:
    """The sentences of ``text``, stripped, empty ones dropped; a sentence longer than
    ``max_chars`` is cut at its last comma or space before the limit (else at the limit)."""
    out: list[str] = []
    for sentence in _sentences(text):
        sentence = sentence.strip()
        while len(sentence) > max_chars:
            cut = max(sentence.rfind(",", 0, max_chars), sentence.rfind(" ", 0, max_chars))
            cut = cut + 1 if cut > 0 else max_chars
            out.append(sentence[:cut].strip())
            sentence = sentence[cut:].strip()
        if sentence:
            out.append(sentence)
    return out
