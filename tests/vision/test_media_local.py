"""Local media files: only under --allowed-local-media-path, with no way out of it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

pytest.importorskip("PIL")

from media_helpers import encode, picture  # noqa: E402

from pippin.vision.media import MediaError, MediaLimits, load_image  # noqa: E402


@pytest.fixture()
def folders(tmp_path: Path) -> tuple[Path, Path]:
    allowed = tmp_path / "media"
    (allowed / "sub").mkdir(parents=True)
    (allowed / "sub" / "cat.png").write_bytes(encode(picture((12, 10))))
    outside = tmp_path / "secret"
    outside.mkdir()
    (outside / "key.png").write_bytes(encode(picture((5, 5))))
    return allowed, outside


def load(url: str, root: Path | None):  # noqa: ANN201
    return asyncio.run(load_image(url, MediaLimits(allowed_local_media_path=root)))


def test_files_under_the_folder_load(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    path = allowed / "sub" / "cat.png"
    for url in (path.as_uri(), str(path), "sub/cat.png", "file://localhost" + str(path)):
        assert load(url, allowed).image.size == (12, 10)


def test_no_local_files_without_the_flag(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    path = allowed / "sub" / "cat.png"
    for url in (path.as_uri(), str(path)):
        with pytest.raises(MediaError, match="local files are not allowed"):
            load(url, None)


def test_a_file_outside_the_folder_is_refused(folders: tuple[Path, Path]) -> None:
    allowed, outside = folders
    for url in (
        (outside / "key.png").as_uri(),
        str(outside / "key.png"),
        "../secret/key.png",
        str(allowed / "sub" / ".." / ".." / "secret" / "key.png"),
        "file://" + str(allowed) + "/%2e%2e/secret/key.png",
        "/etc/passwd",
    ):
        with pytest.raises(MediaError, match="outside the folder"):
            load(url, allowed)


def test_a_symlink_out_of_the_folder_is_refused(folders: tuple[Path, Path]) -> None:
    allowed, outside = folders
    (allowed / "link.png").symlink_to(outside / "key.png")
    (allowed / "dir").symlink_to(outside)
    for url in ("link.png", str(allowed / "dir" / "key.png"), (allowed / "link.png").as_uri()):
        with pytest.raises(MediaError, match="outside the folder"):
            load(url, allowed)


def test_a_symlink_that_stays_inside_is_followed(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    (allowed / "alias.png").symlink_to(allowed / "sub" / "cat.png")
    assert load("alias.png", allowed).image.size == (12, 10)


def test_the_folder_itself_a_symlink(folders: tuple[Path, Path], tmp_path: Path) -> None:
    allowed, _ = folders
    link = tmp_path / "media-link"
    link.symlink_to(allowed)
    assert load("sub/cat.png", link).image.size == (12, 10)


def test_file_urls_name_no_other_host(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    with pytest.raises(MediaError, match="name no host"):
        load("file://fileserver" + str(allowed / "sub" / "cat.png"), allowed)


def test_only_regular_files(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    os.mkfifo(allowed / "pipe.png")
    with pytest.raises(MediaError, match="not a regular file"):
        load("pipe.png", allowed)
    with pytest.raises(MediaError, match="not a regular file|cannot open"):
        load("sub", allowed)
    with pytest.raises(MediaError, match="no such file"):
        load("sub/dog.png", allowed)


def test_the_byte_cap_applies_to_files(folders: tuple[Path, Path]) -> None:
    allowed, _ = folders
    (allowed / "big.png").write_bytes(b"\0" * 5000)
    limits = MediaLimits(allowed_local_media_path=allowed, max_image_bytes=4000)
    with pytest.raises(MediaError, match="over this server's"):
        asyncio.run(load_image("big.png", limits))
