"""Which model is served and whether it is ready: /v1/models, /health, /version.

Also the helpers every OpenAI route uses to find the served model (404 for an
unknown name) and the running engine (503 until it is ready).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pippin import __version__
from pippin.api.errors import OpenAIError, server_error

if TYPE_CHECKING:
    from pippin.embed.models import Kind, ServedModel
    from pippin.embed.worker import EmbedWorker
    from pippin.engine.async_engine import AsyncEngine
    from pippin.server import ServerState
    from pippin.store.loaded import LoadedModel

router = APIRouter()


def get_state(request: Request) -> ServerState:
    return request.app.state.pippin


def check_model(state: ServerState, name: str, names: list[str] | None = None) -> None:
    """404 unless ``name`` is one of ``names`` (default: the chat model's names)."""
    if name not in (state.model_names if names is None else names):
        raise OpenAIError(
            404,
            f"The model '{name}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


def require_engine(state: ServerState) -> tuple[AsyncEngine, LoadedModel]:
    engine, loaded = state.engine, state.loaded
    if engine is None or loaded is None or not engine.ready:
        raise server_error("The model is not ready; try again shortly.", "model_not_ready", 503)
    return engine, loaded


def require_extra_model(
    state: ServerState, kind: Kind, name: str | None
) -> tuple[EmbedWorker, ServedModel]:
    """The embedding or rerank model a request names (None: the only one served)."""
    names = state.extra_names.get(kind, [])
    if not names:
        raise OpenAIError(
            404,
            f"This server serves no {kind} model (start it with --{kind}-model).",
            param="model",
            code="model_not_found",
        )
    if name is not None:
        check_model(state, name, names)
    worker = state.embed
    if worker is None or not worker.ready or kind not in worker.models:
        raise server_error(
            f"The {kind} model is not ready; try again shortly.", "model_not_ready", 503
        )
    return worker, worker.models[kind]


def _all_names(state: ServerState) -> list[str]:
    return state.model_names + [n for names in state.extra_names.values() for n in names]


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "pippin",
    }
    extra = state.extra_model(name)
    if extra is not None:
        card["max_model_len"] = extra.max_len
    elif state.engine is not None and state.engine.ready:
        card["max_model_len"] = state.engine.max_model_len  # as vLLM reports it
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = get_state(request)
    return {"object": "list", "data": [_model_card(state, n) for n in _all_names(state)]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    check_model(state, model_id, _all_names(state))
    return _model_card(state, model_id)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    state = get_state(request)
    engine = state.engine
    embed_ok = state.embed is None or state.embed.ready
    if engine is not None and engine.ready and embed_ok:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/v1/engine/stats")
async def engine_stats(request: Request) -> dict[str, int]:
    # A debugging aid (and what the load tests check KV blocks with) until /metrics.
    engine = get_state(request).engine
    return engine.stats() if engine is not None else {}
