"""Errors on the wire: `ApiError` in each API's body, and the app's handlers.

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
from pippin.serving.errors import ApiError, bad_request, server_error

logger = logging.getLogger(__name__)

# pydantic puts union member labels and our discriminator tags into error
# locations; they are not field names, so they must not reach `param`.
_TYPE_LABELS = {"str", "int", "float", "bool", "none", "dict", "list", "bytes"}


def openai_body(err: ApiError) -> dict[str, Any]:
    return {
        "error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    }


def anthropic_body(err: ApiError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(err.status, "api_error" if err.status >= 500 else None)
    return {
        "type": "error",
        "error": {"type": kind or "invalid_request_error", "message": err.message},
    }


def error_response(err: ApiError, path: str = "") -> JSONResponse:
    """The error as the API at `path` writes errors (Ollama's, Anthropic's or OpenAI's)."""
    note_error(err.code or err.type)
    if is_ollama_path(path):
        # Ollama's body is the message alone; its statuses are HTTP's own.
        return JSONResponse({"error": err.message}, err.status, headers=err.headers)
    if is_anthropic_path(path):
        status = 529 if err.status == 503 else err.status  # Anthropic's "overloaded"
        return JSONResponse(anthropic_body(err), status_code=status, headers=err.headers)
    return JSONResponse(openai_body(err), status_code=err.status, headers=err.headers)


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


def from_validation_error(exc: ValidationError | RequestValidationError) -> ApiError:
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
    """Every error leaves the app in the error body of the API its path belongs to (no
    FastAPI 422s)."""

    async def on_openai_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc, request.url.path)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError | ValidationError)
        return error_response(from_validation_error(exc), request.url.path)

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        code = {404: "not_found", 405: "method_not_allowed"}.get(status)
        err = ApiError(
            status,
            str(exc.detail),
            type="invalid_request_error" if status < 500 else "server_error",
            code=code,
            headers=getattr(exc, "headers", None),
        )
        return error_response(err, request.url.path)

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The traceback goes to the log (no request content in it); the client
        # gets the exception class only, never internals such as file paths.
        logger.exception("unhandled error while serving a request")
        err = server_error(f"Internal server error ({type(exc).__name__}).")
        return error_response(err, request.url.path)

    app.add_exception_handler(ApiError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(ValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
