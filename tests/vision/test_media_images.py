"""Image decoding and data: URLs (pippin.vision.decode, pippin.vision.source)."""

from __future__ import annotations

import asyncio
import base64
from urllib.parse import quote_from_bytes

import pytest

pytest.importorskip("PIL")

from media_helpers import blank_png, data_url, encode, picture, png_claiming  # noqa: E402
from PIL import Image  # noqa: E402

from pippin.vision.media import MediaError, MediaLimits, image_from_base64, load_image  # noqa: E402

LIMITS = MediaLimits()


def load(url: str, limits: MediaLimits = LIMITS):  # noqa: ANN201
    return asyncio.run(load_image(url, limits))


def test_data_url_png_decodes_to_rgb() -> None:
    got = load(data_url(encode(picture((40, 30)))))
    assert got.image.mode == "RGB" and got.image.size == (40, 30)
    assert got.image.getpixel((39, 29)) == (200, 30, 30)


def test_equal_pictures_hash_equal_whatever_the_encoding() -> None:
    image = picture((40, 30))
    png = load(data_url(encode(image, "PNG")))
    bmp = load(data_url(encode(image, "BMP"), "image/bmp"))
    b64 = asyncio.run(
        image_from_base64(base64.b64encode(encode(image)).decode(), "image/png", LIMITS)
    )
    other = load(data_url(encode(picture((40, 30), (200, 30, 31)))))
    assert png.sha256 == bmp.sha256 == b64.sha256
    assert other.sha256 != png.sha256
    assert len(png.sha256) == 64


def test_a_data_url_needs_an_image_type_but_not_the_exact_one() -> None:
    jpeg = encode(picture((10, 10)), "JPEG")
    assert load(data_url(jpeg, "image/png")).image.size == (10, 10)
    assert load("data:;base64," + data_url(jpeg).split(",")[1]).image.size == (10, 10)
    with pytest.raises(MediaError, match="'text/plain' is not an image type"):
        load(data_url(jpeg, "text/plain"))


def test_percent_encoded_data_url() -> None:
    raw = encode(picture((8, 8)))
    got = load("data:image/png," + quote_from_bytes(raw))
    assert got.image.size == (8, 8)


def test_transparency_becomes_white() -> None:
    image = Image.new("RGBA", (4, 4), (0, 0, 0, 0))
    got = load(data_url(encode(image)))
    assert got.image.getpixel((0, 0)) == (255, 255, 255)


def test_large_images_are_downscaled_with_their_aspect() -> None:
    got = load(data_url(encode(picture((400, 100)))), MediaLimits(max_pixels=10_000))
    width, height = got.image.size
    assert width * height <= 10_000 and abs(width / height - 4) < 0.1
    assert got.image.size == (200, 50)


@pytest.mark.parametrize(
    "fmt, media", [("JPEG", "image/jpeg"), ("WEBP", "image/webp"), ("GIF", "image/gif")]
)
def test_accepted_formats(fmt: str, media: str) -> None:
    got = load(data_url(encode(picture((20, 10)), fmt), media))
    assert got.image.size == (20, 10) and got.image.mode == "RGB"


# pytest resets warning filters per test; pippin.vision.decode ignores this one for the server.
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_10000_square_image_is_refused_before_decoding() -> None:
    real = blank_png(10_000, 10_000)  # ~0.4 MB of file, 100 MB of pixels
    assert len(real) < 1024 * 1024
    for data in (real, png_claiming(10_000, 10_000)):
        with pytest.raises(MediaError, match="10000x10000 pixels, more than this server decodes"):
            load(data_url(data))


def test_a_picture_under_the_source_cap_is_decoded_and_shrunk() -> None:
    got = load(data_url(blank_png(3000, 2000)), MediaLimits(max_pixels=600 * 400))
    assert got.image.size == (600, 400) and got.image.getpixel((0, 0)) == (0, 0, 0)


