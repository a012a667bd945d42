"""POST /api/chat and /api/generate: Ollama's chat and completion routes on the shared
chat pipeline, answered as NDJSON lines (streamed by default) or one JSON object."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pippin.api.common import cancel_on_disconnect, parse_request
from pippin.api.ollama.protocol import (
    ChatRequest,
    GenerateFields,
    GenerateRequest,
    Message,
    sampling_options,
)
from pippin.api.ollama.served import (
    chat_model,
    chat_name,
    load_or_unload,
    registry_keep_alive,
)
from pippin.api.openai.chat import format_logprobs
from pippin.api.openai.protocol import SamplingFields
from pippin.api.openapi import ollama_route
from pippin.chat.output import OutputParser
from pippin.chat.tool_parsers.base import ParsedDelta, collect_calls
from pippin.engine.client import EngineClient, EngineError
from pippin.engine.types import SamplingParams
from pippin.serving.errors import ApiError, bad_request
from pippin.serving.live_model import LiveModel
from pippin.serving.logprobs import TokenRenderer
from pippin.serving.media import MediaParts
from pippin.serving.pipeline import (
    ParsedStep,
    grammar_error,
    output_parsing,
    render_media_prompt,
    run_parsed,
)
from pippin.serving.sampling import build_sampling_params, resolve_max_tokens
from pippin.serving.state import ServerState, get_state
from pippin.serving.streams import closing
from pippin.store.loaded import LoadedModel
from pippin.structured.formats import json_object_grammar, json_schema_grammar
from pippin.structured.spec import GrammarSpec, StructuredOutputError

router = APIRouter()

NDJSON = "application/x-ndjson"


def now() -> str:
    """Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


def line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


# --- request -> prompt -----------------------------------------------------------


def with_images(
    content: str, images: list[str] | None, param: str, media: MediaParts
) -> str | list[dict[str, Any]]:
    """A message's text with its `images` (base64, no media type: the bytes say) before
    it, as Ollama's templates place them; plain text when there are none."""
    if not images:
        return content
    parts = [media.base64(b64, None, f"{param}[{j}]") for j, b64 in enumerate(images)]
    return [*parts, {"type": "text", "text": content}]


def check_vision(state: LiveModel, media: MediaParts, name: str) -> None:
    """Ollama's 400 for images sent to a model without vision."""
    if media and (state.loaded is None or state.loaded.vision is None):
        raise bad_request(
            f'"{name}" does not support vision (image input)', param=media.first_param
        )


