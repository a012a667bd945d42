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
    from pippin.engine.async_engine import AsyncEngine
    from pippin.server import ServerState
    from pippin.store.loaded import LoadedModel

router = APIRouter()


def get_state(request: Request) -> ServerState:
    return request.app.state.pippin


def check_model(state: ServerState, name: str) -> None:
    if name not in state.model_names:
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


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "pippin",
    }
    if state.engine is not None and state.engine.ready:
        card["max_model_len"] = state.engine.max_model_len  # as vLLM reports it
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    state = get_state(request)
    return {"object": "list", "data": [_model_card(state, n) for n in state.model_names]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    check_model(state, model_id)
    return _model_card(state, model_id)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    engine = get_state(request).engine
    if engine is not None and engine.ready:
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
