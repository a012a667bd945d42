"""`pippin serve`'s image and video flags (vLLM's names where vLLM has the setting) and the
`MediaLimits` they give."""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path
from typing import Any

from pippin.argtypes import json_object, non_negative_int, positive_float, positive_int
from pippin.vision.limits import MIB, MediaLimits


def parse_mm_limits(text: str) -> dict[str, int]:
    """vLLM's `--limit-mm-per-prompt`: '{"image": 4, "video": 1}'; a modality may also be
    given as {"count": N} (vLLM's newer form, whose size hints pippin does not use)."""
    value = json_object(text)
    out: dict[str, int] = {}
    for key, item in value.items():
        if key not in ("image", "video"):
            raise argparse.ArgumentTypeError(
                f"unknown modality {key!r}: pippin takes images and videos ('image', 'video')"
            )
        count: Any = item.get("count") if isinstance(item, dict) else item
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise argparse.ArgumentTypeError(f"{key}: must be a count of 0 or more, got {item!r}")
        out[key] = count
    return out


def host_names(text: str) -> list[str]:
    """Comma-separated host names in their ASCII (IDNA) form, as URLs are resolved:
    'bücher.example' is 'xn--bcher-kva.example'."""
    out = []
    for name in text.split(","):
        name = name.strip().rstrip(".").lower()
        if not name:
            continue
        try:
            out.append(name.encode("idna").decode("ascii"))
        except UnicodeError:
            raise argparse.ArgumentTypeError(f"not a host name: {name!r}") from None
    return out


def _local_folder(text: str) -> Path:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"not a folder: {text}")
    return path.resolve()


def ca_bundle(text: str) -> Path:
    """A PEM file of CA certificates, read now: a wrong one is refused at start-up rather
    than failing every https fetch."""
    path = Path(text).expanduser()
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"not a file: {text}")
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as e:
        raise argparse.ArgumentTypeError(
            f"{text}: not a PEM file of CA certificates ({e})"
        ) from None
    return path.resolve()


def add_media_flags(parser: argparse.ArgumentParser) -> None:
    """The media flags of `pippin serve` (vLLM's names where vLLM has the setting)."""
    d = MediaLimits()
    g = parser.add_argument_group(
        "images and video",
        "what media a request may bring (vision models); see docs/reliability.md for the "
        "fetching rules",
    )
    g.add_argument(
        "--limit-mm-per-prompt",
        type=parse_mm_limits,
        default={},
        metavar="JSON",
        help=f'images and videos per request, e.g. \'{{"image": 4, "video": 1}}\' '
        f"(default: {d.max_images} images, {d.max_videos} video)",
    )
    g.add_argument(
        "--allowed-local-media-path",
        type=_local_folder,
        metavar="DIR",
        help="let requests name local files (file:// URLs or paths) under this folder; "
        "never outside it, also not through '..' or symlinks (default: no local files)",
    )
    g.add_argument(
        "--allowed-media-domains",
        type=host_names,
        nargs="+",
        metavar="HOST",
        help="fetch remote media only from these host names (exact match, also after "
        "redirects; space- or comma-separated); private addresses stay refused",
    )
    g.add_argument(
        "--max-image-mb",
        metavar="MB",
        type=positive_float,
        default=d.max_image_bytes / MIB,
        help="largest encoded image, in MiB (default: %(default)s)",
    )
    g.add_argument(
        "--max-image-pixels",
        metavar="N",
        type=positive_int,
        default=d.max_pixels,
        help="larger images (and video frames) are downscaled to this many pixels, aspect "
        "kept (default: %(default)s)",
    )
    g.add_argument(
        "--max-source-image-pixels",
        metavar="N",
        type=positive_int,
        default=d.max_source_pixels,
        help="images with more pixels than this are refused rather than decoded "
        "(default: %(default)s, 8000x8000)",
    )
    g.add_argument(
        "--max-video-mb",
        metavar="MB",
        type=positive_float,
        default=d.max_video_bytes / MIB,
        help="largest video file, in MiB (default: %(default)s)",
    )
    g.add_argument(
        "--max-video-seconds",
        metavar="S",
        type=positive_float,
        default=d.max_video_seconds,
        help="longer videos are refused (default: %(default)s)",
    )
    g.add_argument(
        "--max-video-frames",
        metavar="N",
        type=positive_int,
        default=d.max_video_frames,
        help="frames sampled from one video at most (default: %(default)s)",
    )
    g.add_argument(
        "--video-fps",
        metavar="FPS",
        type=positive_float,
        default=d.video_fps,
        help="frames sampled per second of video (default: %(default)s)",
    )
    g.add_argument(
        "--media-fetch-timeout",
        metavar="S",
        type=positive_float,
        default=d.fetch_timeout_s,
        help="seconds one remote image or video may take to fetch (default: %(default)s)",
    )
    g.add_argument(
        "--media-ca-bundle",
        type=ca_bundle,
        metavar="FILE",
        help="a PEM file of more CAs that https media may be signed by (a company CA), "
        "trusted beside the public ones, or beside SSL_CERT_FILE / SSL_CERT_DIR's where "
        "those are set (default: none)",
    )
    g.add_argument(
        "--media-max-redirects",
        metavar="N",
        type=non_negative_int,
        default=d.max_redirects,
        help="redirects followed when fetching media (default: %(default)s)",
    )


def limits_from_args(args: argparse.Namespace) -> MediaLimits:
    """The `MediaLimits` that `add_media_flags`' flags ask for."""
    per_prompt: dict[str, int] = args.limit_mm_per_prompt or {}
    d = MediaLimits()
    domains = None
    if args.allowed_media_domains is not None:
        domains = tuple(dict.fromkeys(n for names in args.allowed_media_domains for n in names))
    return MediaLimits(
        max_images=per_prompt.get("image", d.max_images),
        max_videos=per_prompt.get("video", d.max_videos),
        max_image_bytes=int(args.max_image_mb * MIB),
        max_pixels=args.max_image_pixels,
        max_video_seconds=args.max_video_seconds,
        max_video_frames=args.max_video_frames,
        video_fps=args.video_fps,
        fetch_timeout_s=args.media_fetch_timeout,
        max_redirects=args.media_max_redirects,
        allowed_local_media_path=args.allowed_local_media_path,
        allowed_domains=domains,
        max_source_pixels=args.max_source_image_pixels,
        max_video_bytes=int(args.max_video_mb * MIB),
        ca_bundle=args.media_ca_bundle,
    )