def template_messages(messages: list[Message], media: MediaParts) -> list[dict[str, Any]]:
    """Ollama messages -> the dicts Hugging Face chat templates take (images collected
    into `media`)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise bad_request(f"invalid role {m.role!r} in messages[{i}]", param="messages")
        content = with_images(m.content or "", m.images, f"messages[{i}].images", media)
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.role == "assistant":
            if m.thinking:
                msg["reasoning_content"] = m.thinking
            if m.tool_calls:
                msg["tool_calls"] = [
                    {
                        "id": c.id or f"call_{i}_{j}",
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for j, c in enumerate(m.tool_calls)
                ]
        elif m.role == "tool":
            if m.tool_name:
                msg["name"] = m.tool_name
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def think_kwargs(state: LiveModel, think: bool | str | None, name: str) -> dict[str, Any]:
    """`think` as the model's template takes it; Ollama's 400 for a model that cannot."""
    kwargs = dict(state.settings.default_chat_template_kwargs)
    info, parsers = state.template, state.parsers
    assert info is not None and parsers is not None
    if think is None:
        return kwargs
    if info.reasoning_kwarg == "enable_thinking":
        kwargs["enable_thinking"] = think is not False
    elif info.reasoning_kwarg == "reasoning_effort":
        if isinstance(think, str):
            kwargs["reasoning_effort"] = think
        elif think is False:
            kwargs["reasoning_effort"] = "low"  # gpt-oss cannot stop thinking (Ollama's way)
    elif parsers.reasoning is None and think is not False:
        raise bad_request(f'"{name}" does not support thinking', param="think")
    return kwargs


def format_spec(fmt: str | dict[str, Any] | None) -> GrammarSpec | None:
    """`format`: "json" (any JSON object) or a JSON schema."""
    try:
        if fmt is None or fmt == "":
            return None
        if fmt == "json":
            return json_object_grammar("format")
        assert isinstance(fmt, dict)
        return json_schema_grammar(fmt, "format", "the format's JSON schema")
    except StructuredOutputError as exc:
        raise grammar_error(exc) from None


# --- the run ---------------------------------------------------------------------


@dataclass
class OllamaRun:
    """One chat or generate request, ready for the engine; answers in either shape."""

    engine: EngineClient
    prompt_ids: list[int]
    params: SamplingParams
    parser: OutputParser
    model: str
    render: TokenRenderer
    chat: bool  # /api/chat's message objects, else /api/generate's `response`
    started: int  # perf_counter_ns at the request's arrival
    request_id: str = field(default_factory=lambda: f"ollama-{uuid.uuid4().hex}")
    first_ns: int | None = None
    output_ids: list[int] = field(default_factory=list)

    def _steps(self) -> AsyncIterator[ParsedStep]:
        return run_parsed(self.engine, self.prompt_ids, self.params, self.request_id, self.parser)

    def _body(self, parsed: ParsedDelta, calls: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": now()}
        if self.chat:
            msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.reasoning:
                msg["thinking"] = parsed.reasoning
            if calls:
                msg["tool_calls"] = calls
            body["message"] = msg
        else:
            body["response"] = parsed.content
            if parsed.reasoning:
                body["thinking"] = parsed.reasoning
        return body

    def _logprobs(self, step: ParsedStep) -> list[dict[str, Any]] | None:
        if not self.params.logprobs or not step.output.logprobs:
            return None
        return format_logprobs(step.output.logprobs, self.render)

    def _seen(self, step: ParsedStep) -> None:
        if self.first_ns is None:
            self.first_ns = time.perf_counter_ns()
        self.output_ids.extend(step.output.token_ids)

    def _final(self, body: dict[str, Any], last: ParsedStep | None) -> dict[str, Any]:
        end = time.perf_counter_ns()
        first = self.first_ns or end
        reason = last.finish_reason if last else "stop"
        body |= {
            "done": True,
            "done_reason": "length" if reason == "length" else "stop",
            "total_duration": end - self.started,
            "load_duration": 0,  # the model was loaded already
            "prompt_eval_count": len(self.prompt_ids),
            "prompt_eval_duration": first - self.started,
            "eval_count": len(self.output_ids),
            "eval_duration": end - first,
        }
        if not self.chat:
            body["context"] = self.prompt_ids + self.output_ids
        return body

    async def collect(self) -> dict[str, Any]:
        whole = ParsedDelta()
        logprobs: list[dict[str, Any]] = []
        last: ParsedStep | None = None
        async with closing(self._steps()) as steps:
            async for step in steps:
                self._seen(step)
                whole.merge(step.parsed)
                logprobs.extend(self._logprobs(step) or [])
                last = step
        body = self._body(whole, tool_calls(whole))
        if self.params.logprobs:
            body["logprobs"] = logprobs
        return self._final(body, last)

    async def stream(self) -> AsyncIterator[bytes]:
        calls = ParsedDelta()  # tool calls go out whole, when the model is done
        last: ParsedStep | None = None
        try:
            async with closing(self._steps()) as steps:
                async for step in steps:
                    self._seen(step)
                    last = step
                    parsed = step.parsed
                    calls.calls.extend(parsed.calls)
                    lps = self._logprobs(step)
                    if parsed.content or parsed.reasoning or lps:
                        body = self._body(parsed, []) | {"done": False}
                        if lps:
                            body["logprobs"] = lps
                        yield line(body)
            if calls.calls:
                yield line(self._body(ParsedDelta(), tool_calls(calls)) | {"done": False})
            yield line(self._final(self._body(ParsedDelta(), []), last))
        except ApiError as exc:
            yield line({"error": exc.message})
        except EngineError as exc:
            yield line({"error": f"the engine could not take this request: {exc}"})
        except Exception as exc:  # never end a stream without saying why
            yield line({"error": f"internal server error ({type(exc).__name__})"})


def tool_calls(parsed: ParsedDelta) -> list[dict[str, Any]]:
    """Ollama's tool calls: arguments as an object, not a JSON string."""
    out = []
    for i, c in enumerate(collect_calls(parsed.calls)):
        try:
            args = json.loads(c.arguments) if c.arguments else {}
        except ValueError:
            args = {}
        fn = {"index": i, "name": c.name, "arguments": args if isinstance(args, dict) else {}}
        out.append({"id": c.id, "function": fn})
    return out


async def prepare(
    state: LiveModel,
    engine: EngineClient,
    tokenizer: Any,
    prompt_ids: list[int],
    req: GenerateFields,
    name: str,
    tools: list[dict[str, Any]] | None,
    *,
    chat: bool,
    started: int,
    mm: Any = None,
) -> OllamaRun:
    """Sampling settings from `options`, the output parser and the `format` grammar."""
    assert state.limits is not None
    fields, num_predict = sampling_options(req.options)
    max_tokens = resolve_max_tokens(
        num_predict,
        len(prompt_ids),
        state.limits,
        state.defaults.get("max_tokens"),
        None,
        "messages" if chat else "prompt",
        "options.num_predict",
    )
    sampling = SamplingFields.model_construct(model=name, **fields)
    logprobs = bool(req.logprobs)
    params = build_sampling_params(
        sampling,
        max_tokens=max_tokens,
        limits=state.limits,
        defaults=state.defaults,
        logprobs=logprobs,
        top_logprobs=req.top_logprobs or 0,
    )
    params.mm = mm  # the images' data (pippin.vision.inputs.MultiModal), if any
    new_parser, params = await output_parsing(
        state, tokenizer, prompt_ids, params, tools, spec=format_spec(req.format)
    )
    try:
        engine.check(prompt_ids, params)
    except EngineError as exc:
        raise bad_request(str(exc), param="messages" if chat else "prompt") from None
    return OllamaRun(
        engine,
        prompt_ids,
        params,
        new_parser(whole=not req.stream),
        name,
        state.token_renderer,
        chat,
        started,
    )


