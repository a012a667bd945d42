"""What every API surface shares: strict request models, body parsing, SSE framing,
and the client-disconnect watch."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from typing import Annotated, Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Discriminator, Field, ValidationError

from pippin.api.errors import from_validation_error
from pippin.serving.errors import ApiError
from pippin.serving.model_admin import check_admin
from pippin.serving.state import ServerState

# Parsing a big body (up to the body cap) takes long enough to stall other
# requests, so above this size it runs in a worker thread.
_PARSE_INLINE_MAX = 256 * 1024

# Event streams must reach the client as they are written: no caches, no proxy buffering.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# Every stop sequence is searched for after every token on the engine's thread, which all
# requests share: a request with thousands of them would slow everyone's decoding.
MAX_STOP_SEQUENCES = 64
StopSequences = Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Loose(BaseModel):
    """Parts parsed only so the handler can refuse them by name."""

    model_config = ConfigDict(extra="allow")


def by_tag(key: str, *values: str) -> Discriminator:
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


# json.dumps escapes the C0 controls (\r, \x0b, \x0c, \x1c-\x1e) but writes these raw with
# ensure_ascii=False: U+0085, U+2028 and U+2029 are line breaks to clients that split lines
# as `str.splitlines` does (httpx's aiter_lines) and would cut the event there; a lone
# surrogate (from a "\\ud800" escape the model wrote in tool arguments) cannot be encoded to
# UTF-8 at all. Outside strings JSON holds only ASCII, so escaping them anywhere in the text
# changes nothing but the framing.
_UNSAFE = re.compile("[\x85\u2028\u2029\ud800-\udfff]")


def _escape(m: re.Match[str]) -> str:
    return f"\\u{ord(m.group()):04x}"


def sse_json(payload: dict[str, Any]) -> str:
    """`payload` as JSON on one line for every line splitter (SSE's, `str.splitlines`)."""
    return _UNSAFE.sub(_escape, json.dumps(payload, ensure_ascii=False))


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event line as the OpenAI chat and completions streams carry it."""
    data = payload if isinstance(payload, str) else sse_json(payload)
    return f"data: {data}\n\n"


def obfuscation() -> str:
    """Random padding of random length that hides the size of a stream's deltas on the wire
    (OpenAI's `stream_options.include_obfuscation`)."""
    return secrets.token_urlsafe(secrets.randbelow(12) + 1)


def typed_sse(event: dict[str, Any]) -> str:
    """One event named by its ``type`` (``event:`` line), as the Anthropic Messages and
    OpenAI Responses streams carry them."""
    return f"event: {event['type']}\ndata: {sse_json(event)}\n\n"


T = TypeVar("T")


class ClientGone(ApiError):
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


def get_state(request: Request) -> ServerState:
    """The server's state, which every route reaches through the app."""
    return request.app.state.pippin


def require_admin(request: Request) -> ServerState:
    """The server's state, once the request may manage models (else the 403 of
    `pippin.serving.model_admin.check_admin`)."""
    state = get_state(request)
    check_admin(state.settings, request.scope.get("state", {}).get("pippin_key"))
    return state
