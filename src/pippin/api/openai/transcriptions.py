"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's speech-to-text API
on the served Whisper model (`--stt-model`).

The multipart body is read by Starlette (parts over 1 MiB spill to a temporary file), the
audio decoded off the event loop with PyAV, and the transcription run on the speech
worker (`pippin.audio.stt`). Every form field OpenAI defines is honoured or refused with
a 400 that names it; so is any field it does not define.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from starlette.datastructures import FormData, UploadFile
from starlette.formparsers import MultiPartException

from pippin.api.common import cancel_on_disconnect, get_state, sse
from pippin.api.openapi import openai_route
from pippin.audio.decode import AudioError, AudioTooLong, decode_audio
from pippin.audio.stt import SttWorker, TranscribeOptions, Transcript
from pippin.audio.transcript_formats import to_json, to_srt, to_verbose_json, to_vtt
from pippin.serving.errors import ApiError, bad_request, server_error, unsupported_param
from pippin.serving.state import check_model

router = APIRouter()

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
GRANULARITIES = ("segment", "word")
# Fields of OpenAI's API that this server refuses, with why.
_REFUSED = {
    "chunking_strategy": "Whisper windows the audio itself (30-second windows).",
    "known_speaker_names": "Speaker diarization is not supported.",
    "known_speaker_references": "Speaker diarization is not supported.",
}
_TRANSCRIBE_FIELDS = {
    "file",
    "model",
    "language",
    "prompt",
    "temperature",
    "response_format",
    "timestamp_granularities",
    "stream",
    "include",
}
_TRANSLATE_FIELDS = {"file", "model", "prompt", "temperature", "response_format"}


@dataclass
class SttRequest:
    audio: bytes
    model: str
    opts: TranscribeOptions
    response_format: str
    granularities: set[str]
    stream: bool


def _field_name(key: str) -> str:
    return key[:-2] if key.endswith("[]") else key  # the SDK sends lists as `name[]`


async def _read_form(request: Request) -> FormData:
    ctype = request.headers.get("content-type", "")
    if not ctype.lower().startswith("multipart/form-data"):
        raise bad_request(
            "The request must be multipart/form-data with the audio in the 'file' field.",
            param="file",
            code="invalid_request",
        )
    try:
        return await request.form(max_files=1, max_fields=64)
    except MultiPartException as e:
        raise bad_request(
            f"Malformed multipart body: {e.message}", code="invalid_request"
        ) from None


def _one(form: FormData, name: str) -> str | None:
    values = form.getlist(name)
    if not values:
        return None
    if len(values) > 1:
        raise bad_request(f"'{name}' was given more than once.", param=name, code="invalid_value")
    if isinstance(values[0], UploadFile):
        raise bad_request(f"'{name}' must be a text field, not a file.", param=name)
    return str(values[0])


def _many(form: FormData, name: str) -> list[str]:
    values = [*form.getlist(name), *form.getlist(f"{name}[]")]
    if any(isinstance(v, UploadFile) for v in values):
        raise bad_request(f"'{name}' must be a text field, not a file.", param=name)
    return [str(v) for v in values]


def _bool(form: FormData, name: str) -> bool:
    raw = _one(form, name)
    if raw is None:
        return False
    if raw.lower() not in ("true", "false", "1", "0"):
        raise bad_request(f"'{name}' must be true or false, not {raw!r}.", param=name)
    return raw.lower() in ("true", "1")


def _temperature(form: FormData) -> float:
    raw = _one(form, "temperature")
    if raw is None:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise bad_request(
            f"'temperature' must be a number from 0 to 1, not {raw!r}.",
            param="temperature",
            code="invalid_value",
        )
    return value


def _worker(request: Request) -> SttWorker:
    worker = get_state(request).stt
    if worker is None:
        raise ApiError(
            404,
            "This server serves no speech-to-text model (start it with --stt-model).",
            param="model",
            code="model_not_found",
        )
    if not worker.ready:
        raise server_error(
            "The speech-to-text model is not ready; try again shortly.", "model_not_ready", 503
        )
    return worker


