"""The outermost middleware: counts every HTTP request and logs one line per request.

A `RequestRecord` lives in a context variable for the duration of the request, so that
code deeper down can add to it without being handed it: the engine observer attaches the
request's timings and token counts, and error responses note their kind (`note_error`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from pippin.obs.metrics import Metrics
    from pippin.obs.timing import RequestTiming

log = logging.getLogger("pippin.request")

# The paths of every API surface: OpenAI's and Anthropic's, then Ollama's.
API_PREFIXES = ("/v1/", "/api/")


@dataclass
class RequestRecord:
    method: str
    path: str
    t_start: float
    status: int | None = None
    error: str | None = None  # the error body's code (or type)
    timing: RequestTiming | None = None
    # --log-prompts only: the first bytes of the request and response bodies.
    request_body: bytearray | None = None
    response_body: bytearray | None = None


# What --log-prompts keeps of each body: enough to read a prompt, bounded per request.
BODY_LOG_BYTES = 16 * 1024


def _keep(buf: bytearray | None, chunk: bytes) -> None:
    if buf is not None and len(buf) < BODY_LOG_BYTES:
        buf += chunk[: BODY_LOG_BYTES - len(buf)]


_current: ContextVar[RequestRecord | None] = ContextVar("pippin_request", default=None)


def current_record() -> RequestRecord | None:
    return _current.get()


def note_error(kind: str | None) -> None:
    """Called where an error body is sent; the first error of a request wins."""
    record = _current.get()
    if record is not None and record.error is None:
        record.error = kind or "unknown"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def request_fields(record: RequestRecord, endpoint: str) -> dict[str, Any]:
    """The log line's fields: what was asked and how it went, never its content."""
    t = record.timing
    fields: dict[str, Any] = {
        "request_id": t.request_id if t is not None else f"req-{uuid.uuid4().hex[:12]}",
        "method": record.method,
        "endpoint": endpoint,
        "status": record.status,
        "duration_s": _round(time.perf_counter() - record.t_start),
    }
    if record.error is not None:
        fields["error"] = record.error
    for name in ("request_body", "response_body"):
        buf = getattr(record, name)
        if buf:
            fields[name] = buf.decode("utf-8", "replace")
    if t is not None:
        fields.update(
            prompt_tokens=t.prompt_tokens,
            cached_tokens=t.cached_tokens,
            completion_tokens=t.completion_tokens,
            finish_reason=t.finish_reason,
            cancelled=t.cancelled,
            queue_s=_round(t.queue_s),
            ttft_s=_round(t.ttft_s),
            tpot_s=_round(t.tpot),
            e2e_s=_round(t.e2e_s),
        )
    return fields


def _endpoint(scope: Scope, routes: Sequence[BaseRoute]) -> str:
    """The route's template (/v1/models/{model_id:path}), never the raw path, so labels
    stay few; "other" for paths no route serves."""
    route = scope.get("route")
    if route is None:  # answered before routing (401, 413): find the route it was for
        route = next((r for r in routes if r.matches(scope)[0] is not Match.NONE), None)
    return getattr(route, "path", None) or "other"


class ObservabilityMiddleware:
    """Counts requests by route and status, counts errors by kind, logs each request.

    API requests (OpenAI's and Anthropic's /v1/..., Ollama's /api/...) are logged at INFO;
    the rest (health checks, scrapes, the web page's files) at DEBUG, so polling does not
    flood the log. Prompts and outputs are never logged, unless `log_bodies`
    (--log-prompts): then the line holds the first `BODY_LOG_BYTES` of the request and
    response bodies.
    """

    def __init__(
        self,
        app: ASGIApp,
        metrics: Metrics | None,
        routes: Sequence[BaseRoute] = (),
        log_bodies: bool = False,
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes  # to name the route of requests refused before routing
        self.log_bodies = log_bodies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["method"], scope["path"], time.perf_counter())
        if self.log_bodies:
            record.request_body, record.response_body = bytearray(), bytearray()
        token = _current.set(record)

        async def receive_body() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                _keep(record.request_body, message.get("body", b""))
            return message

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            elif message["type"] == "http.response.body":
                _keep(record.response_body, message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive_body if self.log_bodies else receive, send_status)
        except BaseException:
            if record.status is None:
                record.status = 500
                note_error("internal_error")
            raise
        finally:
            _current.reset(token)
            self._done(record, scope)

    def _done(self, record: RequestRecord, scope: Scope) -> None:
        endpoint = _endpoint(scope, self.routes)
        status = record.status or 0
        if self.metrics is not None:
            self.metrics.http_requests.labels(endpoint, record.method, str(status)).inc()
            if record.error is not None:
                self.metrics.errors.labels(record.error).inc()
        level = logging.INFO if record.path.startswith(API_PREFIXES) else logging.DEBUG
        if log.isEnabledFor(level):
            log.log(level, "request", extra={"fields": request_fields(record, endpoint)})
