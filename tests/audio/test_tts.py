"""Text to speech in process: pippin's `TTSModel` against mlx-audio's own ``generate`` on
the same tiny random KittenTTS, the sentence splitter, and every encoder decoded by PyAV."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_audio")
av = pytest.importorskip("av")

from support.tts_models import VOICES, build_kitten  # noqa: E402

from pippin.audio.encode import FORMATS, AudioEncoder, to_int16  # noqa: E402
from pippin.audio.sentences import pieces  # noqa: E402

RATE = 24000


@pytest.fixture(scope="module")
def kitten(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_kitten(tmp_path_factory.mktemp("kitten"))


def test_pieces_cut_at_sentence_ends() -> None:
    text = 'Hello there. How are you?  I am fine!\nShe said "stop." Then 3.5 apples… ok'
    assert pieces(text) == [
        "Hello there.",
        "How are you?",
        "I am fine!",
        'She said "stop."',
        "Then 3.5 apples…",
        "ok",
    ]
    assert pieces("   \n  ") == []
    long = "word, " * 200
    cut = pieces(long, max_chars=100)
    assert all(len(p) <= 100 for p in cut)
    assert " ".join(cut).split() == long.split()


def test_synthesis_equals_mlx_audio_generate(kitten: Path) -> None:
    import mlx.core as mx
    from mlx_audio.tts.utils import load_model

    from pippin.audio.tts import TTSModel

    text = "Hello world, this is a test."
    ours = TTSModel(kitten, name="kitten")
    assert ours.voices == sorted(VOICES)
    assert ours.sample_rate == RATE
    assert not ours.takes_instructions and ours.takes_speed
    ref = load_model(kitten, strict=True)
    for voice, speed in ((VOICES[0], 1.0), (VOICES[1], 1.7)):
        # The source module draws noise: the same seed gives the same draws.
        mx.random.seed(7)
        got = ours.synthesize(text, voice, speed, None)
        mx.random.seed(7)
        want = np.concatenate(
            [np.array(r.audio) for r in ref.generate(text, voice=voice, speed=speed)]
        )
        assert got.samples.dtype == np.float32
        np.testing.assert_array_equal(got.samples, want)
        assert got.tokens > 0
    slow = ours.synthesize(text, VOICES[0], 0.5, None).samples.size
    fast = ours.synthesize(text, VOICES[0], 2.0, None).samples.size
    assert slow > fast


def decode(data: bytes) -> tuple[int, np.ndarray, str]:
    """(sample rate, mono samples, codec name) of an encoded file, by PyAV."""
    with av.open(io.BytesIO(data)) as c:
        stream = c.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in c.decode(stream)]
        return stream.rate, np.concatenate(frames), stream.codec_context.name


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_decodes_to_its_length(fmt: str, streaming: bool) -> None:
    t = np.arange(int(RATE * 1.3)) / RATE
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    enc = AudioEncoder(fmt, RATE, streaming=streaming)  # type: ignore[arg-type]
    parts = [enc.encode(chunk) for chunk in np.array_split(tone, 5)]
    parts.append(enc.finish())
    data = b"".join(parts)
    if streaming:
        assert sum(1 for p in parts[:-1] if p) >= 2, "bytes must come out as chunks go in"
    if fmt == "pcm":
        np.testing.assert_array_equal(np.frombuffer(data, "<i2"), to_int16(tone))
        return
    rate, samples, _ = decode(data)
    # Opus decodes at 48 kHz whatever it was fed (RFC 7845); the others keep 24 kHz.
    assert rate == (48000 if fmt == "opus" else RATE)
    seconds = samples.size / rate
    assert abs(seconds - 1.3) < 0.08, seconds
    if fmt in ("wav", "flac"):  # lossless
        np.testing.assert_array_equal(samples.astype(np.int16), to_int16(tone))


def test_kokoro_equals_mlx_audio_generate(tmp_path: Path) -> None:
    """Kokoro through pippin: voices from its voices/ folder, the G2P language from the
    voice's first letter (Kokoro's naming), audio equal to mlx-audio's own generate."""
    pytest.importorskip("misaki")
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.tts.utils import load_model
    from support.tts_models import KOKORO_VOICES, build_kokoro

    from pippin.audio.tts import TTSModel

    path = build_kokoro(tmp_path / "kokoro")
    ours = TTSModel(path)
    assert ours.voices == sorted(KOKORO_VOICES)
    assert ours.sample_rate == RATE and ours.takes_speed and not ours.takes_instructions
    ref = load_model(path, strict=True)
    # The weights went through Kokoro's sanitize back to what was built.
    ref_params = dict(tree_flatten(ref.parameters()))
    for k, v in tree_flatten(ours.model.parameters()):
        assert mx.array_equal(v, ref_params[k]), k
    text = "Hola, ¿cómo estás?"
    mx.random.seed(3)
    got = ours.synthesize(text, "ef_dora", 1.0, None)
    mx.random.seed(3)
    want = np.concatenate(
        [np.array(r.audio).reshape(-1) for r in ref.generate(text, voice="ef_dora", lang_code="e")]
    )
    assert got.samples.size > 0
    np.testing.assert_array_equal(got.samples, want)
