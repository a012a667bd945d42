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

from pippin.serving.errors import ApiError, bad_request, unsupported_value
from pippin.vision.media import MediaError, MediaLimits

if TYPE_CHECKING:
    from pippin.serving.live_model import LiveModel
    from pippin.serving.registry import ModelEntry
    from pippin.vision.inputs import MultiModal

# OpenAI's `detail: "low"`: the picture is shrunk to fit this square first.
LOW_DETAIL_SIDE = 512
DETAILS = ("auto", "low", "high")


@dataclass
class MediaRef:
    kind: Literal["image", "video", "base64", "audio"]
    param: str  # the part's place in the request, for errors
    url: str | None = None
    data: str | None = None  # base64 (Anthropic's source.type: base64)
    media_type: str | None = None
    detail: str | None = None
    # The placeholder dict in the template messages (a video's is replaced by its frames').
    placeholder: dict[str, Any] = field(default_factory=dict)
    # An audio part's decoded clip (samples, sha256 of the upload), once loaded.
    clip: tuple[Any, str] | None = None


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

    def audio(self, data: str, fmt: str, param: str) -> dict[str, Any]:
        """An OpenAI `input_audio` part (base64 wav or mp3)."""
        return self._add(MediaRef("audio", param, data=data, media_type=fmt))

    def clips(self) -> list[tuple[Any, str]]:
        """The loaded audio clips, in prompt order."""
        return [r.clip for r in self.refs if r.kind == "audio" and r.clip is not None]

    def _add(self, ref: MediaRef) -> dict[str, Any]:
        kind = "image" if ref.kind == "base64" else ref.kind
        ref.placeholder = {"type": kind}
        self.refs.append(ref)
        return ref.placeholder

    @property
    def first_param(self) -> str:
        return self.refs[0].param


def check_model_takes_media(live: LiveModel, media: MediaParts) -> None:
    """400 (naming the first part it cannot take) for media the model does not take."""
    vision = live.loaded.vision if live.loaded is not None else None
    for ref in media.refs:
        if ref.kind == "audio":
            if vision is None or vision.audio_token_id is None:
                raise unsupported_value(
                    ref.param,
                    "This model does not accept audio input ('input_audio' content parts); "
                    "transcribe it with /v1/audio/transcriptions and send the text, or serve "
                    "a model that takes audio.",
                )
        elif vision is None or not vision.takes_images:
            raise unsupported_value(
                ref.param,
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


def _decode_clip(data: str, parts: Any, limits: MediaLimits) -> tuple[Any, str]:
    """A base64 `input_audio` clip -> (samples at the model's feature extractor's rate,
    sha256 of the upload); at most the model's longest clip (its audio token cap)."""
    from pippin.audio.decode import AudioError, decode_audio
    from pippin.vision import omni
    from pippin.vision.source import b64decode

    if not data:
        raise MediaError("the audio data is empty")
    raw = b64decode(data, limits.max_image_bytes, "audio")
    try:
        samples = decode_audio(
            raw, max_seconds=omni.max_seconds(parts), rate=omni.sample_rate(parts)
        )
    except AudioError as e:
        raise MediaError(f"the audio could not be used: {e}") from None
    return samples, hashlib.sha256(raw).hexdigest()


async def _load_one(ref: MediaRef, limits: MediaLimits, parts: Any) -> list[tuple[Any, str]]:
    from pippin.vision import media

    if ref.kind == "audio":
        assert ref.data is not None
        ref.clip = await asyncio.to_thread(_decode_clip, ref.data, parts, limits)
        return []
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


async def load(live: LiveModel, media: MediaParts, limits: MediaLimits) -> list[tuple[Any, str]]:
    """The request's pictures (PIL image, content sha256) in prompt order, video frames
    expanded in place (their placeholders too). 400s name the part at fault."""
    if not media:
        return []
    if media.pictures is not None:
        return media.pictures
    check_model_takes_media(live, media)
    assert live.loaded is not None
    videos = [r for r in media.refs if r.kind == "video"]
    images = sum(1 for r in media.refs if r.kind in ("image", "base64"))
    if images > limits.max_images:
        param = [r for r in media.refs if r.kind in ("image", "base64")][limits.max_images].param
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
        *(_load_one(r, limits, live.loaded.vision) for r in media.refs), return_exceptions=True
    )
    out: list[tuple[Any, str]] = []
    for ref, res in zip(media.refs, results):
        if isinstance(res, MediaError):
            raise bad_request(f"{ref.param}: {res}", param=ref.param)
        if isinstance(res, ApiError):
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


def _build(
    parts: Any, tokenizer: Any, text: str, pictures: list[tuple[Any, str]], clips: list[Any]
) -> tuple[list[int], MultiModal | None]:
    from pippin.vision import omni, prompt

    ids, mm = prompt.build(parts, tokenizer, text, pictures)
    return omni.expand_audio(parts, tokenizer, ids, mm, clips)


async def build_prompt(
    live: LiveModel,
    text: str,
    pictures: list[tuple[Any, str]],
    param: str,
    clips: list[tuple[Any, str]] | None = None,
) -> tuple[list[int], MultiModal | None]:
    """A rendered prompt's token ids with the pictures' (and audio clips') placeholders
    expanded, and their data for the engine (off the event loop: the processor resizes
    and normalises, the feature extractor computes the clips' features)."""
    from pippin.vision import omni, prompt

    assert live.loaded is not None
    parts = live.loaded.vision
    tok = live.loaded.tokenizer
    try:
        return await asyncio.to_thread(_build, parts, tok, text, pictures, clips or [])
    except (prompt.PromptImageError, omni.AudioPromptError) as e:
        raise bad_request(f"{e}.", param=param) from None
    except (ValueError, TypeError, OSError) as e:
        raise bad_request(f"An image could not be processed: {e}", param=param) from None