async def loaded_answer(
    state: ServerState, model: str, chat: bool, keep_alive: Any
) -> JSONResponse:
    """An empty request: Ollama loads (or, with keep_alive 0, unloads) the model."""
    unloaded = await load_or_unload(state, model, keep_alive)
    body: dict[str, Any] = {"model": chat_name(state, model), "created_at": now()}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return JSONResponse(body | {"done": True, "done_reason": "unload" if unloaded else "load"})


async def answer(request: Request, run: OllamaRun, stream: bool) -> Any:
    if stream:
        return StreamingResponse(run.stream(), media_type=NDJSON)
    return JSONResponse(await cancel_on_disconnect(request.receive, run.collect()))


# --- routes ----------------------------------------------------------------------


RequestT = TypeVar("RequestT", ChatRequest, GenerateRequest)


async def _opened(request: Request, cls: type[RequestT]) -> tuple[int, RequestT, ServerState]:
    """The request's arrival time, body and the server state (the model's name and
    `keep_alive` checked)."""
    started = time.perf_counter_ns()
    req = await parse_request(cls, await request.body())
    state = get_state(request)
    chat_name(state, req.model)
    registry_keep_alive(req.keep_alive)
    return started, req, state


async def _model(
    state: ServerState, req: ChatRequest | GenerateRequest
) -> tuple[LiveModel, str, EngineClient, LoadedModel]:
    """The chat model a request names, loaded (its `keep_alive` from now on), with its
    name in answers, engine and weights."""
    live = await chat_model(state, req.model, req.keep_alive)
    engine, loaded = live.engine, live.loaded
    assert engine is not None and loaded is not None
    return live, chat_name(state, req.model), engine, loaded


@router.post("/api/chat", response_model=None, **ollama_route(ChatRequest, stream=True))
async def chat(request: Request) -> Any:
    started, req, server = await _opened(request, ChatRequest)
    if not req.messages:
        return await loaded_answer(server, req.model, True, req.keep_alive)
    state, name, engine, loaded = await _model(server, req)
    media = MediaParts()
    messages = template_messages(req.messages, media)
    check_vision(state, media, name)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
    kwargs = think_kwargs(state, req.think, name)
    prompt_ids, mm = await render_media_prompt(
        state, loaded.tokenizer, messages, tools, kwargs, media
    )
    run = await prepare(
        state,
        engine,
        loaded.tokenizer,
        prompt_ids,
        req,
        name,
        tools,
        chat=True,
        started=started,
        mm=mm,
    )
    return await answer(request, run, req.stream)


@router.post("/api/generate", response_model=None, **ollama_route(GenerateRequest, stream=True))
async def generate(request: Request) -> Any:
    started, req, server = await _opened(request, GenerateRequest)
    name = chat_name(server, req.model)
    if req.images and req.raw:
        # A raw prompt has no template to place the images in.
        raise bad_request("images cannot be sent with a raw prompt", param="images")
    if req.suffix:
        raise bad_request(f'"{name}" does not support insert', param="suffix")
    if req.template:
        raise bad_request(
            "template is not supported by this server: the model's own chat template is used",
            param="template",
        )
    if not req.prompt and not req.context:
        return await loaded_answer(server, req.model, False, req.keep_alive)
    state, name, engine, loaded = await _model(server, req)
    assert state.limits is not None
    context = list(req.context or [])
    bad = next((t for t in context if not 0 <= t < state.limits.vocab_size), None)
    if bad is not None:
        raise bad_request(f"invalid token {bad} in context", param="context")
    kwargs = think_kwargs(state, req.think, name)
    prompt = req.prompt or ""
    media = MediaParts()
    mm = None
    if req.raw:
        # As written; special tokens (BOS) only at the start of a fresh context.
        encode = loaded.tokenizer.encode
        ids = await asyncio.to_thread(encode, prompt, add_special_tokens=not context)
    else:
        messages: list[dict[str, Any]] = (
            [{"role": "system", "content": req.system}] if req.system else []
        )
        messages.append(
            {"role": "user", "content": with_images(prompt, req.images, "images", media)}
        )
        check_vision(state, media, name)
        ids, mm = await render_media_prompt(
            state, loaded.tokenizer, messages, None, kwargs, media, messages_param="prompt"
        )
    run = await prepare(
        state,
        engine,
        loaded.tokenizer,
        context + ids,
        req,
        name,
        None,
        chat=False,
        started=started,
        mm=mm,
    )
    return await answer(request, run, req.stream)
