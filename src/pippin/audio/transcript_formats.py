"""A `Transcript` in OpenAI's response formats: json, text, srt, vtt, verbose_json."""

from __future__ import annotations

from typing import Any

from pippin.audio.stt import Transcript


def _stamp(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def to_srt(t: Transcript) -> str:
    blocks = [
        f"{i}\n{_stamp(s['start'], ',')} --> {_stamp(s['end'], ',')}\n{s['text'].strip()}\n"
        for i, s in enumerate(t.segments, start=1)
    ]
    return "\n".join(blocks)


def to_vtt(t: Transcript) -> str:
    blocks = [
        f"{_stamp(s['start'], '.')} --> {_stamp(s['end'], '.')}\n{s['text'].strip()}\n"
        for s in t.segments
    ]
    return "WEBVTT\n\n" + "\n".join(blocks)


def _segment(i: int, s: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": i,
        "seek": int(s.get("seek", 0)),
        "start": float(s["start"]),
        "end": float(s["end"]),
        "text": s["text"],
        "tokens": [int(x) for x in s.get("tokens", [])],
        "temperature": float(s.get("temperature", 0.0)),
        "avg_logprob": float(s.get("avg_logprob", 0.0)),
        "compression_ratio": float(s.get("compression_ratio", 0.0)),
        "no_speech_prob": float(s.get("no_speech_prob", 0.0)),
    }


def usage(t: Transcript) -> dict[str, Any]:
    return {"type": "duration", "seconds": round(t.duration + 0.4999)}  # billed whole seconds


def to_json(t: Transcript) -> dict[str, Any]:
    return {"text": t.text, "usage": usage(t)}


def to_verbose_json(t: Transcript, task: str, granularities: set[str]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "task": task,
        "language": t.language,
        "duration": round(t.duration, 3),
        "text": t.text,
    }
    if "segment" in granularities:
        body["segments"] = [_segment(i, s) for i, s in enumerate(t.segments)]
    if "word" in granularities:
        body["words"] = t.words()
    body["usage"] = usage(t)
    return body
