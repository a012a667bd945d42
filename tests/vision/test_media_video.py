"""Video frame sampling (pippin.vision.video) on clips made here with OpenCV."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("cv2")

from media_helpers import data_url, video_bytes  # noqa: E402

from pippin.vision.media import MediaError, MediaLimits, load_video, load_video_clip  # noqa: E402
from pippin.vision.video import frame_indices  # noqa: E402


@pytest.fixture(scope="module")
def clip(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """3 s at 10 fps, 32x24; frame i has red = 8 * i."""
    return video_bytes(tmp_path_factory.mktemp("video"))


def frame_number(red: int) -> int:
    return round(red / 8)


def test_frames_are_sampled_at_the_requested_rate(clip: bytes) -> None:
    got = asyncio.run(load_video_clip(data_url(clip, "video/mp4"), MediaLimits(), fps=2))
    assert len(got.frames) == 6
    assert got.timestamps == pytest.approx([0, 0.5, 1.0, 1.5, 2.0, 2.5])
    assert got.duration == pytest.approx(3.0) and got.fps == pytest.approx(2.0)
    reds = [f.image.getpixel((5, 5))[0] for f in got.frames]
    assert [frame_number(r) for r in reds] == [0, 5, 10, 15, 20, 25]
    assert all(f.image.mode == "RGB" and f.image.size == (32, 24) for f in got.frames)
    assert len({f.sha256 for f in got.frames}) == 6


def test_the_frame_cap_spreads_frames_over_the_clip(clip: bytes) -> None:
    frames = asyncio.run(
        load_video(data_url(clip, "video/mp4"), MediaLimits(), fps=10, max_frames=4)
    )
    reds = [frame_number(f.image.getpixel((5, 5))[0]) for f in frames]
    assert reds == [0, 10, 19, 29]


def test_the_server_cap_bounds_a_requested_one(clip: bytes) -> None:
    limits = MediaLimits(max_video_frames=3)
    frames = asyncio.run(load_video(data_url(clip, "video/mp4"), limits, fps=10, max_frames=100))
    assert len(frames) == 3


def test_default_rate_comes_from_the_limits(clip: bytes) -> None:
    frames = asyncio.run(load_video(data_url(clip, "video/mp4"), MediaLimits(video_fps=1.0)))
    assert len(frames) == 3


def test_frames_are_downscaled(clip: bytes) -> None:
    frames = asyncio.run(
        load_video(data_url(clip, "video/mp4"), MediaLimits(max_pixels=192), fps=1)
    )
    assert {f.image.size for f in frames} == {(16, 12)}


def test_a_long_video_is_refused(clip: bytes) -> None:
    with pytest.raises(MediaError, match="3.0 s long, over this server's 2 s"):
        asyncio.run(load_video(data_url(clip, "video/mp4"), MediaLimits(max_video_seconds=2)))


def test_a_large_video_is_refused(clip: bytes) -> None:
    with pytest.raises(MediaError, match="over this server's"):
        asyncio.run(load_video(data_url(clip, "video/mp4"), MediaLimits(max_video_bytes=100)))


def test_video_over_http(clip: bytes) -> None:
    from media_helpers import encode, picture, serving

    with serving(encode(picture())) as server:
        server.files["/clip.mp4"] = (clip, "video/mp4")
        url = server.url("/clip.mp4")
        with pytest.raises(MediaError, match="loopback"):
            asyncio.run(load_video(url, MediaLimits()))
        limits = MediaLimits(allow_private_for_tests=True)
        assert len(asyncio.run(load_video(url, limits, fps=1))) == 3
        with pytest.raises(MediaError, match="over this server's"):
            asyncio.run(
                load_video(url, MediaLimits(allow_private_for_tests=True, max_video_bytes=500))
            )


def test_video_from_a_local_file(clip: bytes, tmp_path: Path) -> None:
    (tmp_path / "clip.mp4").write_bytes(clip)
    limits = MediaLimits(allowed_local_media_path=tmp_path)
    assert len(asyncio.run(load_video("clip.mp4", limits, fps=1))) == 3


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"#EXTM3U\n#EXTINF:1,\nhttp://169.254.169.254/x.ts\n", "not a video"),
        (b"<html>not a video</html>", "not a video"),
        (b"\0\0\0\x18ftypmp42" + b"\0" * 200, "corrupt"),
    ],
)
def test_bad_videos_are_refused(data: bytes, message: str) -> None:
    with pytest.raises(MediaError, match=message):
        asyncio.run(load_video(data_url(data, "video/mp4"), MediaLimits()))


def test_a_truncated_video_is_refused_or_short(clip: bytes) -> None:
    """Cut in half: either refused or fewer frames, never a crash."""
    try:
        frames = asyncio.run(
            load_video(data_url(clip[: len(clip) // 2], "video/mp4"), MediaLimits())
        )
    except MediaError:
        return
    assert 0 < len(frames) <= 6


@pytest.mark.parametrize(
    "name, codec",
    [("clip.avi", "MJPG"), ("clip.mkv", "MJPG"), ("clip.webm", "VP80"), ("clip.mov", "mp4v")],
)
def test_other_containers(name: str, codec: str, tmp_path: Path) -> None:
    data = video_bytes(tmp_path, seconds=2.0, name=name, codec=codec)
    frames = asyncio.run(load_video(data_url(data, "video/x"), MediaLimits(), fps=1))
    assert [frame_number(f.image.getpixel((5, 5))[0]) for f in frames] == [0, 10]


def test_frame_indices() -> None:
    assert frame_indices(30, 10.0, 2.0, 32) == [0, 5, 10, 15, 20, 25]
    assert frame_indices(30, 10.0, 10.0, 4) == [0, 10, 19, 29]
    assert frame_indices(30, 10.0, 10.0, 1) == [0]
    assert frame_indices(5, 10.0, 2.0, 32) == [0]  # shorter than one sampling step
    assert frame_indices(3, 30.0, 60.0, 32) == [0, 1, 2]  # faster than the video: each frame once


def test_damaged_videos_give_media_errors_only(clip: bytes) -> None:
    import random

    rng = random.Random(7)
    for _ in range(25):
        data = bytearray(clip)
        for _ in range(rng.randint(1, 16)):
            data[rng.randrange(8, len(data))] = rng.randrange(256)
        try:
            frames = asyncio.run(load_video(data_url(bytes(data), "video/mp4"), MediaLimits()))
        except MediaError:
            continue
        assert all(f.image.mode == "RGB" for f in frames)
