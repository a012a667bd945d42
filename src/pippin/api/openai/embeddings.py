"""POST /v1/embeddings: OpenAI's embeddings API on the served embedding model.

``input`` is a string, a list of strings, a list of token ids or a list of id lists;
vectors come back as float lists or base64 (little-endian float32, what the ``openai``
SDK asks for by default). ``dimensions`` shortens Matryoshka vectors (renormalised when
the model normalises). Tokenizing and the response body are built off the event loop;
the forward passes run on the embedding worker, batched with other clients' inputs.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import Response

from pippin.api.common import cancel_on_disconnect, get_state, parse_request
from pippin.api.openai.protocol import EmbeddingRequest
from pippin.api.openapi import openai_route
from pippin.embed.inputs import InputTooLong, Item
from pippin.embed.models import Embedder
from pippin.serving.errors import bad_request, unsupported_value
from pippin.serving.limits import context_exceeded
from pippin.serving.state import require_extra_model

router = APIRouter()

# OpenAI's limit on the number of inputs in one request.
MAX_INPUTS = 2048


def _as_list(raw: Any) -> list[str] | list[list[int]]:
    """The four shapes of ``input`` as a list of strings or a list of id lists."""
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(x, int) for x in raw):
        return [raw]
    return list(raw)


def _check_inputs(inputs: list[Any], vocab_size: int) -> None:
    if not inputs:
        raise bad_request("'input' must not be an empty list.", param="input", code="invalid_value")
    if len(inputs) > MAX_INPUTS:
        raise bad_request(
            f"'input' has {len(inputs)} items; at most {MAX_INPUTS} are allowed.",
            param="input",
            code="invalid_value",
        )
    for i, item in enumerate(inputs):
        if not item:
            what = "an empty string" if isinstance(item, str) else "an empty token list"
            raise bad_request(
                f"Input {i} is {what}; every input must have content.",
                param="input",
                code="invalid_value",
            )
        if isinstance(item, list):
            bad = next((t for t in item if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise bad_request(
                    f"Invalid token id {bad} in input {i}: ids must be in [0, {vocab_size}).",
                    param="input",
                    code="invalid_value",
                )


def _check_dimensions(model: Embedder, dims: int | None) -> None:
    if dims is None or dims == model.dim:
        return
    allowed = model.spec.matryoshka
    if allowed is None:
        raise unsupported_value(
            "dimensions",
            f"This model does not support 'dimensions': its vectors have {model.dim} "
            "dimensions and it was not trained to be shortened (Matryoshka).",
        )
    if dims > model.dim or (allowed and dims not in allowed):
        sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {model.dim}"
        raise bad_request(
            f"Invalid 'dimensions' {dims}: this model allows {sizes}.",
            param="dimensions",
            code="invalid_value",
        )


def _tokenize(model: Embedder, inputs: list[Any]) -> list[Item]:
    try:
        return model.items(inputs)
    except InputTooLong as e:
        raise context_exceeded(e.limit, e.length, "input") from None


def _body(vectors: np.ndarray, model: Embedder, req: EmbeddingRequest, prompt_tokens: int) -> bytes:
    if req.dimensions is not None and req.dimensions < vectors.shape[1]:
        vectors = vectors[:, : req.dimensions]
    if model.spec.normalize:
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.maximum(norms, 1e-12)
    vectors = vectors.astype("<f4")
    if req.encoding_format == "base64":
        encoded: list[Any] = [base64.b64encode(v.tobytes()).decode("ascii") for v in vectors]
    else:
        encoded = vectors.tolist()
    body = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)
        ],
        "model": req.model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
    return json.dumps(body, separators=(",", ":")).encode()


@router.post("/v1/embeddings", response_model=None, **openai_route(EmbeddingRequest))
async def create_embeddings(request: Request) -> Response:
    req = await parse_request(EmbeddingRequest, await request.body())
    state = get_state(request)
    worker, model = require_extra_model(state, "embedding", req.model)
    assert isinstance(model, Embedder)
    _check_dimensions(model, req.dimensions)
    inputs = _as_list(req.input)
    _check_inputs(inputs, model.vocab_size)
    items = await asyncio.to_thread(_tokenize, model, inputs)
    vectors = await cancel_on_disconnect(request.receive, worker.run(model, items))
    tokens = sum(len(it.ids) for it in items)
    body = await asyncio.to_thread(_body, vectors, model, req, tokens)
    return Response(body, media_type="application/json")
