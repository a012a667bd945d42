"""Every middleware of the app, outermost last in `server.middleware_stack`.

- `HeadLimitsMiddleware`: a head over the limits (`HeadLimits`) is refused with 431 or 414
  before any route, key check or body read.
- `ApiKeyMiddleware`: the key on every route but the open ones.
- `BodyLimitMiddleware`: bodies over the cap, by Content-Length and as they arrive.
- `AdmissionMiddleware`: draining, the key's limits and the queue (`serving.admission`).
- `LeaseMiddleware`: the models a request uses stay loaded until its response is sent.
"""

from __future__ import annotations

import base64
import hmac
import time
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pippin.api.errors import error_response, is_anthropic_path
from pippin.obs.http import current_record
from pippin.serving.admission import Admission, current_key
from pippin.serving.errors import ApiError
from pippin.serving.registry import ModelRegistry, request_leases
from pippin.serving.settings import KIB, MIB, HeadLimits

# The routes that generate: the queue limit applies to them.
GENERATION_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses"}
)


class AdmissionMiddleware:
    """Inside the key check: draining, then the key's limits, then the queue."""

    def __init__(self, app: ASGIApp, admission: Admission) -> None:
        self.app = app
        self.a = admission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        a, path = self.a, scope["path"]
        if a.draining and path != "/health":  # /health answers 503 itself
            await error_response(_unavailable(a.retry_after_s), path)(scope, receive, send)
            return
        use = scope.get("state", {}).get("pippin_key")
        now = time.monotonic()
        if use is not None:
            err = use.refusal(now)
            if err is not None:
                await error_response(err, path)(scope, receive, send)
                return
        generating = path in GENERATION_PATHS
        record = current_record() if generating else None
        if generating and a.max_queue is not None and a.queued() >= a.max_queue:
            await error_response(_queue_full(path, a.retry_after_s), path)(scope, receive, send)
            return
        a.in_flight += 1
        if record is not None:
            a.generating[id(record)] = record
        token = current_key.set(use.key) if use is not None else None
        if use is not None:
            use.starts.append(now)
            use.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            a.in_flight -= 1
            if record is not None:
                a.generating.pop(id(record), None)
            if use is not None:
                use.in_flight -= 1
                t = record.timing if record is not None else None
                if t is not None:
                    use.charge(time.monotonic(), t.prompt_tokens + t.completion_tokens)
            if token is not None:
                current_key.reset(token)


def _unavailable(retry_after: int) -> ApiError:
    return ApiError(
        503,
        "The server is shutting down; retry on another instance or shortly.",
        type="server_error",
        code="server_shutting_down",
        headers={"Retry-After": str(retry_after)},
    )


def _queue_full(path: str, retry_after: int) -> ApiError:
    message = "The server's queue is full; try again shortly."
    headers = {"Retry-After": str(retry_after)}
    if is_anthropic_path(path):
        return ApiError(529, message, type="overloaded_error", headers=headers)
    return ApiError(429, message, type="server_error", code="queue_full", headers=headers)


def key_check(admission: Admission) -> Callable[[str, Scope], bool]:
    """For the API key middleware: whether `supplied` is one of the file's keys (then
    remembered in the scope for the limits)."""

    def check(supplied: str, scope: Scope) -> bool:
        use = admission.key_for(supplied)
        if use is None:
            return False
        scope.setdefault("state", {})["pippin_key"] = use
        return True

    return check


class HeadLimitsMiddleware:
    def __init__(self, app: ASGIApp, limits: HeadLimits) -> None:
        self.app = app
        self.limits = limits

    def _refusal(self, scope: Scope) -> ApiError | None:
        lim = self.limits
        url = len(scope.get("raw_path") or scope["path"].encode()) + len(scope["query_string"])
        if url > lim.max_url_bytes:
            return ApiError(
                414,
                f"The URL is too long: this server accepts at most {lim.max_url_bytes} bytes.",
                code="uri_too_long",
            )
        headers = scope["headers"]
        if len(headers) > lim.max_headers:
            return ApiError(
                431,
                f"Too many headers: this server accepts at most {lim.max_headers}.",
                code="request_header_fields_too_large",
            )
        if sum(len(k) + len(v) for k, v in headers) > lim.max_header_bytes:
            return ApiError(
                431,
                "The headers are too large: this server accepts at most "
                f"{lim.max_header_bytes // KIB} KiB of them.",
                code="request_header_fields_too_large",
            )
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        refusal = self._refusal(scope) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await error_response(refusal, scope["path"])(scope, receive, send)


