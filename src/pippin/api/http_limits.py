"""Limits on a request's head (header count and size, URL length) and the CORS settings.

uvicorn's httptools parser takes headers and URLs of any size; a head over these limits is
refused before any route, key check or body read, with 431 or 414 in the API's error format.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from pippin.api.errors import OpenAIError

KIB = 1024


@dataclass(frozen=True)
class HeadLimits:
    max_headers: int = 100
    max_header_bytes: int = 32 * KIB  # names and values of all headers together
    max_url_bytes: int = 8 * KIB  # path and query string


@dataclass(frozen=True)
class CorsSettings:
    """Cross-origin access from browsers (vLLM's flags); off unless origins are given."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


class HeadLimitsMiddleware:
    def __init__(self, app: ASGIApp, limits: HeadLimits) -> None:
        self.app = app
        self.limits = limits

    def _refusal(self, scope: Scope) -> OpenAIError | None:
        lim = self.limits
        url = len(scope.get("raw_path") or scope["path"].encode()) + len(scope["query_string"])
        if url > lim.max_url_bytes:
            return OpenAIError(
                414,
                f"The URL is too long: this server accepts at most {lim.max_url_bytes} bytes.",
                code="uri_too_long",
            )
        headers = scope["headers"]
        if len(headers) > lim.max_headers:
            return OpenAIError(
                431,
                f"Too many headers: this server accepts at most {lim.max_headers}.",
                code="request_header_fields_too_large",
            )
        if sum(len(k) + len(v) for k, v in headers) > lim.max_header_bytes:
            return OpenAIError(
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
            await refusal.response(scope["path"])(scope, receive, send)
