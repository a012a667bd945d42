"""Image bytes to a checked, size-capped RGB picture (Pillow), and its content hash.

Blocking: callers run it off the event loop (`asyncio.to_thread`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import struct
import warnings
from dataclasses import dataclass

from PIL import Image, ImageOps, UnidentifiedImageError

from pippin.vision.limits import MediaError, MediaLimits

log = logging.getLogger("pippin.vision")

# Pillow warns (rather than raising) about images between its own bomb limit and twice it;
# pippin checks every image's pixel count itself (`check_source_pixels`, right after the
# header is read), so the warning says nothing. Set once here: `warnings.catch_warnings`
# per call is not thread-safe, and decoding runs in worker threads.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

# What the OpenAI and Anthropic APIs take (PNG, JPEG, GIF, WebP), BMP, and MPO (the JPEG
# variant of phone cameras). Never every format Pillow knows: EPS would run Ghostscript,
# and the rarer decoders are where image-library bugs live.
# (Pillow opens MPO through its JPEG opener: it is no opener of its own.)
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
FORMAT_NAMES = "PNG, JPEG, GIF, WebP or BMP"
MEDIA_TYPES = {
    "image/png": ("PNG",),
    "image/jpeg": ("JPEG", "MPO"),
    "image/jpg": ("JPEG", "MPO"),
    "image/gif": ("GIF",),
    "image/webp": ("WEBP",),
    "image/bmp": ("BMP",),
}
# Transparent pixels become white, as vLLM does (RGBA to RGB on a white background).
BACKGROUND = (255, 255, 255)


@dataclass(frozen=True)
class LoadedImage:
    """A decoded picture ready for a vision encoder."""

    image: Image.Image  # RGB, already downscaled to `MediaLimits.max_pixels`
    sha256: str  # of mode, size and pixels: equal pictures have equal hashes

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def content_hash(image: Image.Image) -> str:
    """sha256 of the decoded picture (not of the file: the same picture as PNG and as a
    data: URL, or fetched twice, hashes the same)."""
    width, height = image.size
    digest = hashlib.sha256(f"{image.mode}:{width}x{height}:".encode())
    digest.update(image.tobytes())
    return digest.hexdigest()


def fit_pixels(image: Image.Image, max_pixels: int) -> Image.Image:
    """``image`` shrunk (aspect kept, bicubic as the HF processors resize) to at most
    ``max_pixels`` pixels; unchanged when it already fits."""
    width, height = image.size
    if width * height <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (width * height))
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB; transparency composited over white rather than dropped (dropping it turns
    transparent areas into whatever colour they hold, often black)."""
    if image.mode == "RGB":
        return image
    if image.mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
    if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGB", rgba.size, BACKGROUND)
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return image.convert("RGB")


def check_source_pixels(width: int, height: int, limits: MediaLimits, what: str) -> None:
    if width * height > limits.max_source_pixels:
        raise MediaError(
            f"the {what} is {width}x{height} pixels, more than this server decodes "
            f"({limits.max_source_pixels:,} pixels); send a smaller one"
        )
    if width < 1 or height < 1:
        raise MediaError(f"the {what} has no pixels ({width}x{height})")


def finish(image: Image.Image, limits: MediaLimits) -> LoadedImage:
    """A decoded picture as a `LoadedImage`: RGB, downscaled, hashed."""
    image = fit_pixels(to_rgb(image), limits.max_pixels)
    return LoadedImage(image=image, sha256=content_hash(image))


# What Pillow raises on a damaged file: its decoders use all of these.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, IndexError)


def decode_image(data: bytes, limits: MediaLimits, media_type: str | None = None) -> LoadedImage:
    """Checks ``data`` is a whole image of an accepted format (and of ``media_type`` when
    the client named one) within the pixel limit, and decodes its first frame."""
    if not data:
        raise MediaError("the image is empty (0 bytes)")
    wanted = FORMATS
    if media_type is not None:
        declared = media_type.split(";")[0].strip().lower()
        if declared not in MEDIA_TYPES:
            raise MediaError(
                f"unsupported image media type {media_type!r}; send image/png, image/jpeg, "
                "image/gif, image/webp or image/bmp"
            )
        wanted = MEDIA_TYPES[declared]
    kind = "image"
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as probe:
            kind = f"{probe.format} image"
            if probe.format not in wanted:
                raise MediaError(
                    f"the data is a {probe.format} image, not the declared {media_type}"
                )
            check_source_pixels(*probe.size, limits, kind)
            probe.verify()  # the whole file: checksums, truncation
        with Image.open(io.BytesIO(data), formats=FORMATS) as image:
            upright = ImageOps.exif_transpose(image)  # as a browser shows it (and loaded)
            return finish(upright, limits)
    except MediaError:
        raise
    except UnidentifiedImageError:
        raise MediaError(
            f"not an image, or not one of the accepted formats ({FORMAT_NAMES})"
        ) from None
    except Image.DecompressionBombError:
        raise MediaError(
            "the image has more pixels than this server decodes "
            f"({limits.max_source_pixels:,} pixels); send a smaller one"
        ) from None
    except _DECODE_ERRORS as e:
        raise MediaError(f"the {kind} is corrupt or truncated ({e})") from None
    except Exception as e:  # untrusted bytes: a decoder bug is still the file's 400
        log.debug("image decoding failed", exc_info=True)
        raise MediaError(f"the {kind} cannot be decoded ({type(e).__name__})") from None
