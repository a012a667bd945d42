"""The OpenAPI document (/openapi.json) as the routes really behave.

The routes read their bodies themselves (strict parsing, errors in each API's format), so
FastAPI cannot see them: each route declares its body model and error format here
(`openai_route`, `anthropic_route`, `ollama_route`), and `install_openapi` puts the models'
schemas into the document. FastAPI's own 422 is replaced by the 400 the error handlers really send.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIErrorBody(BaseModel):
    """The body of every error on the OpenAI routes."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicErrorBody(BaseModel):
    """The body of every error on /v1/messages*."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class OllamaErrorBody(BaseModel):
    """The body of every error on the Ollama routes (/api/*)."""

    error: str


# What any route may answer besides success: bad input, the key, an unknown model or id,
# the size limits, the server's own failures and overload.
_ERRORS = {
    400: "The request is invalid; `param` names the field.",
    401: "The API key is missing or wrong.",
    404: "No such model, object or route.",
    413: "The request body is over the server's limit.",
    414: "The URL is too long.",
    429: "Too many requests.",
    431: "Too many or too large headers.",
    500: "Internal server error.",
    503: "No model is loaded yet, or the server is shutting down.",
}
# Anthropic says "overloaded" with 529 where OpenAI says 503.
_ANTHROPIC_ERRORS = {529 if k == 503 else k: v for k, v in _ERRORS.items()}

_BODIES: dict[str, type[BaseModel]] = {}
# What a success holds, by media type: any JSON; server-sent events (each a `data:` line,
# most with an `event:` name); else text.
_SCHEMAS: dict[str, dict[str, Any]] = {
    "application/json": {},
    "text/event-stream": {
        "type": "object",
        "required": ["data"],
        "properties": {"event": {"type": "string"}, "data": {"type": "string"}},
    },
}


def _route(
    errors: dict[int, str],
    error_model: type[BaseModel],
    body: type[BaseModel] | None,
    media: tuple[str, ...],
) -> dict[str, Any]:
    ok = {m: {"schema": _SCHEMAS.get(m, {"type": "string"})} for m in media}
    responses: dict[int | str, dict[str, Any]] = {
        200: {"description": "Success", "content": ok},
        **{s: {"description": d, "model": error_model} for s, d in errors.items()},
    }
    kwargs: dict[str, Any] = {"responses": responses}
    if body is not None:
        _BODIES[body.__name__] = body
        schema = {"$ref": _REF.format(model=body.__name__)}
        kwargs["openapi_extra"] = {
            "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}
        }
    return kwargs


_JSON = ("application/json",)
_STREAM = ("application/json", "text/event-stream")


def openai_route(
    body: type[BaseModel] | None = None, *, stream: bool = False, media: tuple[str, ...] = _JSON
) -> dict[str, Any]:
    """The route decorator's `responses` and `openapi_extra` for a route that answers
    errors as OpenAI does and parses `body` by hand (`stream`: it can answer with
    server-sent events; `media`: what else a success is)."""
    return _route(_ERRORS, OpenAIErrorBody, body, _STREAM if stream else media)


def anthropic_route(body: type[BaseModel], *, stream: bool = False) -> dict[str, Any]:
    """As `openai_route`, for the Anthropic routes and their error format."""
    return _route(_ANTHROPIC_ERRORS, AnthropicErrorBody, body, _STREAM if stream else _JSON)


def ollama_route(body: type[BaseModel] | None = None, *, stream: bool = False) -> dict[str, Any]:
    """As `openai_route`, for the Ollama routes: their error format, and NDJSON lines
    (streaming is Ollama's default)."""
    media = ("application/json", "application/x-ndjson") if stream else _JSON
    return _route(_ERRORS, OllamaErrorBody, body, media)


def build_openapi(app: FastAPI) -> dict[str, Any]:
    with warnings.catch_warnings():
        # GET and HEAD of one route share an operation id; renamed below.
        warnings.filterwarnings("ignore", "Duplicate Operation ID")
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    refs, defs = models_json_schema(
        [(m, "validation") for m in _BODIES.values()], ref_template=_REF
    )
    for (model, _), ref in refs.items():
        # A clash of names would point a route at another model's schema.
        assert ref["$ref"] == _REF.format(model=model.__name__), ref
    schemas.update(defs.get("$defs", {}))
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            # Validation errors leave as the API's 400 (errors.install_error_handlers).
            op.get("responses", {}).pop("422", None)
            # FastAPI names GET and HEAD of one route alike, after whichever its set of
            # methods yields first; the method and path name each one, the same every run.
            op["operationId"] = re.sub(r"\W+", "_", f"{method}{path}").strip("_")
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve `build_openapi`'s document (built once, on first request)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
