"""/v1/audio/transcriptions and /translations through the `openai` SDK against a real
`pippin serve --stt-model` with the real whisper tiny.en: espeak-ng speech transcribed
with a word error rate within 15%, in every response format and streamed; audio longer
than one 30-second window; bad uploads refused with OpenAI's errors while the server
keeps serving."""

from __future__ import annotations

import io
import re
import time
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from support.errors import assert_api_error
from support.server_utils import Server, run_server
from support.whisper_models import speak, word_errors

SENTENCES = [
    "The weather is nice today and we are going to the park.",
    "Please send me the report before the meeting on Monday morning.",
    "I would like a cup of coffee with milk and no sugar.",
    "The children are playing in the garden after school.",
    "We need to buy bread, eggs and fresh vegetables at the market.",
    "My brother works as a doctor in a large hospital in the city.",
]
MAX_WER = 0.15
MAX_SECONDS = 60
MAX_MB = 3


def _read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path)) as w:
        rate = w.getframerate()
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"), rate


def _wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """One sentence (`short`), and all six with 1.5 s pauses (`long`: over 30 s)."""
    folder = tmp_path_factory.mktemp("speech")
    parts = [_read_wav(speak(s, folder / f"s{i}.wav")) for i, s in enumerate(SENTENCES)]
    rate = parts[0][1]
    pause = np.zeros(int(1.5 * rate), dtype="<i2")
    joined = np.concatenate([x for samples, _ in parts for x in (samples, pause)])
    assert joined.size / rate > 32, "the long clip must span more than one 30 s window"
    return {
        "short": (folder / "s1.wav").read_bytes(),
        "long": _wav_bytes(joined, rate),
        "long_seconds": str(joined.size / rate).encode(),
    }


@pytest.fixture(scope="module")
def server(tiny_en: Path) -> Iterator[Server]:
    with run_server(
        "--max-model-len",
        "512",
        "--stt-model",
        str(tiny_en),
        "--stt-max-seconds",
        str(MAX_SECONDS),
        "--stt-max-mb",
        str(MAX_MB),
    ) as s:
        yield s


def _wer(reference: str, hypothesis: str) -> float:
    errors, n = word_errors(reference, hypothesis)
    return errors / n


def test_long_audio_verbose_json_with_words(server: Server, clips: dict[str, bytes]) -> None:
    r = server.client().audio.transcriptions.create(
        file=("long.wav", clips["long"]),
        model="whisper-1",
        response_format="verbose_json",
        timestamp_granularities=["segment", "word"],
    )
    reference = " ".join(SENTENCES)
    wer = _wer(reference, r.text)
    assert wer <= MAX_WER, (wer, r.text)
    assert abs(r.duration - float(clips["long_seconds"])) < 0.1
    assert r.language == "english"
    segments, words = r.segments or [], r.words or []
    assert len(segments) >= len(SENTENCES) - 1
    starts = [s.start for s in segments]
    assert starts == sorted(starts) and all(s.end >= s.start for s in segments)
    # Timestamps carry across the 30-second windows: the last sentence starts past 30 s.
    assert segments[-1].start > 30 and segments[-1].end <= r.duration + 0.5
    assert "".join(s.text for s in segments).strip() == r.text
    assert _wer(reference, " ".join(w.word for w in words)) <= MAX_WER
    word_starts = [w.start for w in words]
    assert word_starts == sorted(word_starts) and words[-1].end > 30


def test_json_text_srt_vtt(server: Server, clips: dict[str, bytes]) -> None:
    client = server.client()
    short = ("s.wav", clips["short"])
    j = client.audio.transcriptions.create(file=short, model="whisper-1", language="en")
    assert _wer(SENTENCES[1], j.text) <= MAX_WER, j.text
    assert j.usage is not None and j.usage.type == "duration" and j.usage.seconds >= 3

    text = client.audio.transcriptions.create(file=short, model="whisper-1", response_format="text")
    assert text.strip() == j.text

    srt = client.audio.transcriptions.create(file=short, model="whisper-1", response_format="srt")
    stamp = r"\d\d:\d\d:\d\d,\d\d\d --> \d\d:\d\d:\d\d,\d\d\d"
    assert re.match(rf"1\n{stamp}\n\S", srt), srt
    cue_text = " ".join(block.split("\n", 2)[2] for block in srt.strip().split("\n\n"))
    assert _wer(SENTENCES[1], cue_text) <= MAX_WER

    vtt = client.audio.transcriptions.create(file=short, model="whisper-1", response_format="vtt")
    assert vtt.startswith("WEBVTT\n\n")
    assert re.search(r"\d\d:\d\d:\d\d\.\d\d\d --> \d\d:\d\d:\d\d\.\d\d\d\n\S", vtt), vtt


