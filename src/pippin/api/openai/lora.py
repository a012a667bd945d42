"""LoRA adapters at run time, in vLLM's shapes: POST /v1/load_lora_adapter and
POST /v1/unload_lora_adapter.

Both manage models, so both pass `require_admin` first (403 with
--disable-model-management, or for an --api-keys key not marked admin); the adapter's
folder must lie in a --models-dir (400 otherwise). As vLLM, a success is 200 with a line
of plain text; a duplicate name or an unknown adapter is a 400. An adapter that requests
are running with is not unloaded under them: 409 until they end.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from pippin.api.common import Strict, parse_request, require_admin
from pippin.api.openapi import OpenAIErrorBody, openai_route
from pippin.serving.adapters import ServedAdapter
from pippin.serving.errors import bad_request, unsupported_value
from pippin.serving.model_admin import allowed_path

router = APIRouter()


def _route(body: type[Strict]) -> dict[str, Any]:
    kw = openai_route(body, media=("text/plain",))
    kw["responses"][403] = {
        "description": "Model management is off, or the key is not an admin's.",
        "model": OpenAIErrorBody,
    }
    kw["responses"][409] = {
        "description": "Requests are running with the adapter.",
        "model": OpenAIErrorBody,
    }
    return kw


class LoadLoraAdapterRequest(Strict):
    lora_name: str
    lora_path: str
    # Replace an adapter already loaded under that name (refused while it is in use).
    load_inplace: bool = False
    # pippin's: the chat model it adapts (default: the default model).
    base_model_name: str | None = None


class UnloadLoraAdapterRequest(Strict):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's own id; pippin knows adapters by name only


@router.post("/v1/load_lora_adapter", response_model=None, **_route(LoadLoraAdapterRequest))
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    state = require_admin(request)
    req = await parse_request(LoadLoraAdapterRequest, await request.body())
    try:
        path = allowed_path(state.settings, req.lora_path, "lora_path")
    except (ValueError, OSError):  # no path at all (a NUL byte, a loop of links)
        raise bad_request("'lora_path' is not a path.", param="lora_path") from None
    assert state.registry is not None
    if req.load_inplace and state.adapters.get(req.lora_name) is not None:
        await state.adapters.unload(state.registry, req.lora_name)
    adapter = ServedAdapter(req.lora_name, str(path), req.base_model_name)
    await state.adapters.load(state.registry, adapter)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_model=None, **_route(UnloadLoraAdapterRequest))
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state = require_admin(request)
    req = await parse_request(UnloadLoraAdapterRequest, await request.body())
    if req.lora_int_id is not None:
        raise unsupported_value(
            "lora_int_id", "Adapters are known by name here; send 'lora_name' alone."
        )
    assert state.registry is not None
    await state.adapters.unload(state.registry, req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
