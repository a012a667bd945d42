"""HEAD and POST /api/blobs/sha256:<hex>: the files a client uploads before an /api/create
that names them in ``files`` (as `ollama create` does). Admin keys only; stored in the
library's folder (`pippin.store.model_files`)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import APIRouter, Request, Response

from pippin.api.common import require_admin
from pippin.api.ollama.managed import managed_route
from pippin.serving.errors import bad_request
from pippin.store.model_files import BlobWriter, ModelFilesError, blob_path

router = APIRouter()

BLOBS = "/api/blobs/"
# The body cap of an upload: model files are large (the default cap is for JSON bodies).
BLOB_MAX_BYTES = 1 << 40


def _blob(request: Request, digest: str) -> Path:
    """The blob's path, once the request may manage models (a bad digest: 400)."""
    state = require_admin(request)
    assert state.registry is not None
    try:
        return blob_path(state.registry.library.root, digest)
    except ModelFilesError as e:
        raise bad_request(str(e), param="digest") from None


# Left out of the OpenAPI document: a HEAD answer has no body, so its errors cannot carry
# Ollama's error object as every documented error does.
@router.head("/api/blobs/{digest}", include_in_schema=False)
async def head_blob(digest: str, request: Request) -> Response:
    path = _blob(request, digest)
    exists = await asyncio.to_thread(path.is_file)
    return Response(status_code=200 if exists else 404)


@router.post(
    "/api/blobs/{digest}",
    status_code=201,
    **managed_route(empty={201: "Stored", 200: "Stored already"}),
)
async def post_blob(digest: str, request: Request) -> Response:
    path = _blob(request, digest)
    if await asyncio.to_thread(path.is_file):
        return Response(status_code=200)  # stored already, as Ollama answers
    writer = await asyncio.to_thread(BlobWriter, path)
    try:
        async for chunk in request.stream():
            if chunk:
                await asyncio.to_thread(writer.write, chunk)
    except BaseException:
        await asyncio.to_thread(writer.abort)
        raise
    if not await asyncio.to_thread(writer.finish):
        got = f"sha256:{writer.hash.hexdigest()}"
        raise bad_request(f"digest mismatch, expected {digest}, got {got}", param="digest")
    return Response(status_code=201)
