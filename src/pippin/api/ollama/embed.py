"""POST /api/embed and the legacy /api/embeddings on the served embedding model."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
from fastapi import APIRouter, Request

from pippin.api.common import cancel_on_disconnect, get_state, parse_request
from pippin.api.ollama.protocol import EmbeddingsRequest, EmbedRequest, sampling_options
from pippin.api.ollama.served import chat_entry, not_found, resolve, touch
from pippin.api.openapi import ollama_route
from pippin.embed.inputs import InputTooLong
from pippin.embed.models import Embedder
from pippin.serving.errors import bad_request
from pippin.serving.limits import context_exceeded
from pippin.serving.state import ServerState, require_extra_model

router = APIRouter()


def _model(state: ServerState, name: str) -> tuple[Any, Embedder, str]:
    served = resolve(state, name, "embedding")
    if served is None:
        if chat_entry(state, name) is not None:
            # Ollama embeds with chat models too; pippin serves embeddings from an
            # embedding model only.
            raise bad_request(f'"{name}" does not support embeddings', param="model")
        raise not_found(state, name)
    worker, model = require_extra_model(state, "embedding", served)
    assert isinstance(model, Embedder)
    return worker, model, served


async def _vectors(
    request: Request, worker: Any, model: Embedder, texts: list[str], truncate: bool
) -> tuple[np.ndarray, int]:
    try:
        items = await asyncio.to_thread(model.items, texts, truncate)
    except InputTooLong as e:
        raise context_exceeded(e.limit, e.length, "input") from None
    vectors = await cancel_on_disconnect(request.receive, worker.run(model, items))
    return vectors, sum(len(it.ids) for it in items)


def _normalised(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, 1e-12)


@router.post("/api/embed", **ollama_route(EmbedRequest))
async def embed(request: Request) -> dict[str, Any]:
    started = time.perf_counter_ns()
    req = await parse_request(EmbedRequest, await request.body())
    state = get_state(request)
    worker, model, name = _model(state, req.model)
    touch(req.keep_alive)
    sampling_options(req.options)  # checked as Ollama checks them; none applies here
    texts = [req.input] if isinstance(req.input, str) else list(req.input)
    if not texts or not all(texts):
        raise bad_request("input must be a non-empty string or list of strings", param="input")
    if req.dimensions is not None and req.dimensions > model.dim:
        raise bad_request(
            f"dimensions must be at most {model.dim} for this model", param="dimensions"
        )
    vectors, tokens = await _vectors(request, worker, model, texts, req.truncate)
    if req.dimensions is not None:
        vectors = vectors[:, : req.dimensions]
    # Ollama's /api/embed always returns unit vectors.
    out = await asyncio.to_thread(lambda: _normalised(vectors).astype(np.float32).tolist())
    return {
        "model": name,
        "embeddings": out,
        "total_duration": time.perf_counter_ns() - started,
        "load_duration": 0,
        "prompt_eval_count": tokens,
    }


@router.post("/api/embeddings", **ollama_route(EmbeddingsRequest))
async def embeddings(request: Request) -> dict[str, Any]:
    req = await parse_request(EmbeddingsRequest, await request.body())
    state = get_state(request)
    worker, model, name = _model(state, req.model)
    touch(req.keep_alive)
    sampling_options(req.options)
    if not req.prompt:
        return {"embedding": []}  # as Ollama answers an empty prompt
    vectors, _ = await _vectors(request, worker, model, [req.prompt], True)
    # The legacy route returns the model's vector as it is (normalised only if the
    # model itself normalises).
    vec = _normalised(vectors) if model.spec.normalize else vectors
    return {"embedding": vec[0].astype(np.float32).tolist()}
