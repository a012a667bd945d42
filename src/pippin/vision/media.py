"""The media a request brings: images and videos from http(s), data: URLs and local files,
checked against `MediaLimits` and decoded off the event loop.

The interface the API layer uses; the work is in `source` (data: URLs, local files),
`fetch` (remote, SSRF rules), `decode` (Pillow) and `video` (OpenCV). Importing this
module needs neither Pillow nor OpenCV (the `vision` extra): the settings hold a
`MediaLimits` on every install; loading media without them is a clear error.
"""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import TYPE_CHECKING

from pippin.vision.limits import MediaError, MediaLimits
from pippin.vision.source import b64decode, parse_data_url, read_local, scheme_of

if TYPE_CHECKING:
    from pippin.vision.decode import LoadedImage
    from pippin.vision.video import VideoClip

__all__ = [
    "LoadedImage",
    "MediaError",
    "MediaLimits",
    "image_from_base64",
    "load_image",
    "load_video",
    "load_video_clip",
]


def __getattr__(name: str) -> object:
    # `LoadedImage` lives with Pillow's code; imported when first asked for.
    if name == "LoadedImage":
        from pippin.vision.decode import LoadedImage

        return LoadedImage
    raise AttributeError(name)


async def media_bytes(
    url: str, limits: MediaLimits, cap: int, what: str
) -> tuple[str | None, bytes]:
    """(declared media type or None, bytes) of an http(s), data: or local reference."""
    if not isinstance(url, str) or not url.strip():
        raise MediaError(f"the {what} URL is empty")
    url = url.strip()
    scheme = scheme_of(url)
    if scheme == "data":  # decoding megabytes of base64 is blocking work too
        return await asyncio.to_thread(parse_data_url, url, cap, what)
    if scheme in ("http", "https"):
        from pippin.vision.fetch import fetch_bytes

        _content_type, data = await fetch_bytes(url, limits, cap, what)
        return None, data  # the bytes say what they are; servers' Content-Type often lies
    if scheme in ("file", ""):
        return None, await asyncio.to_thread(read_local, url, limits, cap, what)
    raise MediaError(f"unsupported URL scheme {scheme!r}: send an http(s) or data: URL")


def _decoder() -> ModuleType:
    try:
        from pippin.vision import decode
    except ImportError as e:
        raise MediaError(
            f"this server cannot decode images ({e}); install pippin[vision]"
        ) from None
    return decode


async def load_image(url: str, limits: MediaLimits) -> LoadedImage:
    """An image from an http(s) URL, a data: URL or (when allowed) a local file."""
    media_type, data = await media_bytes(url, limits, limits.max_image_bytes, "image")
    if media_type is not None and not media_type.startswith("image/"):
        raise MediaError(f"the data: URL's type {media_type!r} is not an image type")
    decode = _decoder()
    # The bytes say what they are: a data: URL's image type is not held against them
    # (clients label JPEGs image/png), unlike Anthropic's base64 media_type below.
    return await asyncio.to_thread(decode.decode_image, data, limits)


async def image_from_base64(data: str, media_type: str | None, limits: MediaLimits) -> LoadedImage:
    """An image sent inline as base64 (Anthropic's ``source.type: base64``); a given
    ``media_type`` must match what the bytes are."""
    if not isinstance(data, str) or not data:
        raise MediaError("the image data is empty")
    raw = await asyncio.to_thread(b64decode, data, limits.max_image_bytes, "image")
    decode = _decoder()
    return await asyncio.to_thread(decode.decode_image, raw, limits, media_type)


async def load_video(
    url: str,
    limits: MediaLimits,
    fps: float | None = None,
    max_frames: int | None = None,
) -> list[LoadedImage]:
    """Frames of a video, sampled at ``fps`` (default `MediaLimits.video_fps`) up to
    ``max_frames`` (default and ceiling `MediaLimits.max_video_frames`)."""
    return list((await load_video_clip(url, limits, fps, max_frames)).frames)


async def load_video_clip(
    url: str,
    limits: MediaLimits,
    fps: float | None = None,
    max_frames: int | None = None,
) -> VideoClip:
    """`load_video` with the frames' timestamps and the rate they were sampled at (what
    models with temporal position ids, such as Qwen2.5-VL, need)."""
    _media_type, data = await media_bytes(url, limits, limits.max_video_bytes, "video")
    try:
        from pippin.vision import video
    except ImportError as e:
        raise MediaError(
            f"this server cannot decode videos ({e}); install pippin[vision]"
        ) from None
    return await asyncio.to_thread(video.sample_frames, data, limits, fps, max_frames)
