"""Encoding synthesised speech into the formats of OpenAI's ``/v1/audio/speech``.

An `AudioEncoder` takes mono float32 samples chunk by chunk and returns the bytes that are
ready after each one, so a response can stream while later sentences are still being
synthesised. mp3, opus (in Ogg), aac (ADTS) and flac go through PyAV (FFmpeg's encoders);
wav and pcm are written here: pcm is raw 16-bit little-endian at the model's rate (24 kHz for
Kokoro, as OpenAI's), wav is the same behind a 44-byte header.
"""

from __future__ import annotations

import io
import struct
from typing import Literal

import numpy as np

Format = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
FORMATS: tuple[Format, ...] = ("mp3", "opus", "aac", "flac", "wav", "pcm")

MEDIA_TYPES: dict[str, str] = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}

# (container, codec) for the formats FFmpeg encodes.
_AV_FORMATS: dict[str, tuple[str, str]] = {
    "mp3": ("mp3", "libmp3lame"),
    "opus": ("ogg", "libopus"),
    "aac": ("adts", "aac"),
    "flac": ("flac", "flac"),
}

# Opus runs at these rates only; others are resampled to 48 kHz by the encoder.
_OPUS_RATES = (8000, 12000, 16000, 24000, 48000)


def to_int16(samples: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] as 16-bit integers (clipped: a model may overshoot)."""
    return (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")


def wav_header(sample_rate: int, data_bytes: int | None) -> bytes:
    """A PCM WAV header; ``data_bytes=None`` (length unknown while streaming) writes the
    largest sizes, which players read as 'until the end of the stream'."""
    data = 0xFFFFFFFF - 36 if data_bytes is None else data_bytes
    return b"RIFF" + struct.pack(
        "<I4s4sIHHIIHH4sI",
        36 + data,
        b"WAVE",
        b"fmt ",
        16,
        1,  # PCM
        1,  # mono
        sample_rate,
        sample_rate * 2,
        2,
        16,
        b"data",
        data,
    )


class _Sink(io.RawIOBase):
    """A write-only, unseekable file that hands out what was written since the last take."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        self._buf += b
        return len(b)

    def take(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class AudioEncoder:
    """Encodes one response. ``streaming=False`` writes to a seekable buffer, so the
    container can finish its header (flac's length, wav's sizes) and `finish` returns all of
    it; ``streaming=True`` returns bytes from each `encode` as soon as the muxer writes them."""

    def __init__(self, fmt: Format, sample_rate: int, *, streaming: bool) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown audio format {fmt!r}")
        self.fmt = fmt
        self.sample_rate = sample_rate
        self.streaming = streaming
        self._pcm_bytes = 0
        self._header_sent = False
        self._container = None
        self._pts = 0
        if fmt in _AV_FORMATS:
            import av

            container, codec = _AV_FORMATS[fmt]
            self._file: io.IOBase = _Sink() if streaming else io.BytesIO()
            # Ogg holds a page for a second by default: a page per 100 ms streams sooner.
            options = {"page_duration": "100000"} if container == "ogg" else {}
            self._container = av.open(self._file, mode="w", format=container, options=options)
            rate = sample_rate
            if fmt == "opus" and rate not in _OPUS_RATES:
                rate = 48000
            self._stream = self._container.add_stream(codec, rate=rate, layout="mono")
            self._av = av
        elif not streaming:
            self._chunks: list[bytes] = []

    def encode(self, samples: np.ndarray) -> bytes:
        """Add mono float32 samples; returns the bytes ready to send (empty if not streaming)."""
        if samples.size == 0:
            return b""
        if self._container is not None:
            frame = self._av.AudioFrame.from_ndarray(
                to_int16(samples)[None, :], format="s16", layout="mono"
            )
            frame.sample_rate = self.sample_rate
            frame.pts = self._pts
            self._pts += samples.size
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
            return self._take()
        data = to_int16(samples).tobytes()
        self._pcm_bytes += len(data)
        if not self.streaming:
            self._chunks.append(data)
            return b""
        if self.fmt == "wav" and not self._header_sent:
            self._header_sent = True
            return wav_header(self.sample_rate, None) + data
        return data

    def finish(self) -> bytes:
        """Flush the encoder; returns the last bytes (all of them when not streaming)."""
        if self._container is not None:
            for packet in self._stream.encode(None):
                self._container.mux(packet)
            self._container.close()
            if not self.streaming:
                assert isinstance(self._file, io.BytesIO)
                return self._file.getvalue()
            return self._take()
        if not self.streaming:
            body = b"".join(self._chunks)
            return (wav_header(self.sample_rate, len(body)) if self.fmt == "wav" else b"") + body
        if self.fmt == "wav" and not self._header_sent:  # no audio at all: a valid empty file
            self._header_sent = True
            return wav_header(self.sample_rate, 0)
        return b""

    def close(self) -> None:
        """Release the encoder without flushing (a response that was abandoned)."""
        if self._container is not None:
            try:
                self._container.close()
            except Exception:  # noqa: BLE001 - closing a half-written container may complain
                pass
            self._container = None

    def _take(self) -> bytes:
        return self._file.take() if isinstance(self._file, _Sink) else b""
