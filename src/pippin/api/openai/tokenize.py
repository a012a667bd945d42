"""POST /tokenize and /detokenize: vLLM's routes (served at the root, as vLLM does),
also taking llama.cpp's shapes of the same routes.

A chat request (`messages`) is tokenized by the chat route's own path (`chat_job`, then
`render`: the same template, tools and media placeholders), so `count` is the
`usage.prompt_tokens` the same chat request reports; a `prompt` as /v1/completions
tokenizes it.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import Field, RootModel

from pippin.api.common import Strict, get_state, parse_request
from pippin.api.openai.chat import chat_job
from pippin.api.openai.completions import tokenize_prompts
from pippin.api.openai.protocol import ChatCompletionRequest, Message, Tool
from pippin.api.openapi import openai_route
from pippin.serving.errors import bad_request, unsupported_param
from pippin.serving.job import render
from pippin.serving.live_model import LiveModel
from pippin.serving.registry import DEFAULT_NAME
from pippin.serving.state import ServerState, check_model, require_engine, use_model

router = APIRouter()


class TokenizeCompletionRequest(Strict):
    """vLLM's: a prompt, tokenized as /v1/completions does."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool | None = None  # default true
    return_token_strs: bool | None = None


class TokenizeChatRequest(Strict):
    """vLLM's: messages, through the model's chat template as /v1/chat/completions."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None
    add_special_tokens: bool | None = None  # only false: the chat route adds none
    chat_template: str | None = None  # refused: the chat route takes the model's only
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None


class LlamaCppTokenizeRequest(Strict):
    """llama.cpp's: `content` -> {tokens} (with `with_pieces`, {id, piece} each)."""

    content: str
    add_special: bool | None = None  # default false
    with_pieces: bool | None = None


AnyTokenize = TokenizeCompletionRequest | TokenizeChatRequest | LlamaCppTokenizeRequest


class TokenizeRequest(RootModel[AnyTokenize]):
    """One of vLLM's two shapes (by `prompt` or `messages`) or llama.cpp's (`content`)."""


class DetokenizeRequest(Strict):
    """vLLM's and llama.cpp's: token ids -> text (`prompt`, and llama.cpp's `content`)."""

    model: str | None = None
    tokens: list[int]


async def _live(server: ServerState, model: str | None) -> LiveModel:
    name = model or DEFAULT_NAME
    check_model(server, name)
    return await use_model(server, name)


def _shape(raw: bytes) -> type[Strict]:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None  # parse_request answers it
    if isinstance(body, dict) and "messages" in body:
        return TokenizeChatRequest
    if isinstance(body, dict) and "content" in body:
        return LlamaCppTokenizeRequest
    return TokenizeCompletionRequest


async def _chat_ids(server: ServerState, req: TokenizeChatRequest) -> tuple[LiveModel, list[int]]:
    if req.chat_template is not None:
        raise unsupported_param("chat_template", "Only the model's own chat template is used.")
    if req.add_special_tokens:
        raise unsupported_param(
            "add_special_tokens", "The chat template's tokens are all the special tokens added."
        )
    if req.mm_processor_kwargs:
        raise unsupported_param("mm_processor_kwargs", "Processor arguments are not supported.")
    chat = ChatCompletionRequest.model_construct(
        model=req.model or DEFAULT_NAME,
        messages=req.messages,
        tools=req.tools,
        chat_template_kwargs=req.chat_template_kwargs,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
    )
    job = chat_job(chat, server)
    live = await _live(server, req.model)
    return live, (await render(live, job)).ids


@router.post("/tokenize", response_model=None, **openai_route(TokenizeRequest))
async def tokenize(request: Request) -> Any:
    raw = await request.body()
    req = await parse_request(_shape(raw), raw)
    server = get_state(request)
    if isinstance(req, TokenizeChatRequest):
        live, ids = await _chat_ids(server, req)
    else:
        model = req.model if isinstance(req, TokenizeCompletionRequest) else None
        live = await _live(server, model)
        _, loaded = require_engine(live)
        if isinstance(req, TokenizeCompletionRequest):
            prompt, special = req.prompt, req.add_special_tokens is not False
        else:
            prompt, special = req.content, bool(req.add_special)
        prompts = await asyncio.to_thread(tokenize_prompts, loaded.tokenizer, prompt, special)
        ids = prompts[0].ids
    if isinstance(req, LlamaCppTokenizeRequest):
        if not req.with_pieces:
            return JSONResponse({"tokens": ids})
        return JSONResponse({"tokens": [{"id": t, "piece": _piece(live, t)} for t in ids]})
    assert live.limits is not None
    strs = None
    if req.return_token_strs:
        _, loaded = require_engine(live)
        strs = list(loaded.tokenizer.convert_ids_to_tokens(ids))
    body = {"count": len(ids), "max_model_len": live.limits.max_model_len, "tokens": ids}
    return JSONResponse(body | {"token_strs": strs})


def _piece(live: LiveModel, token_id: int) -> str | list[int]:
    """llama.cpp's piece: the token's text, or its bytes where they are not UTF-8 whole."""
    text, raw = live.token_renderer(token_id)
    return text if text.encode("utf-8") == bytes(raw) else raw


@router.post("/detokenize", response_model=None, **openai_route(DetokenizeRequest))
async def detokenize(request: Request) -> Any:
    req = await parse_request(DetokenizeRequest, await request.body())
    server = get_state(request)
    live = await _live(server, req.model)
    _, loaded = require_engine(live)
    assert live.limits is not None
    vocab = live.limits.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise bad_request(
            f"Invalid token id {bad} in 'tokens': ids must be in [0, {vocab}).",
            param="tokens",
            code="invalid_value",
        )
    text = await asyncio.to_thread(loaded.tokenizer.decode, req.tokens)
    # vLLM's `prompt` and llama.cpp's `content`: one body for the clients of both.
    return JSONResponse({"prompt": text, "content": text})