def test_stream_events(server: Server, clips: dict[str, bytes]) -> None:
    events = list(
        server.client().audio.transcriptions.create(
            file=("s.wav", clips["short"]), model="whisper-1", stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[-1] == "transcript.text.done" and set(kinds[:-1]) == {"transcript.text.delta"}
    deltas = "".join(e.delta for e in events[:-1])
    assert deltas == events[-1].text
    assert _wer(SENTENCES[1], events[-1].text) <= MAX_WER


def test_long_stream_sends_a_delta_per_piece(server: Server, clips: dict[str, bytes]) -> None:
    """Over 28 s, the audio is transcribed in pieces cut at pauses, each sent when done;
    meanwhile the chat model answers (transcription runs off the event loop)."""
    order: list[str] = []

    def transcribe() -> list[object]:
        stream = server.client().audio.transcriptions.create(
            file=("long.wav", clips["long"]), model="whisper-1", stream=True
        )
        got = []
        for event in stream:
            got.append(event)
            if len(got) == 1:
                order.append("first delta")
        order.append("transcript done")
        return got

    with ThreadPoolExecutor(1) as pool:
        work = pool.submit(transcribe)
        time.sleep(1.0)  # the upload is sent and its transcription under way
        server.client().chat.completions.create(
            model=server.client().models.list().data[0].id,
            messages=[{"role": "user", "content": "Say hi."}],
            max_tokens=4,
        )
        order.append("chat answered")
        events: list[Any] = work.result()
    assert order.index("chat answered") < order.index("transcript done"), order
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) >= 2 and events[-1].type == "transcript.text.done"
    assert "".join(deltas) == events[-1].text
    assert _wer(" ".join(SENTENCES), events[-1].text) <= MAX_WER, events[-1].text


def test_translation_of_english_speech(server: Server, clips: dict[str, bytes]) -> None:
    text = server.client().audio.translations.create(
        file=("s.wav", clips["short"]), model="whisper-1", response_format="text"
    )
    assert _wer(SENTENCES[1], text) <= MAX_WER


def _post(server: Server, **kw: object) -> httpx.Response:
    with server.http() as http:
        return http.post("/v1/audio/transcriptions", **kw)  # type: ignore[arg-type]


def test_bad_uploads_are_refused_and_the_server_keeps_serving(
    server: Server, clips: dict[str, bytes]
) -> None:
    model = {"model": "whisper-1"}
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8
    r = _post(server, files={"file": ("a.png", png)}, data=model)
    assert_api_error(r, 400, param="file", message="decode")
    r = _post(server, files={"file": ("a.wav", b"")}, data=model)
    assert_api_error(r, 400, param="file", message="empty")
    truncated = clips["short"][: len(clips["short"]) // 3]
    r = _post(server, files={"file": ("a.wav", truncated)}, data=model)
    assert_api_error(r, 400, param="file", message="truncated")
    # Longer than --stt-max-seconds (silence, small enough for the byte cap at 8 kHz).
    three_min = _wav_bytes(np.zeros(8000 * (MAX_SECONDS + 5), dtype="<i2"), 8000)
    r = _post(server, files={"file": ("long.wav", three_min)}, data=model)
    assert_api_error(r, 400, param="file", code="audio_too_long")
    # Over --stt-max-mb.
    big = _wav_bytes(np.zeros(MAX_MB * 2**20 // 2 + 1000, dtype="<i2"), 48000)
    r = _post(server, files={"file": ("big.wav", big)}, data=model)
    assert_api_error(r, 413, param="file", code="file_too_large")
    short = {"file": ("s.wav", clips["short"])}
    for param, data in (
        ("foo", {"foo": "1"}),
        ("include", {"include[]": "logprobs"}),
        ("chunking_strategy", {"chunking_strategy": "auto"}),
        ("language", {"language": "fr"}),
        ("temperature", {"temperature": "2"}),
        ("response_format", {"response_format": "xml"}),
        ("timestamp_granularities", {"timestamp_granularities[]": "word"}),
    ):
        assert_api_error(_post(server, files=short, data={**model, **data}), 400, param=param)
    assert_api_error(_post(server, data=model), 400, param="file")
    r = _post(server, files=short, data={"model": "no-such-model"})
    assert_api_error(r, 404, param="model")
    with server.http() as http:  # translations take no 'language'
        r = http.post("/v1/audio/translations", files=short, data={**model, "language": "en"})
    assert_api_error(r, 400, param="language")

    with pytest.raises(openai.BadRequestError):
        server.client().audio.transcriptions.create(file=("x.png", png), model="whisper-1")
    # And a good request right after all that.
    ok = server.client().audio.transcriptions.create(file=short["file"], model="whisper-1")
    assert _wer(SENTENCES[1], ok.text) <= MAX_WER


def test_models_lists_the_whisper_model(server: Server, tiny_en: Path) -> None:
    ids = {m.id for m in server.client().models.list().data}
    assert {"whisper-1", tiny_en.name} <= ids
