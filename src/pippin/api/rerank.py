"""POST /v1/rerank, /rerank and /v2/rerank: Cohere (v1, v2), Jina and vLLM-style reranking.

The query is scored against every document by the served rerank model (a cross-encoder or
a yes/no decoder reranker) and the results come back sorted by ``relevance_score``, best
first. ``model`` may be left out when one rerank model is served.
"""

from __future__ import annotations

import asyncio
import math
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pippin.api.common import cancel_on_disconnect, get_state, parse_request
from pippin.api.openai.protocol import RerankRequest
from pippin.api.openapi import openai_route
from pippin.embed.inputs import InputTooLong, Item
from pippin.embed.models import Reranker
from pippin.serving.errors import bad_request, unsupported_param, unsupported_value
from pippin.serving.limits import context_exceeded
from pippin.serving.state import require_extra_model

router = APIRouter()

# Cohere's limit on documents per request.
MAX_DOCUMENTS = 1000


def _check(req: RerankRequest) -> None:
    if req.max_chunks_per_doc is not None:
        raise unsupported_param(
            "max_chunks_per_doc", "Long documents are cut or refused, not chunked."
        )
    if req.rank_fields is not None and req.rank_fields != ["text"]:
        raise unsupported_value(
            "rank_fields",
            "Only the 'text' field of a document can be ranked (rank_fields ['text']).",
        )
    if not req.query:
        raise bad_request("'query' must not be empty.", param="query", code="invalid_value")
    if not req.documents:
        raise bad_request("'documents' must not be empty.", param="documents", code="invalid_value")
    if len(req.documents) > MAX_DOCUMENTS:
        raise bad_request(
            f"'documents' has {len(req.documents)} items; at most {MAX_DOCUMENTS} are allowed.",
            param="documents",
            code="invalid_value",
        )


def _pairs(model: Reranker, req: RerankRequest, texts: list[str]) -> list[Item]:
    try:
        return model.pairs(req.query, texts, req.max_tokens_per_doc)
    except InputTooLong as e:
        raise context_exceeded(e.limit, e.length, f"documents[{e.index}]") from None


@router.post("/v1/rerank", response_model=None, **openai_route(RerankRequest))
@router.post("/v2/rerank", response_model=None, **openai_route(RerankRequest))
@router.post("/rerank", response_model=None, **openai_route(RerankRequest))
async def create_rerank(request: Request) -> JSONResponse:
    req = await parse_request(RerankRequest, await request.body())
    state = get_state(request)
    worker, model = require_extra_model(state, "rerank", req.model)
    assert isinstance(model, Reranker)
    _check(req)
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    items = await asyncio.to_thread(_pairs, model, req, texts)
    scores = await cancel_on_disconnect(request.receive, worker.run(model, items))
    order = sorted(range(len(texts)), key=lambda i: (-float(scores[i]), i))
    if req.top_n is not None:
        order = order[: req.top_n]
    show = True if req.return_documents is None else req.return_documents
    results: list[dict[str, Any]] = []
    for i in order:
        r: dict[str, Any] = {"index": i, "relevance_score": float(scores[i])}
        if show:
            d = req.documents[i]
            r["document"] = {"text": d} if isinstance(d, str) else d.model_dump()
        results.append(r)
    tokens = sum(len(it.ids) for it in items)
    return JSONResponse(
        {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": req.model or state.extra_names["rerank"][0],
            "results": results,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            # Cohere's shape: one search unit per query of up to 100 documents.
            "meta": {
                "api_version": {"version": "2"},
                "billed_units": {"search_units": math.ceil(len(texts) / 100)},
            },
        }
    )
