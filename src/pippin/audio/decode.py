"""Decode an uploaded audio file to 16 kHz mono float32 samples with PyAV (FFmpeg's
demuxers and decoders: wav, mp3, m4a/aac, ogg/opus/vorbis, webm, flac, ...).

Anything that is not audio, holds no samples, or breaks off mid-stream raises
`AudioError`; audio longer than the cap raises `AudioTooLong` as soon as the cap is
passed (by the container's declared duration, else while decoding), so a long file is
never decoded whole.
"""

from __future__ import annotations

import io

import numpy as np

SAMPLE_RATE = 16_000


class AudioError(ValueError):
    """The bytes are not a decodable audio file."""


class AudioTooLong(AudioError):
    def __init__(self, limit_s: float, seconds: float | None = None) -> None:
        self.limit_s = limit_s
        self.seconds = seconds
        what = f"{seconds:.0f} s" if seconds is not None else "more than that"
        super().__init__(f"the audio is longer than {limit_s:g} s ({what})")


def decode_audio(
    data: bytes, *, max_seconds: float | None = None, rate: int = SAMPLE_RATE
) -> np.ndarray:
    """Mono float32 samples at ``rate`` (16 kHz by default) of the first audio stream in
    ``data``."""
    import av

    if not data:
        raise AudioError("the file is empty")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.FFmpegError, ValueError, UnicodeDecodeError) as e:
        raise AudioError(f"not an audio file this server can decode ({_why(e)})") from None
    with container:
        if not container.streams.audio:
            raise AudioError("the file has no audio stream")
        stream = container.streams.audio[0]
        declared = _declared_seconds(container, stream)
        if max_seconds is not None and declared is not None and declared > max_seconds + 1:
            raise AudioTooLong(max_seconds, declared)
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)
        limit = None if max_seconds is None else int(max_seconds * rate)
        chunks: list[np.ndarray] = []
        total = 0
        try:
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    chunks.append(out.to_ndarray().reshape(-1))
                    total += chunks[-1].size
                if limit is not None and total > limit:
                    raise AudioTooLong(max_seconds or 0.0)
            for out in resampler.resample(None):
                chunks.append(out.to_ndarray().reshape(-1))
        except av.FFmpegError as e:
            raise AudioError(f"the audio is damaged or truncated ({_why(e)})") from None
    samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
    if samples.size == 0:
        raise AudioError("the file holds no audio samples (empty or truncated)")
    _check_riff_size(data)
    if limit is not None and samples.size > limit:
        raise AudioTooLong(max_seconds or 0.0, samples.size / rate)
    return samples.astype(np.float32, copy=False)


def _check_riff_size(data: bytes) -> None:
    """A WAV whose RIFF header declares more bytes than arrived was cut off in transfer
    (FFmpeg would quietly decode the part that is there)."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    declared = int.from_bytes(data[4:8], "little") + 8
    if declared not in (8, 0xFFFFFFFF + 8) and declared > len(data):  # 0, ~0: size unknown
        raise AudioError(
            f"the audio is truncated: {len(data)} of the {declared} bytes its header declares"
        )


def _declared_seconds(container: object, stream: object) -> float | None:
    duration, base = getattr(stream, "duration", None), getattr(stream, "time_base", None)
    if duration is not None and base is not None:
        return float(duration * base)
    total = getattr(container, "duration", None)  # microseconds
    return total / 1_000_000 if total else None


def _why(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    # FFmpeg's messages end with the file name, here a memory buffer: not useful.
    return text.split(": '<")[0][:200]
