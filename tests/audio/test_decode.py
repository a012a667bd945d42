"""Decoding uploads with PyAV: the common containers and codecs come back as 16 kHz mono
of the right length and pitch; what is not audio, empty, truncated or too long is refused."""

from __future__ import annotations

import io

import numpy as np
import pytest

av = pytest.importorskip("av", reason="PyAV is in the 'audio' extra")

from pippin.audio.decode import SAMPLE_RATE, AudioError, AudioTooLong, decode_audio  # noqa: E402

RATE = 22_050  # not 16 kHz, so resampling is exercised
SECONDS = 2.0
PITCH = 440.0


def encode(fmt: str, codec: str, seconds: float = SECONDS, rate: int = RATE) -> bytes:
    """A stereo sine at `PITCH` Hz, encoded with PyAV."""
    t = np.arange(int(seconds * rate)) / rate
    wave = (0.4 * np.sin(2 * np.pi * PITCH * t)).astype(np.float32)
    stereo = np.stack([wave, wave])
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=48_000 if "opus" in codec else rate)
        stream.layout = "stereo"
        frame = av.AudioFrame.from_ndarray(stereo, format="fltp", layout="stereo")
        frame.sample_rate = rate
        resampler = av.AudioResampler(format=stream.format.name, layout="stereo", rate=stream.rate)
        for f in [*resampler.resample(frame), *resampler.resample(None)]:
            for packet in stream.encode(f):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


FORMATS = [
    ("wav", "pcm_s16le"),
    ("mp3", "libmp3lame"),
    ("ipod", "aac"),  # .m4a
    ("ogg", "libopus"),
    ("webm", "libopus"),
    ("flac", "flac"),
]


@pytest.mark.parametrize(("fmt", "codec"), FORMATS, ids=[f for f, _ in FORMATS])
def test_containers_decode_to_16k_mono(fmt: str, codec: str) -> None:
    samples = decode_audio(encode(fmt, codec))
    assert samples.dtype == np.float32 and samples.ndim == 1
    # Encoders pad a little (priming samples, whole frames).
    assert abs(samples.size / SAMPLE_RATE - SECONDS) < 0.1
    spectrum = np.abs(np.fft.rfft(samples))
    peak = np.argmax(spectrum) * SAMPLE_RATE / samples.size
    assert abs(peak - PITCH) < 5


def test_not_audio_is_refused() -> None:
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    with pytest.raises(AudioError):
        decode_audio(png)
    with pytest.raises(AudioError):
        decode_audio(b"hello, this is plain text and not a sound file at all\n" * 20)


def test_empty_is_refused() -> None:
    with pytest.raises(AudioError, match="empty"):
        decode_audio(b"")


def test_truncated_is_refused() -> None:
    wav = encode("wav", "pcm_s16le")
    with pytest.raises(AudioError):
        decode_audio(wav[:30])  # the header cut short
    with pytest.raises(AudioError, match="truncated"):
        decode_audio(wav[: len(wav) // 5])  # a fifth of the samples its header declares


def test_too_long_is_refused_before_decoding_it_all() -> None:
    with pytest.raises(AudioTooLong) as e:
        decode_audio(encode("wav", "pcm_s16le", seconds=5.0), max_seconds=2.0)
    assert e.value.limit_s == 2.0
    # Within the cap it decodes.
    assert decode_audio(encode("flac", "flac"), max_seconds=3.0).size > 0


def test_quiet_cuts_fall_in_pauses() -> None:
    from pippin.audio.stt import quiet_cuts

    rng = np.random.default_rng(0)
    # 70 s of noise with silent half-seconds at 25 s and 50 s.
    audio = (0.3 * rng.standard_normal(70 * SAMPLE_RATE)).astype(np.float32)
    for at in (25, 50):
        audio[at * SAMPLE_RATE : at * SAMPLE_RATE + SAMPLE_RATE // 2] = 0
    cuts = quiet_cuts(audio)
    assert cuts[0] == 0 and cuts[-1] == audio.size and len(cuts) == 4
    for cut, at in zip(cuts[1:-1], (25, 50)):
        assert at * SAMPLE_RATE <= cut <= at * SAMPLE_RATE + SAMPLE_RATE // 2
    assert all(b - a <= 28 * SAMPLE_RATE for a, b in zip(cuts, cuts[1:]))
    assert quiet_cuts(audio[: 10 * SAMPLE_RATE]) == [0, 10 * SAMPLE_RATE]