class ApiKeyMiddleware:
    """Every route but the open ones needs the key (Bearer, x-api-key, or HTTP Basic).

    The web page's paths answer a missing key with a Basic challenge, so a browser asks for
    it (any user name, the key as password) and then sends it on the page's own API calls.
    ``HEAD /`` stays open: it has no body, and clients probe it to see the server is up.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        open_paths: frozenset[str],
        other_keys: Callable[[str, Scope], bool] | None = None,
        page_paths: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.key = api_key.encode() if api_key else None
        self.open_paths = open_paths
        self.page_paths = page_paths
        self.other_keys = other_keys  # --api-keys: the file's keys, with their limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        no_key = self.key is None and self.other_keys is None
        path = scope.get("path", "")
        probe = path == "/" and scope.get("method") == "HEAD"
        if scope["type"] != "http" or no_key or path in self.open_paths or probe:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        supplied = headers.get("x-api-key")
        auth = headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            supplied = auth[7:].strip()
        elif auth[:6].lower() == "basic ":
            supplied = _basic_password(auth[6:])
        challenge = 'Basic realm="pippin", charset="UTF-8"' if path in self.page_paths else "Bearer"
        if supplied is None:
            err = ApiError(
                401,
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>' "
                "or in the 'x-api-key' header.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": challenge},
            )
        elif not (
            (self.key is not None and hmac.compare_digest(supplied.encode(), self.key))
            or (self.other_keys is not None and self.other_keys(supplied, scope))
        ):
            # The key itself is never echoed or logged.
            err = ApiError(
                401,
                "Incorrect API key provided.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": challenge},
            )
        else:
            await self.app(scope, receive, send)
            return
        await error_response(err, scope["path"])(scope, receive, send)


def _basic_password(credentials: str) -> str | None:
    """The password of HTTP Basic credentials (the user name is ignored), or None."""
    try:
        _, sep, password = (
            base64.b64decode(credentials.strip(), validate=True).decode().partition(":")
        )
    except (ValueError, UnicodeDecodeError):
        return None
    return password if sep else None


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"The request body is too large: this server accepts at most {limit / MIB:g} MiB.",
        code="request_too_large",
    )


class BodyLimitMiddleware:
    """Refuse bodies over the cap: by Content-Length before reading anything, and by
    counting the bytes as they arrive (chunked uploads), so a huge body is never
    held in memory."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, per_path: dict[str, int] | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.per_path = per_path or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        # A key ending in "/" caps every path under it (the blob uploads of /api/blobs/).
        max_bytes = next(
            (cap for p, cap in self.per_path.items() if p.endswith("/") and path.startswith(p)),
            self.per_path.get(path, self.max_bytes),
        )
        length = Headers(scope=scope).get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_bytes):
            await error_response(_too_large(max_bytes), scope["path"])(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > max_bytes:
                    # Raised inside the route's body read; the error handler answers 413.
                    raise _too_large(max_bytes)
            return message

        await self.app(scope, counted, send)


class LeaseMiddleware:
    """Holds the models a request acquired until its response has been sent (a stream
    until its end), so they are neither unloaded nor evicted while in use."""

    def __init__(self, app: ASGIApp, registry: Callable[[], ModelRegistry | None]) -> None:
        self.app = app
        self.registry = registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with request_leases() as leases:
            try:
                await self.app(scope, receive, send)
            finally:
                registry = self.registry()
                if registry is not None:
                    registry.release(leases)
