"""Video bytes to sampled frames, with OpenCV (blocking: run off the event loop).

OpenCV rather than PyAV: mlx-vlm (the `vision` extra) depends on opencv-python already,
its wheels carry FFmpeg, and it decodes from memory (`cv2.VideoCapture` over a file-like
object), so no second video library and no temporary file. The container is recognised
by its first bytes before FFmpeg sees it: only MP4/MOV, WebM/Matroska and AVI, never a
playlist or any format that could make FFmpeg open other URLs or files.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass

import cv2
from PIL import Image

from pippin.vision.decode import LoadedImage, check_source_pixels, finish
from pippin.vision.limits import MediaError, MediaLimits

log = logging.getLogger("pippin.vision")

FORMAT_NAMES = "MP4, MOV, WebM, MKV or AVI"


@dataclass(frozen=True)
class VideoClip:
    """The frames sampled from one video."""

    frames: tuple[LoadedImage, ...]
    timestamps: tuple[float, ...]  # seconds into the video, one per frame
    fps: float  # frames per second of video actually sampled (lower when capped)
    duration: float  # seconds


def container_of(data: bytes) -> str | None:
    """'mp4', 'webm' or 'avi' from the file's first bytes; None for anything else."""
    if len(data) >= 12 and data[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide"):
        return "mp4"
    if data[:4] == b"\x1a\x45\xdf\xa3":
        return "webm"
    if data[:4] == b"RIFF" and data[8:12] == b"AVI ":
        return "avi"
    return None


def frame_indices(total: int, native_fps: float, fps: float, max_frames: int) -> list[int]:
    """Which of ``total`` frames to keep: one every 1/``fps`` seconds from the start, or
    ``max_frames`` spread evenly over the whole clip when that would be more."""
    duration = total / native_fps
    wanted = max(1, math.ceil(duration * fps - 1e-9))
    if wanted <= max_frames:
        indices = [min(total - 1, round(k * native_fps / fps)) for k in range(wanted)]
    elif max_frames == 1:
        indices = [0]
    else:
        indices = [round(k * (total - 1) / (max_frames - 1)) for k in range(max_frames)]
    return sorted(set(indices))


def sample_frames(
    data: bytes, limits: MediaLimits, fps: float | None = None, max_frames: int | None = None
) -> VideoClip:
    """Frames of the video in ``data`` at ``fps`` (default `video_fps`), at most
    ``max_frames`` (never more than `max_video_frames`); refused when longer than
    `max_video_seconds`, unreadable or of an unaccepted container."""
    fps = limits.video_fps if fps is None else fps
    cap_frames = limits.max_video_frames
    max_frames = cap_frames if max_frames is None else min(max_frames, cap_frames)
    if not fps > 0 or not math.isfinite(fps):
        raise MediaError(f"the video frame rate must be positive, got {fps}")
    if max_frames < 1:
        raise MediaError(f"the video frame cap must be at least 1, got {max_frames}")
    if not data:
        raise MediaError("the video is empty (0 bytes)")
    if container_of(data) is None:
        raise MediaError(f"not a video, or not one of the accepted formats ({FORMAT_NAMES})")
    try:
        return _sample(data, limits, fps, max_frames)
    except MediaError:
        raise
    except Exception as e:  # untrusted bytes: a decoder error is still the file's 400
        log.debug("video decoding failed", exc_info=True)
        raise MediaError(f"the video cannot be decoded ({type(e).__name__})") from None


def _sample(data: bytes, limits: MediaLimits, fps: float, max_frames: int) -> VideoClip:
    # OpenCV keeps no reference to the stream it reads: it must outlive `capture`.
    stream = io.BytesIO(data)
    capture = cv2.VideoCapture(stream, cv2.CAP_FFMPEG, [])
    try:
        if not capture.isOpened():
            raise MediaError("the video is corrupt or its codec is not supported")
        native_fps = capture.get(cv2.CAP_PROP_FPS)
        total = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        width = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH))
        height = int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        if not (math.isfinite(native_fps) and native_fps > 0) or total < 1:
            raise MediaError("the video's frame rate or length cannot be read")
        check_source_pixels(width, height, limits, "video")
        duration = total / native_fps
        if duration > limits.max_video_seconds:
            raise MediaError(
                f"the video is {duration:.1f} s long, over this server's "
                f"{limits.max_video_seconds:g} s"
            )
        wanted = frame_indices(total, native_fps, fps, max_frames)
        frames: list[LoadedImage] = []
        times: list[float] = []
        keep = set(wanted)
        # Frame by frame rather than seeking: seeks land on keyframes in many codecs.
        for index in range(wanted[-1] + 1):
            if not capture.grab():
                break  # fewer frames than the container said: keep what was read
            if index not in keep:
                continue
            ok, bgr = capture.retrieve()
            if not ok or bgr is None:
                break
            check_source_pixels(bgr.shape[1], bgr.shape[0], limits, "video")
            rgb = cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
            frames.append(finish(Image.fromarray(rgb), limits))
            times.append(index / native_fps)
        if not frames:
            raise MediaError("the video is corrupt: no frame could be decoded")
    finally:
        capture.release()
        stream.close()
    sampled = len(frames) / duration if duration > 0 else fps
    return VideoClip(tuple(frames), tuple(times), min(fps, sampled), duration)
