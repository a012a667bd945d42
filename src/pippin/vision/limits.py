"""`MediaLimits`: what images and videos a request may bring (set by `pippin serve`'s
media flags, `pippin.cli.media_flags`).

Standard library only: the server's settings hold a `MediaLimits` on a core install too,
where Pillow and OpenCV (the `vision` extra) are absent.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024


class MediaError(ValueError):
    """An image or video that cannot be used; the message says what is wrong with it, the
    caller adds which content part it was (the API answers 400 with both)."""


@dataclass(frozen=True)
class MediaLimits:
    """Caps on the media of one request. ``MediaLimits()`` is the safe default: remote
    media from public addresses only, no local files."""

    # Images and videos in one request (--limit-mm-per-prompt, vLLM's flag).
    max_images: int = 8
    max_videos: int = 1
    # Bytes of one encoded image (also a data: URL's decoded bytes) and of one video.
    max_image_bytes: int = 20 * MIB
    # Decoded images with more pixels are downscaled (aspect kept) to fit; video frames too.
    max_pixels: int = 2048 * 2048
    # Videos longer than this are refused; frames are sampled at video_fps up to
    # max_video_frames (spread evenly over the clip when the cap is hit).
    max_video_seconds: float = 60.0
    max_video_frames: int = 32
    video_fps: float = 2.0
    # One remote fetch, redirects included, gets this long and this many redirects.
    fetch_timeout_s: float = 15.0
    max_redirects: int = 5
    # file:// URLs and plain paths are served only from under this folder (None: never).
    allowed_local_media_path: Path | None = None
    # When set, remote media only from these host names (every redirect hop too).
    allowed_domains: tuple[str, ...] | None = None
    # Images (or video frames) with more source pixels are refused, not downscaled: a
    # decompression bomb costs its full size in memory before it can be shrunk.
    # Anthropic refuses images over 8000 px a side; this is the same area.
    max_source_pixels: int = 8000 * 8000
    max_video_bytes: int = 64 * MIB
    # More CAs that https media may be signed by (--media-ca-bundle, a PEM file), on top
    # of the public ones (or of SSL_CERT_FILE / SSL_CERT_DIR where those are set).
    ca_bundle: Path | None = None
    # Tests only, never set from the command line: fetch from any address (a local test
    # server), or treat these host names as public whatever they resolve to (so a test can
    # redirect from a "public" name on 127.0.0.1 to a refused address).
    allow_private_for_tests: bool = False
    public_hosts_for_tests: frozenset[str] = frozenset()