def test_a_corrupt_png_is_refused() -> None:
    data = bytearray(encode(picture((32, 32))))
    idat = data.index(b"IDAT")
    data[idat + 10 : idat + 20] = b"\xff" * 10  # a damaged compressed stream, bad CRC
    with pytest.raises(MediaError, match="PNG image is corrupt or truncated"):
        load(data_url(bytes(data)))


def test_a_truncated_jpeg_is_refused() -> None:
    noise = Image.frombytes("RGB", (128, 128), bytes(range(256)) * 192)
    data = encode(noise, "JPEG")
    with pytest.raises(MediaError, match="corrupt or truncated"):
        load(data_url(data[: len(data) // 2], "image/jpeg"))


@pytest.mark.parametrize(
    "data",
    [b"hello, not an image", encode(picture((8, 8)), "TIFF"), encode(picture((16, 16)), "ICO")],
)
def test_not_an_image_or_an_unaccepted_format(data: bytes) -> None:
    with pytest.raises(MediaError, match="not one of the accepted formats"):
        load(data_url(data, "application/octet-stream").replace("application/octet-stream", ""))


def test_empty_and_malformed_data_urls() -> None:
    with pytest.raises(MediaError, match="empty"):
        load("data:image/png;base64,")
    with pytest.raises(MediaError, match="no ','"):
        load("data:image/png;base64")
    with pytest.raises(MediaError, match="not valid base64"):
        load("data:image/png;base64,@@@@")


def test_oversized_base64_is_refused_before_decoding() -> None:
    limits = MediaLimits(max_image_bytes=1000)
    with pytest.raises(MediaError, match="over this server's"):
        load("data:image/png;base64," + "A" * 4000, limits)
    with pytest.raises(MediaError, match="over this server's"):
        asyncio.run(image_from_base64("A" * 4000, "image/png", limits))


def test_base64_media_type_must_match_and_be_an_image_type() -> None:
    png = base64.b64encode(encode(picture((8, 8)))).decode()
    with pytest.raises(MediaError, match="not the declared image/jpeg"):
        asyncio.run(image_from_base64(png, "image/jpeg", LIMITS))
    with pytest.raises(MediaError, match="unsupported image media type 'image/svg\\+xml'"):
        asyncio.run(image_from_base64(png, "image/svg+xml", LIMITS))
    got = asyncio.run(image_from_base64(png, None, LIMITS))
    assert got.image.size == (8, 8)


def test_base64_tolerates_line_breaks_and_missing_padding() -> None:
    png = base64.b64encode(encode(picture((9, 9)))).decode().rstrip("=")
    wrapped = "\n".join(png[i : i + 76] for i in range(0, len(png), 76))
    assert asyncio.run(image_from_base64(wrapped, "image/png", LIMITS)).image.size == (9, 9)


def test_animated_gif_gives_its_first_frame() -> None:
    frames = [picture((10, 10), (255, 0, 0)), picture((10, 10), (0, 0, 255))]
    from io import BytesIO

    out = BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    got = load(data_url(out.getvalue(), "image/gif"))
    red, green, blue = got.image.getpixel((9, 0))
    assert red > 200 and blue < 50


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "WEBP", "BMP"])
def test_damaged_files_give_media_errors_only(fmt: str) -> None:
    """Bytes flipped, cut or repeated anywhere: an image or a MediaError, nothing else."""
    import random

    rng = random.Random(fmt)
    good = encode(picture((48, 40)), fmt)
    for _ in range(60):
        data = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        if rng.random() < 0.3:
            data = data[: rng.randrange(1, len(data))]
        try:
            got = load(data_url(bytes(data), "image/png"))
        except MediaError:
            continue
        assert got.image.mode == "RGB"


def test_exif_orientation_is_applied() -> None:
    """A phone's portrait photo is stored landscape with an Orientation tag: the model
    sees it upright, as a browser shows it."""
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    from io import BytesIO

    out = BytesIO()
    picture((20, 10)).save(out, "JPEG", exif=exif)
    assert load(data_url(out.getvalue(), "image/jpeg")).image.size == (10, 20)
