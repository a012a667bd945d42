"""Wire format of the OpenAI chat and (legacy) completions requests.

The models list every field of the official API reference plus the vLLM extensions
clients send. Unknown fields are refused (``extra="forbid"``) and types are strict
(``"5"`` is not an integer), so nothing is silently coerced or ignored. Fields that are
parsed here but not supported are refused by the handlers with a 400 naming them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from pippin.api.errors import OpenAIError, from_validation_error, server_error
from pippin.engine.async_engine import EngineError
from pippin.obs.http import note_error

# Parsing a big body (up to the body cap) takes long enough to stall other
# requests, so above this size it runs in a worker thread.
_PARSE_INLINE_MAX = 256 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Loose(BaseModel):
    """Parts parsed only so the handler can refuse them by name."""

    model_config = ConfigDict(extra="allow")


def _by(key: str, *values: str) -> Discriminator:
    """Pick a union member by the literal value of `key`.

    Members are tagged '@value' (see `Annotated[..., Tag("@value")]` below) so tags can
    be told apart from field names when an error location is turned into `param`.
    """

    def pick(v: Any) -> str | None:
        tag = v.get(key) if isinstance(v, dict) else getattr(v, key, None)
        return f"@{tag}" if isinstance(tag, str) else None

    expected = ", ".join(f"'{v}'" for v in values)
    return Discriminator(
        pick,
        # The error type carries the field name (context dicts would make the
        # annotation unhashable, which `X | None` needs).
        custom_error_type=f"invalid_tag_{key}",
        custom_error_message=f"'{key}' must be one of {expected}",
    )


# --- message content parts ---------------------------------------------------


class CacheBreakpoint(_Strict):
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str
    # Prefix caching is automatic for every prompt, so breakpoints are always served.
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class RefusalPart(_Strict):
    type: Literal["refusal"]
    refusal: str


class ImagePart(_Loose):
    type: Literal["image_url"]


class AudioPart(_Loose):
    type: Literal["input_audio"]


class FilePart(_Loose):
    type: Literal["file"]


UserPart = Annotated[
    Annotated[TextPart, Tag("@text")]
    | Annotated[ImagePart, Tag("@image_url")]
    | Annotated[AudioPart, Tag("@input_audio")]
    | Annotated[FilePart, Tag("@file")],
    _by("type", "text", "image_url", "input_audio", "file"),
]
AssistantPart = Annotated[
    Annotated[TextPart, Tag("@text")] | Annotated[RefusalPart, Tag("@refusal")],
    _by("type", "text", "refusal"),
]

# --- messages ----------------------------------------------------------------


class FunctionCallData(_Strict):
    name: str
    arguments: str


class ToolCallData(_Strict):
    id: str
    type: Literal["function"]
    function: FunctionCallData


class SystemMessage(_Strict):
    role: Literal["system"]
    content: str | list[TextPart]
    name: str | None = None


class DeveloperMessage(_Strict):
    role: Literal["developer"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(_Strict):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"]
    content: str | list[AssistantPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallData] | None = None
    function_call: FunctionCallData | None = None
    audio: dict[str, Any] | None = None
    # Not in OpenAI's reference, but sent back by clients of reasoning models
    # (vLLM, DeepSeek); chat templates may render it.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ToolMessage(_Strict):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


class FunctionMessage(_Strict):
    role: Literal["function"]
    content: str | None
    name: str


Message = Annotated[
    Annotated[SystemMessage, Tag("@system")]
    | Annotated[DeveloperMessage, Tag("@developer")]
    | Annotated[UserMessage, Tag("@user")]
    | Annotated[AssistantMessage, Tag("@assistant")]
    | Annotated[ToolMessage, Tag("@tool")]
    | Annotated[FunctionMessage, Tag("@function")],
    _by("role", "system", "developer", "user", "assistant", "tool", "function"),
]

# --- tools and formats -------------------------------------------------------


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class CustomTool(_Loose):
    type: Literal["custom"]


Tool = Annotated[
    Annotated[FunctionTool, Tag("@function")] | Annotated[CustomTool, Tag("@custom")],
    _by("type", "function", "custom"),
]


class ResponseFormatText(_Strict):
    type: Literal["text"]


class ResponseFormatOther(_Loose):
    type: Literal["json_object", "json_schema"]


ResponseFormat = Annotated[
    Annotated[ResponseFormatText, Tag("@text")]
    | Annotated[ResponseFormatOther, Tag("@json_object")]
    | Annotated[ResponseFormatOther, Tag("@json_schema")],
    _by("type", "text", "json_object", "json_schema"),
]


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class PromptCacheOptions(_Strict):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


# --- requests ----------------------------------------------------------------


class SamplingFields(_Strict):
    """Fields shared by chat and completions requests."""

    model: str
    n: int | None = Field(None, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool | None = None
    # vLLM's structured output fields (one of them; see api/structured_output.py).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # Requests with different salts never share cached KV (multi-tenant isolation).
    cache_salt: str | None = Field(None, min_length=1)


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    safety_identifier: str | None = Field(None, max_length=128)
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # vLLM extensions.
    chat_template_kwargs: dict[str, Any] | None = None
    # Reasoning tokens after which the model's reasoning section is closed for it.
    thinking_token_budget: int | None = Field(None, ge=0)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


PromptInput = Union[str, list[str], list[int], list[list[int]]]  # noqa: UP007


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(None, ge=0)
    best_of: int | None = Field(None, ge=1, le=128)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    # vLLM extension: add the tokenizer's BOS etc. to string prompts.
    add_special_tokens: bool | None = None


class EmbeddingRequest(_Strict):
    model: str
    input: PromptInput
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class RerankDocument(BaseModel):
    """A document given as an object (Cohere v1): ranked by ``text``; its other keys are
    the client's own and come back unchanged with ``return_documents``."""

    model_config = ConfigDict(extra="allow", strict=True)
    text: str