async def _parse(request: Request, task: str) -> tuple[SttWorker, SttRequest]:
    form = await _read_form(request)
    allowed = _TRANSCRIBE_FIELDS if task == "transcribe" else _TRANSLATE_FIELDS
    for key in form.keys():
        name = _field_name(key)
        if name in _REFUSED:
            raise unsupported_param(name, _REFUSED[name])
        if name not in allowed:
            where = "translations" if task == "translate" else "transcriptions"
            raise unsupported_param(name, f"It is not a field of /v1/audio/{where}.")
    worker = _worker(request)
    state = get_state(request)
    model = _one(form, "model")
    if not model:
        raise bad_request("'model' is required.", param="model", code="missing_required_parameter")
    check_model(state, model, state.extra_names.get("speech-to-text", [worker.name]))
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise bad_request(
            "'file' is required: the audio file to transcribe, as a multipart file part.",
            param="file",
            code="missing_required_parameter",
        )
    limit = state.settings.stt.max_bytes
    data = await upload.read(limit + 1)
    if len(data) > limit:
        raise ApiError(
            413,
            f"The audio file is larger than this server's limit of {limit / 2**20:g} MiB.",
            param="file",
            code="file_too_large",
        )
    fmt = _one(form, "response_format") or "json"
    if fmt not in FORMATS:
        raise bad_request(
            f"Unsupported 'response_format' {fmt!r}: use one of {', '.join(FORMATS)}.",
            param="response_format",
            code="unsupported_value",
        )
    grains = _many(form, "timestamp_granularities")
    bad = next((g for g in grains if g not in GRANULARITIES), None)
    if bad is not None:
        raise bad_request(
            f"Unsupported 'timestamp_granularities' value {bad!r}: use segment and/or word.",
            param="timestamp_granularities",
            code="unsupported_value",
        )
    if grains and fmt != "verbose_json":
        raise bad_request(
            "'timestamp_granularities' needs response_format 'verbose_json'.",
            param="timestamp_granularities",
            code="invalid_value",
        )
    include = _many(form, "include")
    if include:
        raise unsupported_param(
            "include",
            "Whisper through mlx-audio reports no per-token log probabilities; "
            "verbose_json gives each segment's avg_logprob.",
        )
    stream = _bool(form, "stream")
    if stream and fmt not in ("json", "text"):
        raise bad_request(
            f"'stream' works with response_format json or text, not {fmt!r}.",
            param="stream",
            code="invalid_value",
        )
    language = _one(form, "language")
    stt = worker.model
    assert stt is not None
    if language is not None:
        known = stt.languages()
        if language not in known:
            only = "this model is English-only" if len(known) == 1 else "use an ISO-639-1 code"
            raise bad_request(
                f"Unsupported 'language' {language!r}: {only}.",
                param="language",
                code="unsupported_value",
            )
    opts = TranscribeOptions(
        task=task,
        language=language,
        prompt=_one(form, "prompt"),
        temperature=_temperature(form),
        word_timestamps="word" in grains,
    )
    granularities = set(grains) or {"segment"}
    return worker, SttRequest(data, model, opts, fmt, granularities, stream)


async def _decode(request: Request, data: bytes) -> Any:
    max_seconds = get_state(request).settings.stt.max_seconds
    try:
        return await asyncio.to_thread(decode_audio, data, max_seconds=max_seconds)
    except AudioTooLong as e:
        raise bad_request(
            f"The audio in 'file' is too long: {e}; this server's limit is {e.limit_s:g} s.",
            param="file",
            code="audio_too_long",
        ) from None
    except AudioError as e:
        raise bad_request(
            f"Could not decode 'file': {e}. Send audio such as wav, mp3, m4a, ogg, webm or flac.",
            param="file",
            code="invalid_audio",
        ) from None


def _respond(t: Transcript, req: SttRequest) -> Response:
    fmt = req.response_format
    if fmt == "text":
        return PlainTextResponse(t.text + "\n")
    if fmt == "srt":
        return PlainTextResponse(to_srt(t))
    if fmt == "vtt":
        return PlainTextResponse(to_vtt(t), media_type="text/vtt")
    body = (
        to_verbose_json(t, req.opts.task, req.granularities)
        if fmt == "verbose_json"
        else to_json(t)
    )
    return Response(json.dumps(body, ensure_ascii=False), media_type="application/json")


async def _events(worker: SttWorker, audio: Any, opts: TranscribeOptions) -> AsyncIterator[str]:
    """`transcript.text.delta` per piece of the audio as it is transcribed, then
    `transcript.text.done` with the whole text and `[DONE]`; a failure is an error event."""
    text = ""
    try:
        async for piece in worker.stream(audio, opts):
            delta = f" {piece}" if text else piece
            text += delta
            yield sse({"type": "transcript.text.delta", "delta": delta})
    except Exception as e:  # after the stream began: sent as an error event
        yield sse({"type": "error", "error": {"message": str(e), "type": "server_error"}})
        return
    yield sse({"type": "transcript.text.done", "text": text})
    yield sse("[DONE]")


async def _serve(request: Request, task: str) -> Response:
    worker, req = await _parse(request, task)
    audio = await _decode(request, req.audio)
    if req.stream:
        return StreamingResponse(_events(worker, audio, req.opts), media_type="text/event-stream")
    t = await cancel_on_disconnect(request.receive, worker.transcribe(audio, req.opts))
    return _respond(t, req)


_MEDIA = ("application/json", "text/plain", "text/vtt")


@router.post(
    "/v1/audio/transcriptions", response_model=None, **openai_route(stream=True, media=_MEDIA)
)
async def create_transcription(request: Request) -> Response:
    return await _serve(request, "transcribe")


@router.post("/v1/audio/translations", response_model=None, **openai_route(media=_MEDIA))
async def create_translation(request: Request) -> Response:
    return await _serve(request, "translate")
