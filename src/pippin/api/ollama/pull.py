"""POST /api/pull: a Hugging Face model into the library (`pippin.store.hub_pull`), with
Ollama's progress lines.

The repo is listed before the answer starts, so a bad name, a missing repo or tag and a
full disk are an error status with Ollama's body; a failure after that ends the stream with
an ``{"error": ...}`` line. The download runs in a worker thread; a client that leaves
stops it at the next chunk, and what was fetched stays in the partial folder for the next
pull (nothing is listed until the whole model is checked).
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pippin.api.common import cancel_on_disconnect, parse_request, require_admin
from pippin.api.ollama.managed import managed_route
from pippin.api.ollama.protocol import Lenient
from pippin.api.openapi import OllamaErrorBody
from pippin.serving.errors import ApiError, bad_request
from pippin.serving.registry import ModelRegistry
from pippin.store.hub_files import PullError
from pippin.store.hub_pull import PullEvent, PullPlan, plan_pull, run_pull

logger = logging.getLogger(__name__)
router = APIRouter()
T = TypeVar("T")

NDJSON = "application/x-ndjson"
_LINE_EVERY_S = 0.1  # a file's progress line at most this often (its first and last always)
_STATUS = {
    "bad_name": 400,
    "not_found": 404,
    "auth": 403,
    "network": 502,
    "checksum": 502,
    "disk": 507,
    "cancelled": 499,
}
_HUB_FAILED = "Hugging Face cannot be reached, failed, or sent a file that fails its checksum."


class PullRequest(Lenient):
    model: str = ""
    name: str = ""  # the field's old name
    insecure: bool = False
    stream: bool = True


def api_error(e: PullError) -> ApiError:
    status = _STATUS.get(e.kind, 500)
    return ApiError(
        status,
        e.message,
        type="server_error" if status >= 500 else "invalid_request_error",
        param="model" if e.kind in ("bad_name", "not_found") else None,
        code=e.kind,
    )


class _Throttle:
    """Keeps a file's first and last progress events, and others once `_LINE_EVERY_S`
    has passed or the file grew by a hundredth since the last one kept."""

    def __init__(self) -> None:
        self.last: dict[str, tuple[float, int]] = {}

    def keep(self, event: PullEvent) -> bool:
        if event.digest is None or event.completed == event.total:
            return True
        now, done = time.monotonic(), event.completed or 0
        last = self.last.get(event.digest)
        step = (event.total or 0) // 100
        if last is not None and now - last[0] < _LINE_EVERY_S and done - last[1] < step:
            return False
        self.last[event.digest] = (now, done)
        return True


def _line(payload: dict[str, Any]) -> str:
    return json.dumps(payload) + "\n"


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    """``fn(*args)`` on the loop, from another thread; nothing once the server stopped."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed
        pass


def _in_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """``fn()`` in a thread of its own: a pull takes minutes, and would hold one of the
    default executor's few threads that requests share."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if future.done():  # cancelled: nobody waits
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        try:
            result = fn()
        except BaseException as e:
            _call_soon(loop, settle, None, e)
        else:
            _call_soon(loop, settle, result, None)

    threading.Thread(target=work, name="pippin-pull", daemon=True).start()
    return future


async def _run(
    plan: PullPlan, registry: ModelRegistry, progress: Any, cancel: threading.Event
) -> None:
    """The pull in its thread; cancelled (the client left): the thread stops too."""
    try:
        await _in_thread(lambda: run_pull(plan, registry.library, progress, cancel))
    except asyncio.CancelledError:
        cancel.set()
        raise


def _retrieve(task: asyncio.Future[None]) -> None:
    """Mark the outcome seen: after a client left, nobody else reads it."""
    if not task.cancelled():
        task.exception()


async def _lines(plan: PullPlan, registry: ModelRegistry) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    events: asyncio.Queue[PullEvent | None] = asyncio.Queue()
    cancel = threading.Event()
    throttle = _Throttle()

    def progress(event: PullEvent) -> None:  # on the worker thread
        if throttle.keep(event):
            _call_soon(loop, events.put_nowait, event)

    # The thread's last event is queued before its end is (both go through the loop).
    task = asyncio.ensure_future(_run(plan, registry, progress, cancel))
    task.add_done_callback(lambda t: events.put_nowait(None))
    task.add_done_callback(_retrieve)
    try:
        yield _line({"status": "pulling manifest"})
        while (event := await events.get()) is not None:
            if event.status == "success":
                registry.sync_library(force=True)  # listed by the time the client hears
            yield _line(event.wire())
        error = task.exception()
        if isinstance(error, PullError):
            yield _line({"error": error.message})
        elif error is not None:
            logger.error("pull of %s failed", plan.ref.name, exc_info=error)
            yield _line({"error": f"pull failed: {type(error).__name__} (see the server's log)"})
    finally:
        cancel.set()  # the client left mid-stream: stop the download at its next chunk


def _route() -> dict[str, Any]:
    """The OpenAPI entry: Ollama's, the 403 of model management, and the Hub's failures."""
    kwargs = managed_route(PullRequest, stream=True)
    kwargs["responses"] |= {
        502: {"description": _HUB_FAILED, "model": OllamaErrorBody},
        507: {"description": "Not enough disk space for the model.", "model": OllamaErrorBody},
    }
    return kwargs


@router.post("/api/pull", response_model=None, **_route())
async def pull(request: Request) -> Any:
    state = require_admin(request)
    req = await parse_request(PullRequest, await request.body())
    name = req.model or req.name
    if not name:
        raise bad_request("model is required", param="model")
    if req.insecure:
        raise bad_request(
            "insecure: pippin pulls from Hugging Face over verified HTTPS only",
            param="insecure",
        )
    assert state.registry is not None
    registry = state.registry
    try:
        plan = await asyncio.to_thread(plan_pull, name, registry.library)
    except PullError as e:
        raise api_error(e) from None
    if req.stream:
        return StreamingResponse(_lines(plan, registry), media_type=NDJSON)
    try:
        await cancel_on_disconnect(
            request.receive, _run(plan, registry, lambda _: None, threading.Event())
        )
    except PullError as e:
        raise api_error(e) from None
    registry.sync_library(force=True)
    return JSONResponse({"status": "success"})
