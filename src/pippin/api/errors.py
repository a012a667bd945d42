"""OpenAI-style errors: one exception type, its JSON body, and the app's handlers.

Every failure the OpenAI surface returns has the body
``{"error": {"message", "type", "param", "code"}}`` so that the official SDKs raise
the right exception class with a readable message.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pippin.obs.http import note_error

logger = logging.getLogger(__name__)

# pydantic puts union member labels and our discriminator tags into error
# locations; they are not field names, so they must not reach `param`.
_TYPE_LABELS = {"str", "int", "float", "bool", "none", "dict", "list", "bytes"}


class OpenAIError(Exception):
    """An error to be sent to the client as an OpenAI error body."""

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

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else None)
        return {
            "type": "error",
            "error": {"type": kind or "invalid_request_error", "message": self.message},
        }

    def response(self, path: str = "") -> JSONResponse:
        """The error as the API at `path` writes errors (Ollama's, Anthropic's or OpenAI's)."""
        note_error(self.code or self.type)
        if is_ollama_path(path):
            # Ollama's body is the message alone; its statuses are HTTP's own.
            return JSONResponse({"error": self.message}, self.status, headers=self.headers)
        if is_anthropic_path(path):
            status = 529 if self.status == 503 else self.status  # Anthropic's "overloaded"
            return JSONResponse(self.anthropic_body(), status_code=status, headers=self.headers)
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_ollama_path(path: str) -> bool:
    return path.startswith("/api/")


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def unsupported_param(param: str, why: str = "") -> OpenAIError:
    """A field that pippin does not support (yet), named so the client can drop it."""
    tail = f" {why}" if why else ""
    return OpenAIError(
        400,
        f"Unsupported parameter: '{param}' is not supported by this server.{tail}",
        param=param,
        code="unsupported_parameter",
    )


def unsupported_value(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=param, code="unsupported_value")


def server_error(message: str, code: str | None = None, status: int = 500) -> OpenAIError:
    return OpenAIError(status, message, type="server_error", code=code)


def loc_to_param(loc: tuple[int | str, ...]) -> str | None:
    """('messages', 0, '@user', 'content') -> 'messages[0].content'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if (
            part.startswith("@")
            or "[" in part
            or part in _TYPE_LABELS
            or any(c.isupper() for c in part)
        ):
            continue
        out += f".{part}" if out else part
    return out or None


def from_validation_error(exc: ValidationError | RequestValidationError) -> OpenAIError:
    """Turn pydantic's errors into one 400 that names the first offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request body.")
    # A union reports one error per member; the deepest location is the most
    # specific one (e.g. 'messages[0].content[1].type' rather than '...content').
    # Among those, a broken constraint says more than another member's type mismatch
    # (`stop` is a string or a list: a too-long list is not "not a string").
    first = max(
        errors,
        key=lambda e: (
            len(loc_to_param(tuple(e.get("loc", ()))) or ""),
            not e.get("type", "").endswith("_type"),
        ),
    )
    kind = first.get("type", "")
    param = loc_to_param(tuple(first.get("loc", ())))
    if kind == "json_invalid":
        return bad_request(
            "We could not parse the JSON body of your request: "
            f"{first.get('msg', 'invalid JSON')}. The API expects a JSON object.",
            code="invalid_json",
        )
    if kind == "model_type" and param is None:
        return bad_request("The request body must be a JSON object.", code="invalid_json")
    if kind == "extra_forbidden":
        return bad_request(
            f"Unrecognized request argument supplied: {param}",
            param=param,
            code="unknown_parameter",
        )
    if kind.startswith("invalid_tag_"):
        # Our tagged unions: the tag field itself holds an unknown value.
        field = kind.removeprefix("invalid_tag_")
        param = f"{param}.{field}" if param else field
        return bad_request(
            f"Invalid value for '{param}': {first.get('msg')}.", param=param, code="invalid_value"
        )
    if kind == "missing":
        return bad_request(
            f"Missing required parameter: '{param}'.",
            param=param,
            code="missing_required_parameter",
        )
    msg = first.get("msg", "invalid value")
    more = f" ({len(errors) - 1} more problem(s) in the request)" if len(errors) > 1 else ""
    return bad_request(
        f"Invalid value for '{param or 'body'}': {msg}.{more}",
        param=param,
        code="invalid_type" if kind.endswith("_type") else "invalid_value",
    )


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the app as an OpenAI error body (no FastAPI 422s)."""

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, OpenAIError)
        return exc.response(request.url.path)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        return from_validation_error(exc).response(request.url.path)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        code = {404: "not_found", 405: "method_not_allowed"}.get(status)
        err = OpenAIError(
            status,
            str(exc.detail),
            type="invalid_request_error" if status < 500 else "server_error",
            code=code,
            headers=getattr(exc, "headers", None),
        )
        return err.response(request.url.path)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The traceback goes to the log (no request content in it); the client
        # gets the exception class only, never internals such as file paths.
        logger.exception("unhandled error while serving a request")
        err = server_error(f"Internal server error ({type(exc).__name__}).")
        return err.response(request.url.path)

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