class RerankRequest(_Strict):
    """Cohere (v1 and v2), Jina and vLLM rerank requests."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool | None = None
    max_tokens_per_doc: int | None = Field(None, ge=1)
    rank_fields: list[str] | None = None
    max_chunks_per_doc: int | None = None


RequestT = TypeVar("RequestT", bound=BaseModel)


def _parse(cls: type[RequestT], raw: bytes) -> RequestT:
    try:
        return cls.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


async def parse_request(cls: type[RequestT], raw: bytes) -> RequestT:
    """Parse and validate a JSON body, raising an OpenAI 400 that names the field."""
    if len(raw) > _PARSE_INLINE_MAX:
        return await asyncio.to_thread(_parse, cls, raw)
    return _parse(cls, raw)


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event line as the OpenAI stream carries it."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


# --- response side -----------------------------------------------------------

# JSON has no -inf; a token the model considers impossible is reported this low
# (vLLM does the same).
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


class TokenRenderer:
    """Token id -> (text, UTF-8 bytes) as OpenAI's logprobs show single tokens.

    A token may be part of a multi-byte character, so its exact bytes come from the
    tokenizer's byte-level vocabulary, not from decoding it alone. Cached per id.
    """

    def __init__(self, tokenizer: Any) -> None:
        from mlx_lm.tokenizer_utils import (
            BPEStreamingDetokenizer,
            SPMStreamingDetokenizer,
            _byte_decoder,
        )

        self._tokenizer = tokenizer
        detok = getattr(tokenizer, "detokenizer", None)
        self._map: list[Any] | None = getattr(detok, "tokenmap", None)
        self._bpe = isinstance(detok, BPEStreamingDetokenizer)
        self._spm = isinstance(detok, SPMStreamingDetokenizer)
        self._byte_decoder: dict[str, int] = _byte_decoder() if self._bpe else {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _bytes(self, token_id: int) -> bytes:
        piece = self._map[token_id] if self._map and token_id < len(self._map) else None
        if piece is not None and self._bpe:
            out = bytearray()
            for ch in piece:
                b = self._byte_decoder.get(ch)
                out.extend(bytes([b]) if b is not None else ch.encode("utf-8"))
            return bytes(out)
        if piece is not None and self._spm:
            return piece.replace("\u2581".encode(), b" ")
        return self._tokenizer.decode([token_id]).encode("utf-8")

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            self._cache[token_id] = hit
        return hit


T = TypeVar("T")


@asynccontextmanager
async def closing(it: AsyncIterator[T]) -> AsyncIterator[AsyncIterator[T]]:
    """Close an async generator when the block is left, even early, so the engine
    request behind it is aborted at once rather than when it is garbage collected."""
    try:
        yield it
    finally:
        aclose = getattr(it, "aclose", None)
        if aclose is not None:
            await aclose()


async def framed_stream(
    events: AsyncIterator[str], usage_chunk: Callable[[], dict[str, Any] | None]
) -> AsyncIterator[str]:
    """`events`, then the end every OpenAI stream has: an error event if it failed (the
    status, 200, is already sent), else the usage chunk when one was asked for; then
    [DONE]. A failure is an OpenAIError (or any exception) raised by `events`."""
    failed: OpenAIError | None = None
    try:
        async with closing(events) as body:
            async for event in body:
                yield event
    except OpenAIError as exc:
        failed = exc
    except EngineError as exc:
        failed = server_error(f"The engine could not take this request: {exc}", "engine_error")
    except Exception as exc:  # never end a stream without saying why
        logging.getLogger(__name__).exception("stream failed")
        failed = server_error(f"Internal server error ({type(exc).__name__}).")
    if failed is not None:
        note_error(failed.code or failed.type)
        yield sse(failed.body())
    else:
        usage = usage_chunk()
        if usage is not None:
            yield sse(usage)
    yield sse("[DONE]")


class ClientGone(OpenAIError):
    """The client disconnected before a non-streaming response was ready.

    Nobody reads the reply; 499 (nginx's "client closed request") keeps access logs clear.
    """

    def __init__(self) -> None:
        super().__init__(499, "The client closed the request.", code="client_closed_request")


async def cancel_on_disconnect(receive: Any, work: Any) -> Any:
    """Await `work`; if the client disconnects first, cancel it and raise ClientGone.

    Cancelling the work closes the engine's output iterator, which aborts the
    request and frees its KV blocks. Must be called after the body was read.
    """
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the handler itself was cancelled
        task.cancel()
        watcher.cancel()
        raise
    watcher.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientGone()
    return task.result()
