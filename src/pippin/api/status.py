"""Whether the server is up: /health, /version and the engine's counters."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pippin import __version__
from pippin.api.common import get_state
from pippin.api.openapi import openai_route
from pippin.serving.registry import DEFAULT_NAME

router = APIRouter()


# HEAD too: load balancers and uptime checks often probe with it.
@router.api_route(
    "/health",
    methods=["GET", "HEAD"],
    responses={503: {"description": "Not ready: the model is still loading."}},
)
async def health(request: Request) -> JSONResponse:
    state = get_state(request)
    models_ok = state.registry is not None and state.registry.enabled and state.registry.ready
    embed_ok = state.embed is None or state.embed.ready
    if state.admission.draining:  # SIGTERM: a load balancer should move on
        return JSONResponse({"status": "draining"}, status_code=503)
    if state.registry is not None and state.registry.sleep_level:
        # Up, as vLLM's /health is while asleep; generation requests get 503 meanwhile.
        return JSONResponse({"status": "sleeping"})
    if models_ok and embed_ok:
        return JSONResponse({"status": "ok"})
    return JSONResponse({"status": "unavailable"}, status_code=503)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/v1/engine/stats", **openai_route())
async def engine_stats(request: Request, model: str = DEFAULT_NAME) -> dict[str, int]:
    # A debugging aid (and what the load tests check KV blocks with): one loaded model's
    # counters (``?model=``, default the default model); {} while it is not loaded.
    state = get_state(request)
    assert state.registry is not None
    live = state.registry.resolve(model).live
    engine = live.engine if live is not None else None
    return engine.stats() if engine is not None else {}
