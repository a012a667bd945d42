"""Bytes of a media reference that needs no network: ``data:`` URLs and local files.

Local files are read only from under `MediaLimits.allowed_local_media_path`: the path is
resolved (``..`` and every symlink followed) and must still lie under that folder, and
only a regular file is read (never a device or a FIFO), at most the byte cap.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from pathlib import Path
from urllib.parse import unquote, unquote_to_bytes, urlsplit

from pippin.vision.limits import MIB, MediaError, MediaLimits

_SPACE = re.compile(r"\s+")


def scheme_of(url: str) -> str:
    """'data', 'http', 'https', 'file', or '' for a plain path (``C:\\x`` is no scheme)."""
    head, sep, _ = url.partition(":")
    if not sep or len(head) < 2 or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", head):
        return ""
    return head.lower()


def _too_big(what: str, size: int, cap: int) -> MediaError:
    return MediaError(f"the {what} is {size / MIB:.1f} MiB, over this server's {cap / MIB:.1f} MiB")


def b64decode(data: str, cap: int, what: str) -> bytes:
    """Base64 (whitespace and missing padding tolerated) to bytes, refused before decoding
    when it would exceed ``cap`` bytes."""
    text = _SPACE.sub("", data)
    if len(text) * 3 // 4 > cap + 2:
        raise _too_big(what, len(text) * 3 // 4, cap)
    text += "=" * (-len(text) % 4)
    try:
        raw = base64.b64decode(
            text, altchars=b"-_" if ("-" in text or "_" in text) else None, validate=True
        )
    except (binascii.Error, ValueError):
        raise MediaError(f"the {what} data is not valid base64") from None
    if len(raw) > cap:
        raise _too_big(what, len(raw), cap)
    return raw


def parse_data_url(url: str, cap: int, what: str) -> tuple[str | None, bytes]:
    """(media type or None, bytes) of a ``data:[<type>][;base64],<data>`` URL."""
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError("malformed data: URL (no ',' before the data)")
    params = [p.strip() for p in head.split(";")]
    media_type = params[0].lower() or None
    if "base64" in (p.lower() for p in params[1:]):
        return media_type, b64decode(payload, cap, what)
    if len(payload) > 3 * cap:
        raise _too_big(what, len(payload) // 3, cap)
    raw = unquote_to_bytes(payload)
    if len(raw) > cap:
        raise _too_big(what, len(raw), cap)
    return media_type, raw


def local_path(url: str, limits: MediaLimits) -> Path:
    """The real path a file:// URL or plain path names, refused unless it lies under
    ``allowed_local_media_path`` once every ``..`` and symlink is resolved."""
    root = limits.allowed_local_media_path
    if root is None:
        raise MediaError(
            "local files are not allowed: only http(s) and data: URLs (the server's "
            "--allowed-local-media-path enables files under one folder)"
        )
    if scheme_of(url) == "file":
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost"):
            raise MediaError(f"file:// URLs name no host, got {parts.netloc!r}")
        raw = unquote(parts.path)
    else:
        raw = url
    if "\x00" in raw:
        raise MediaError("the file path contains a NUL character")
    root = Path(os.path.realpath(root))
    # A relative path is relative to the allowed folder, never to the server's cwd.
    path = Path(os.path.realpath(root / raw))
    if path != root and root not in path.parents:
        raise MediaError("the file is outside the folder this server allows media from")
    return path


def read_local(url: str, limits: MediaLimits, cap: int, what: str) -> bytes:
    """Bytes of a local file under the allowed folder (blocking: run off the loop)."""
    path = local_path(url, limits)
    # O_NOFOLLOW: a symlink swapped in after the check above is refused, not followed;
    # O_NONBLOCK: opening a FIFO does not wait for a writer (it is then refused below).
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise MediaError("no such file under the allowed media folder") from None
    except OSError as e:
        raise MediaError(f"cannot open the file ({e.strerror})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise MediaError("not a regular file")
    if info.st_size > cap:
        os.close(fd)
        raise _too_big(what, info.st_size, cap)
    with os.fdopen(fd, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise _too_big(what, len(data), cap)
    return data
