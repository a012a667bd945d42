"""Ollama's model management: DELETE /api/delete, POST /api/copy and /api/push, with
/api/create (`create`) and /api/blobs (`blobs`) included.

They change the library (``--models-dir``, `pippin.store.library`), never the models given
on the command line, and answer 403 unless the request may manage models (`require_admin`).
A model deleted while a request streams from it stops resolving at once and its files go
once that request ends (`ModelRegistry.delete_stored`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request, Response

from pippin.api.common import parse_request, require_admin
from pippin.api.ollama import blobs, create
from pippin.api.ollama.managed import managed_route, named_entry
from pippin.api.ollama.protocol import Lenient
from pippin.api.ollama.served import registry_of
from pippin.serving.errors import ApiError, bad_request
from pippin.serving.registry import ModelEntry
from pippin.serving.state import ServerState
from pippin.store.library import LibraryError, StoredModel

router = APIRouter()
router.include_router(blobs.router)
router.include_router(create.router)


class DeleteRequest(Lenient):
    model: str = ""
    name: str = ""  # the field's old name


class CopyRequest(Lenient):
    source: str = ""
    destination: str = ""


class PushRequest(Lenient):
    model: str = ""
    name: str = ""
    insecure: bool | None = None
    stream: bool | None = None


def not_found(name: str) -> ApiError:
    return ApiError(404, f"model '{name}' not found", param="model")


def command_line_model(name: str, action: str) -> ApiError:
    return bad_request(
        f"model '{name}' is given on the server's command line (pippin serve, --model, "
        f"--models), not kept in its library (--models-dir): it cannot be {action} here",
        param="model",
    )


def stored_model(state: ServerState, name: str, param: str) -> tuple[StoredModel, ModelEntry]:
    """The library model ``name`` means and its registry entry; 404 if none, 400 for a
    model of the command line."""
    if not name:
        raise bad_request(f"{param} is required", param=param)
    registry = registry_of(state)
    stored = registry.library.get(name)
    entry = named_entry(state, stored.name if stored is not None else name)
    if stored is None:
        if entry is not None and entry.stored is None:
            raise command_line_model(name, "changed")
        raise not_found(name)
    if entry is None or entry.stored is None or entry.stored.name != stored.name:
        raise command_line_model(stored.name, "changed")  # its name is the command line's
    return stored, entry


@router.delete("/api/delete", **managed_route(DeleteRequest, empty={200: "Deleted"}))
async def delete(request: Request) -> Response:
    state = require_admin(request)
    req = await parse_request(DeleteRequest, await request.body())
    name = req.model or req.name
    try:
        _, entry = stored_model(state, name, "model")
    except ApiError as e:
        if e.status == 400:
            raise command_line_model(name, "deleted") from None
        raise
    await registry_of(state).delete_stored(entry)
    return Response(status_code=200)


@router.post("/api/copy", **managed_route(CopyRequest, empty={200: "Copied"}))
async def copy(request: Request) -> Response:
    state = require_admin(request)
    req = await parse_request(CopyRequest, await request.body())
    stored, _ = stored_model(state, req.source, "source")
    if not req.destination:
        raise bad_request("destination is required", param="destination")
    taken = named_entry(state, req.destination)
    if taken is not None and taken.stored is None:
        raise bad_request(
            f"destination '{req.destination}' is the name of a model given on the server's "
            "command line",
            param="destination",
        )
    registry = registry_of(state)
    try:
        await asyncio.to_thread(registry.library.copy, stored.name, req.destination)
    except LibraryError as e:
        raise bad_request(str(e), param="destination") from None
    registry.sync_library(force=True)
    return Response(status_code=200)


@router.post("/api/push", **managed_route(PushRequest))
async def push(request: Request) -> dict[str, Any]:
    require_admin(request)
    raise bad_request(
        "pippin does not push models to registries: /api/push is not supported. The "
        "library's files lie in --models-dir; upload them with the Hub's own tools "
        "(huggingface-cli upload).",
        param="model",
    )
