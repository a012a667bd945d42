"""Images and videos in chat requests, for every API surface.

Each front turns its wire parts (OpenAI `image_url` / `video_url`, Anthropic `image`
blocks, Responses `input_image`) into `MediaParts` while it builds the template messages:
each part becomes a placeholder dict in the message content (`{"type": "image"}`, what
vision models' chat templates take) and a `MediaRef` naming where it came from. Once the
request's model is known, `load` refuses media for a model without vision, counts the
request's images and videos against `--limit-mm-per-prompt`, fetches and decodes them
(`pippin.vision.media`; errors name the part) and expands each video into its frames'
image parts. `render` then renders the prompt and expands the placeholders with the
model's processor (`pippin.vision.prompt`).
"""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pippin.api.errors import OpenAIError, bad_request, unsupported_value
from pippin.vision.media import MediaError, MediaLimits

if TYPE_CHECKING:
    from pippin.api.live_model import LiveModel
    from pippin.api.registry import ModelEntry
    from pippin.vision.inputs import MultiModal

# OpenAI's `detail: "low"`: the picture is shrunk to fit this square first.
LOW_DETAIL_SIDE = 512
DETAILS = ("auto", "low", "high")


@dataclass
class MediaRef:
    kind: Literal["image", "video", "base64"]
    param: str  # the part's place in the request, for errors
    url: str | None = None
    data: str | None = None  # base64 (Anthropic's source.type: base64)
    media_type: str | None = None
    detail: str | None = None
    # The placeholder dict in the template messages (a video's is replaced by its frames').
    placeholder: dict[str, Any] = field(default_factory=dict)


@dataclass
class MediaParts:
    """The media of one request, in prompt order."""

    refs: list[MediaRef] = field(default_factory=list)
    # The loaded pictures, kept: the MCP tool loop renders the prompt again every turn.
    pictures: list[tuple[Any, str]] | None = None

    def __bool__(self) -> bool:
        return bool(self.refs)

    def image(self, url: str, param: str, detail: str | None = None) -> dict[str, Any]:
        if detail is not None and detail not in DETAILS:
            raise unsupported_value(f"{param}.detail", f"detail must be one of {DETAILS}.")
        return self._add(MediaRef("image", param, url=url, detail=detail))

    def base64(self, data: str, media_type: str | None, param: str) -> dict[str, Any]:
        return self._add(MediaRef("base64", param, data=data, media_type=media_type))

    def video(self, url: str, param: str) -> dict[str, Any]:
        return self._add(MediaRef("video", param, url=url))

    def _add(self, ref: MediaRef) -> dict[str, Any]:
        ref.placeholder = {"type": "video" if ref.kind == "video" else "image"}
        self.refs.append(ref)
        return ref.placeholder

    @property
    def first_param(self) -> str:
        return self.refs[0].param


def check_model_takes_media(state: LiveModel, media: MediaParts) -> None:
    """400 (naming the first media part) for a model without a vision part."""
    if media and (state.loaded is None or state.loaded.vision is None):
        raise unsupported_value(
            media.first_param,
            "This model does not accept image or video input; "
            "send text only, or serve a vision-language model.",
        )


def takes_images(entry: ModelEntry) -> bool:
    """Whether a chat model takes images: a loaded one has a vision part; an unloaded
    one's folder holds a checkpoint pippin serves as a VLM (a Hub id not yet here: no)."""
    from pathlib import Path

    from pippin.vision.load import is_vlm_folder

    live = entry.live
    if live is not None and live.loaded is not None:
        return live.loaded.vision is not None
    source = entry.spec.model
    return bool(source) and Path(source).is_dir() and is_vlm_folder(Path(source))


def _low_detail(image: Any) -> tuple[Any, str | None]:
    from PIL import Image

    w, h = image.size
    if max(w, h) <= LOW_DETAIL_SIDE:
        return image, None
    scale = LOW_DETAIL_SIDE / max(w, h)
    small = image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.BICUBIC)
    digest = hashlib.sha256(f"{small.mode}:{small.size}:".encode())
    digest.update(small.tobytes())
    return small, digest.hexdigest()


async def _load_one(ref: MediaRef, limits: MediaLimits) -> list[tuple[Any, str]]:
    from pippin.vision import media

    if ref.kind == "video":
        assert ref.url is not None
        frames = await media.load_video(ref.url, limits)
        return [(f.image, f.sha256) for f in frames]
    if ref.kind == "base64":
        assert ref.data is not None
        img = await media.image_from_base64(ref.data, ref.media_type, limits)
    else:
        assert ref.url is not None
        img = await media.load_image(ref.url, limits)
    if ref.detail == "low":
        small, sha = _low_detail(img.image)
        if sha is not None:
            return [(small, sha)]
    return [(img.image, img.sha256)]


async def load(state: LiveModel, media: MediaParts, limits: MediaLimits) -> list[tuple[Any, str]]:
    """The request's pictures (PIL image, content sha256) in prompt order, video frames
    expanded in place (their placeholders too). 400s name the part at fault."""
    if not media:
        return []
    if media.pictures is not None:
        return media.pictures
    check_model_takes_media(state, media)
    videos = [r for r in media.refs if r.kind == "video"]
    images = len(media.refs) - len(videos)
    if images > limits.max_images:
        param = [r for r in media.refs if r.kind != "video"][limits.max_images].param
        raise bad_request(
            f"This request has {images} images; at most {limits.max_images} are allowed "
            "per request (--limit-mm-per-prompt).",
            param=param,
        )
    if len(videos) > limits.max_videos:
        raise bad_request(
            f"This request has {len(videos)} videos; at most {limits.max_videos} are allowed "
            "per request (--limit-mm-per-prompt).",
            param=videos[limits.max_videos].param,
        )
    results = await asyncio.gather(
        *(_load_one(r, limits) for r in media.refs), return_exceptions=True
    )
    out: list[tuple[Any, str]] = []
    for ref, res in zip(media.refs, results):
        if isinstance(res, MediaError):
            raise bad_request(f"{ref.param}: {res}", param=ref.param)
        if isinstance(res, OpenAIError):
            raise res
        if isinstance(res, BaseException):
            raise res
        if ref.kind == "video":
            # The template sees one image per frame, where the video was.
            ref.placeholder.clear()
            ref.placeholder.update({"type": "frames", "count": len(res)})
        out.extend(res)
    media.pictures = out
    return out


def expand_frames(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with each loaded video's placeholder replaced by its frames' image parts."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(p.get("type") == "frames" for p in content):
            parts: list[dict[str, Any]] = []
            for p in content:
                if p.get("type") == "frames":
                    parts.extend({"type": "image"} for _ in range(p["count"]))
                else:
                    parts.append(p)
            m = {**m, "content": parts}
        out.append(m)
    return out


async def build_prompt(
    state: LiveModel, text: str, pictures: list[tuple[Any, str]], param: str
) -> tuple[list[int], MultiModal | None]:
    """A rendered prompt's token ids with the pictures' placeholders expanded, and their
    data for the engine (off the event loop: the processor resizes and normalises)."""
    from pippin.vision import prompt

    assert state.loaded is not None
    parts = state.loaded.vision
    try:
        return await asyncio.to_thread(prompt.build, parts, state.loaded.tokenizer, text, pictures)
    except prompt.PromptImageError as e:
        raise bad_request(f"{e}.", param=param) from None
    except (ValueError, TypeError, OSError) as e:
        raise bad_request(f"An image could not be processed: {e}", param=param) from None
