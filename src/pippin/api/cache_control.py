"""The prefix cache's control routes: GET /v1/cache/stats, DELETE /v1/cache[?tier=...].
Both act on one chat model's cache: ``?model=NAME``, default the default model."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from pippin.api.common import get_state
from pippin.api.openapi import openai_route
from pippin.engine.cache_tiers import TIERS
from pippin.serving.errors import bad_request
from pippin.serving.registry import DEFAULT_NAME
from pippin.serving.state import require_engine, use_model

router = APIRouter()


@router.get("/v1/cache/stats", **openai_route())
async def cache_stats(request: Request, model: str = DEFAULT_NAME) -> dict[str, Any]:
    engine, _ = require_engine(await use_model(get_state(request), model))
    return await engine.cache_stats()


@router.delete("/v1/cache", **openai_route())
async def clear_cache(
    request: Request, tier: str | None = None, model: str = DEFAULT_NAME
) -> dict[str, Any]:
    if tier is not None and tier not in TIERS:
        raise bad_request(
            f"Unknown cache tier '{tier}': use one of {', '.join(TIERS)}, or none for all.",
            param="tier",
            code="invalid_value",
        )
    engine, _ = require_engine(await use_model(get_state(request), model))
    cleared = await engine.clear_cache(tier)
    return {"object": "cache.cleared", "cleared_blocks": cleared}
