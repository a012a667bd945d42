"""vLLM's sleep mode routes (its `VLLM_SERVER_DEV_MODE` ones, in their shapes):
POST /sleep?level=1|2&mode=abort|wait, POST /wake_up[?tags=weights&tags=kv_cache],
GET /is_sleeping -> {"is_sleeping": bool}.

Sleeping frees the GPU's memory for something else, so /sleep and /wake_up manage the
server: `require_admin` (403 with --disable-model-management, or for an --api-keys key
not marked admin). Every chat model loaded sleeps (`ModelRegistry.sleep`); requests get
503 with Retry-After meanwhile; /health answers 200 ``{"status": "sleeping"}``.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from pippin.api.common import get_state, require_admin
from pippin.api.openapi import OpenAIErrorBody, openai_route
from pippin.engine.client import SLEEP_TAGS
from pippin.serving.errors import unsupported_value

router = APIRouter()

# vLLM's modes: abort the requests in flight (its default), or wait for them; "keep"
# (paused and resumed after waking) is not offered.
MODES = ("abort", "wait")


def _route() -> dict[str, Any]:
    kw = openai_route(media=())
    kw["responses"][403] = {
        "description": "Model management is off, or the key is not an admin's.",
        "model": OpenAIErrorBody,
    }
    return kw


@router.post("/sleep", response_class=Response, **_route())
async def sleep(request: Request, level: str = "1", mode: str = "abort") -> Response:
    state = require_admin(request)
    if level not in ("1", "2"):
        raise unsupported_value(
            "level", "1 frees the KV cache and moves the weights off the GPU; 2 drops both."
        )
    if mode not in MODES:
        raise unsupported_value("mode", f"Use one of: {', '.join(MODES)}.")
    assert state.registry is not None
    await state.registry.sleep(int(level), wait=mode == "wait")
    return Response(status_code=200)


@router.post("/wake_up", response_class=Response, **_route())
async def wake_up(request: Request) -> Response:
    state = require_admin(request)
    tags = request.query_params.getlist("tags")
    unknown = sorted(set(tags) - SLEEP_TAGS)
    if unknown:
        raise unsupported_value(
            "tags", f"Use {' and '.join(sorted(SLEEP_TAGS))}, or none for both."
        )
    assert state.registry is not None
    await state.registry.wake_up(frozenset(tags) or SLEEP_TAGS)
    return Response(status_code=200)


@router.get("/is_sleeping", **openai_route())
async def is_sleeping(request: Request) -> JSONResponse:
    registry = get_state(request).registry
    return JSONResponse({"is_sleeping": registry is not None and registry.sleep_level > 0})
