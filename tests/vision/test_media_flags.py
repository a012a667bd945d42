"""The media flags of `pippin serve` and the `MediaLimits` they give."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from pippin.cli.main import build_parser
from pippin.cli.media_flags import add_media_flags, limits_from_args
from pippin.cli.settings import settings_from_args
from pippin.vision.limits import MIB, MediaLimits


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def certifi_ca() -> str:
    """One real CA certificate (PEM), the first of the public bundle httpx uses."""
    import certifi

    text = Path(certifi.where()).read_text()
    match = re.search(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", text, re.S)
    assert match is not None
    return match.group(0)


def test_defaults_are_the_safe_defaults() -> None:
    assert limits_from_args(parse()) == MediaLimits()
    limits = MediaLimits()
    assert limits.allowed_local_media_path is None and limits.allowed_domains is None
    assert not limits.allow_private_for_tests and not limits.public_hosts_for_tests


def test_every_flag_reaches_the_limits(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text(certifi_ca() + "\n")
    args = parse(
        "--limit-mm-per-prompt", '{"image": 2, "video": {"count": 0}}',
        "--allowed-local-media-path", str(tmp_path),
        "--allowed-media-domains", "IMG.example.com,cdn.example", "upload.example.",
        "bücher.example",
        "--max-image-mb", "2.5",
        "--max-image-pixels", "1000000",
        "--max-source-image-pixels", "4000000",
        "--max-video-mb", "10",
        "--max-video-seconds", "30",
        "--max-video-frames", "8",
        "--video-fps", "1",
        "--media-fetch-timeout", "3",
        "--media-max-redirects", "0",
        "--media-ca-bundle", str(bundle),
    )  # fmt: skip
    assert limits_from_args(args) == MediaLimits(
        max_images=2,
        max_videos=0,
        max_image_bytes=int(2.5 * MIB),
        max_pixels=1_000_000,
        max_video_seconds=30.0,
        max_video_frames=8,
        video_fps=1.0,
        fetch_timeout_s=3.0,
        max_redirects=0,
        allowed_local_media_path=tmp_path.resolve(),
        allowed_domains=(
            "img.example.com",
            "cdn.example",
            "upload.example",
            "xn--bcher-kva.example",
        ),
        max_source_pixels=4_000_000,
        max_video_bytes=10 * MIB,
        ca_bundle=bundle.resolve(),
    )


def test_the_server_settings_carry_the_limits() -> None:
    settings = settings_from_args(parse("--limit-mm-per-prompt", '{"image": 3}'))
    assert settings.media.max_images == 3 and settings.media.max_videos == MediaLimits().max_videos


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--limit-mm-per-prompt", "{image: 2}"], "not valid JSON"),
        (["--limit-mm-per-prompt", "[1]"], "must be a JSON object"),
        (["--limit-mm-per-prompt", '{"audio": 1}'], "unknown modality 'audio'"),
        (["--limit-mm-per-prompt", '{"image": -1}'], "count of 0 or more"),
        (["--allowed-local-media-path", "/no/such/folder"], "not a folder"),
        (["--max-image-pixels", "0"], "at least 1"),
        (["--video-fps", "0"], "must be positive"),
        (["--media-max-redirects", "-1"], "must not be negative"),
        (["--media-ca-bundle", "/no/such/ca.pem"], "not a file"),
        (["--media-ca-bundle", __file__], "not a PEM file of CA certificates"),
    ],
)
def test_bad_flags_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_test_hooks_have_no_flag() -> None:
    parser = argparse.ArgumentParser()
    add_media_flags(parser)
    flags = {s for a in parser._actions for s in a.option_strings}
    assert not any("test" in f or "private" in f for f in flags)
