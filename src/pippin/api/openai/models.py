"""The served models: /v1/models and /v1/models/{id}."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from pippin.api.openapi import openai_route
from pippin.api.state import ServerState, check_model, get_state

router = APIRouter()


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


@router.get("/v1/models", **openai_route())
async def list_models(request: Request) -> dict[str, Any]:
    state = get_state(request)
    return {"object": "list", "data": [_model_card(state, n) for n in _all_names(state)]}


@router.get("/v1/models/{model_id:path}", **openai_route())
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    check_model(state, model_id, _all_names(state))
    return _model_card(state, model_id)
