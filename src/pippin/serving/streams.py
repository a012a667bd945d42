"""Streams of a request's events: closed when left, and failures turned into one error.

Every API's stream goes through `guarded`: whatever fails after the response began (an
`ApiError`, the engine refusing, a bug) is logged once, counted in the request's record
(the errors metric and the request log), and handed to the API's own formatter as an
`ApiError`, so a stream never ends without saying why.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from pippin.engine.client import EngineError
from pippin.obs.http import note_error
from pippin.serving.errors import ApiError, server_error

log = logging.getLogger(__name__)

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


def as_api_error(exc: Exception) -> ApiError:
    """What a failure mid-stream tells the client (never internals such as paths)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineError):
        return server_error(f"The engine could not take this request: {exc}", "engine_error")
    log.exception("stream failed", exc_info=exc)
    return server_error(f"Internal server error ({type(exc).__name__}).")


async def guarded(events: AsyncIterator[T], failed: Callable[[ApiError], T]) -> AsyncIterator[T]:
    """`events`, and if they fail, the failure noted and formatted by `failed` as the
    stream's last event (its status, 200, is already sent)."""
    try:
        async with closing(events) as body:
            async for event in body:
                yield event
    except Exception as exc:  # noqa: BLE001 - every failure is sent, never hidden
        err = as_api_error(exc)
        note_error(err.code or err.type)
        yield failed(err)
