"""The served models: /v1/models and /v1/models/{id}.

Every chat model of the registry is listed under each of its served names and aliases,
loaded or not, with its ``state`` (loaded, loading, unloaded) and, once loaded, its
memory, context length and sampling defaults; then the LoRA adapters (as vLLM lists
them: ``root`` their folder, ``parent`` their base model); then the embedding and rerank
models.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from pippin.api.common import get_state
from pippin.api.openapi import openai_route
from pippin.serving.media import takes_images
from pippin.serving.registry import LOADED, ModelEntry
from pippin.serving.state import ServerState, check_model

router = APIRouter()


def _chat_card(state: ServerState, entry: ModelEntry, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "pippin",
        "root": entry.spec.model or entry.name,
        "state": entry.state,
        "pinned": entry.pinned,
        # What it takes besides text ("vision": images and videos), for clients to offer.
        "capabilities": ["chat", "vision"] if takes_images(entry) else ["chat"],
    }
    live = entry.live
    if entry.state == LOADED and live is not None and live.engine is not None:
        if live.engine.ready:
            card["max_model_len"] = live.engine.max_model_len  # as vLLM reports it
        card["memory_bytes"] = entry.memory_bytes
        # What a request that leaves the sampling fields out gets (the page shows them).
        card["sampling_defaults"] = live.sampling_defaults()
        expires = entry.expires_at()
        if expires is not None:
            card["expires_at"] = int(expires)
    return card


def _lora_card(state: ServerState, name: str) -> dict[str, Any]:
    adapter = state.adapters.by_name[name]
    assert state.registry is not None
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "pippin",
        "root": adapter.path,
        "parent": state.adapters.base_name(state.registry, adapter),
        "capabilities": ["chat"],
    }


def _extra_card(state: ServerState, name: str) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "pippin",
    }
    # Not a chat model: what it is for ("embedding", "rerank", "speech", "speech-to-text").
    card["kind"] = next(k for k, names in state.extra_names.items() if name in names)
    extra = state.extra_model(name)
    if extra is not None:
        card["max_model_len"] = extra.max_len
    tts = state.tts
    if name in state.extra_names.get("speech", []) and tts is not None and tts.model is not None:
        card["voices"] = tts.model.voices  # None: the model does not list them
    return card


def _cards(state: ServerState) -> list[dict[str, Any]]:
    reg = state.registry
    chat = [_chat_card(state, e, n) for e in reg.entries() for n in e.served_names] if reg else []
    loras = [_lora_card(state, n) for n in state.adapters.by_name]
    extra = [_extra_card(state, n) for names in state.extra_names.values() for n in names]
    return chat + loras + extra


@router.get("/v1/models", **openai_route())
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": _cards(get_state(request))}


@router.get("/v1/models/{model_id:path}", **openai_route())
async def retrieve_model(model_id: str, request: Request) -> dict[str, Any]:
    state = get_state(request)
    extra = [n for names in state.extra_names.values() for n in names]
    if model_id in extra:
        return _extra_card(state, model_id)
    if state.adapters.get(model_id) is not None:
        return _lora_card(state, model_id)
    check_model(state, model_id)
    assert state.registry is not None
    return _chat_card(state, state.registry.resolve(model_id), model_id)
