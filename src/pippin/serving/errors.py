"""The one error type a request can fail with, whatever its API, and its builders.

Each API writes it in its own body (`pippin.api.errors`); here it is only the status, the
message, the kind and the field it names.
"""

from __future__ import annotations


class ApiError(Exception):
    """A request's failure, to be sent in the error body of the API it came through."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unsupported_param(param: str, why: str = "") -> ApiError:
    """A field that pippin does not support (yet), named so the client can drop it."""
    tail = f" {why}" if why else ""
    return ApiError(
        400,
        f"Unsupported parameter: '{param}' is not supported by this server.{tail}",
        param=param,
        code="unsupported_parameter",
    )


def unsupported_value(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="unsupported_value")


def server_error(message: str, code: str | None = None, status: int = 500) -> ApiError:
    return ApiError(status, message, type="server_error", code=code)


def retry_later(message: str, code: str, retry_after: int) -> ApiError:
    """A 503 that tells the client when to try again (``Retry-After``, seconds)."""
    return ApiError(
        503, message, type="server_error", code=code, headers={"Retry-After": str(retry_after)}
    )
