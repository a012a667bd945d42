"""POST /v1/audio/speech: OpenAI's text-to-speech API on the served --tts-model.

The input is cut at sentence ends (`pippin.audio.sentences`); each sentence is synthesised
on the TTS worker's thread and encoded (`pippin.audio.encode`) as soon as it is made, so the
first audio goes out while the rest is still being made. ``stream_format`` ``audio`` (the
default) sends the encoded bytes as a chunked body; ``sse`` sends them base64-encoded in
``speech.audio.delta`` events and ends with ``speech.audio.done`` and its usage. The first
sentence is synthesised before the response starts, so a model that fails on this input
answers with an error status rather than a cut stream.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field

from pippin.api.common import Strict, get_state, parse_request, sse
from pippin.api.errors import openai_body
from pippin.api.openapi import openai_route
from pippin.audio.encode import MEDIA_TYPES, AudioEncoder
from pippin.audio.sentences import pieces
from pippin.serving.errors import ApiError, bad_request, server_error, unsupported_value
from pippin.serving.state import ServerState, check_model

if TYPE_CHECKING:
    from pippin.audio.tts import Speech, TTSModel, TTSWorker

log = logging.getLogger("pippin.audio")

router = APIRouter()

# OpenAI's limit on ``input``.
MAX_INPUT_CHARS = 4096
# Usage's output_tokens count the audio in 20 ms frames (OpenAI does not say how it counts).
FRAMES_PER_SECOND = 50


class VoiceId(Strict):
    id: str


class SpeechRequest(Strict):
    model: str
    input: str = Field(max_length=MAX_INPUT_CHARS)
    voice: str | VoiceId
    instructions: str | None = Field(None, max_length=MAX_INPUT_CHARS)
    # null is the same as leaving a field out (the defaults are OpenAI's).
    response_format: Literal["mp3", "opus", "aac", "flac", "wav", "pcm"] | None = None
    speed: float | None = Field(None, ge=0.25, le=4.0)
    stream_format: Literal["sse", "audio"] | None = None


def _tts(state: ServerState, name: str) -> tuple[TTSWorker, TTSModel]:
    names = state.extra_names.get("speech", [])
    if not names:
        raise ApiError(
            404,
            "This server serves no text-to-speech model (start it with --tts-model).",
            param="model",
            code="model_not_found",
        )
    check_model(state, name, names)
    worker = state.tts
    if worker is None or not worker.ready:
        raise server_error("The TTS model is not ready; try again shortly.", "model_not_ready", 503)
    assert worker.model is not None
    return worker, worker.model


def _voice(req: SpeechRequest, voices: list[str] | None) -> str:
    voice = req.voice.id if isinstance(req.voice, VoiceId) else req.voice
    param = "voice.id" if isinstance(req.voice, VoiceId) else "voice"
    if not voice:
        raise bad_request("'voice' must not be empty.", param=param, code="invalid_value")
    if voices is not None and voice not in voices:
        shown = ", ".join(voices[:50]) + (", ..." if len(voices) > 50 else "")
        raise bad_request(
            f"Unknown voice '{voice}': this model's voices are {shown}.",
            param=param,
            code="invalid_value",
        )
    return voice


@router.post(
    "/v1/audio/speech",
    response_model=None,
    **openai_route(SpeechRequest, media=(*MEDIA_TYPES.values(), "text/event-stream")),
)
async def create_speech(request: Request) -> StreamingResponse:
    req = await parse_request(SpeechRequest, await request.body())
    fmt = req.response_format or "mp3"
    speed = 1.0 if req.speed is None else req.speed
    worker, model = _tts(get_state(request), req.model)
    voice = _voice(req, model.voices)
    if req.instructions is not None and not model.takes_instructions:
        raise unsupported_value(
            "instructions",
            f"The model '{req.model}' ({model.model_type}) does not take 'instructions'; "
            "leave the field out.",
        )
    if speed != 1.0 and not model.takes_speed:
        raise unsupported_value(
            "speed", f"The model '{req.model}' ({model.model_type}) cannot change 'speed'."
        )
    texts = pieces(req.input)
    if not texts:
        raise bad_request(
            "'input' must contain text to speak.", param="input", code="invalid_value"
        )

    async def synth(text: str) -> Speech:
        return await worker.run(model.synthesize, text, voice, speed, req.instructions)

    try:
        first = await synth(texts[0])
    except Exception as e:  # noqa: BLE001 - the model's own failure on this input
        log.warning("speech synthesis failed: %s", e)
        raise server_error(f"The model failed to synthesise the input: {e}") from None
    encoder = AudioEncoder(fmt, model.sample_rate, streaming=True)

    async def audio() -> AsyncIterator[tuple[bytes, int, int]]:
        """(encoded bytes, input tokens, samples) per sentence, then the encoder's tail."""
        speech = first
        for i in range(len(texts)):
            if i:
                speech = await synth(texts[i])
            data = await asyncio.to_thread(encoder.encode, speech.samples)
            yield data, speech.tokens, speech.samples.size
        yield await asyncio.to_thread(encoder.finish), 0, 0

    async def raw() -> AsyncIterator[bytes]:
        try:
            async for data, _, _ in audio():
                if data:
                    yield data
        except Exception:
            # The status is sent: a cut body is all that is left to say it.
            log.exception("speech stream failed")
        finally:
            encoder.close()

    async def events() -> AsyncIterator[str]:
        tokens = samples = 0
        try:
            async for data, n_tokens, n_samples in audio():
                tokens += n_tokens
                samples += n_samples
                if data:
                    b64 = base64.b64encode(data).decode("ascii")
                    yield sse({"type": "speech.audio.delta", "audio": b64})
        except Exception as e:
            log.exception("speech stream failed")
            err = server_error(f"The model failed to synthesise the input: {e}")
            yield sse(openai_body(err) | {"type": "error"})
            return
        finally:
            encoder.close()
        frames = math.ceil(samples * FRAMES_PER_SECOND / model.sample_rate)
        usage = {"input_tokens": tokens, "output_tokens": frames, "total_tokens": tokens + frames}
        yield sse({"type": "speech.audio.done", "usage": usage})

    if req.stream_format == "sse":
        return StreamingResponse(events(), media_type="text/event-stream")
    return StreamingResponse(raw(), media_type=MEDIA_TYPES[fmt])
