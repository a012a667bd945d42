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

from pippin.api.common import cancel_on_disconnect, get_state, parse_request
from pippin.api.ollama.protocol import (
    ChatRequest,
    GenerateFields,
    GenerateRequest,
    Message,
    context_option,
    sampling_options,
)
from pippin.api.ollama.served import (
    chat_model,
    chat_name,
    load_or_unload,
    registry_keep_alive,
)
from pippin.api.openapi import ollama_route
from pippin.chat.fim import fim_format, fim_prompt
from pippin.chat.tool_parsers.base import ParsedDelta, collect_calls
from pippin.serving.errors import bad_request
from pippin.serving.job import ChatJob, PreparedJob, Rendered, prepare, render
from pippin.serving.live_model import LiveModel
from pippin.serving.logprobs import TokenRenderer, token_logprobs
from pippin.serving.media import MediaParts
from pippin.serving.pipeline import (
    ParsedStep,
    grammar_error,
)
from pippin.serving.sampling import Sampling
from pippin.serving.state import ServerState
from pippin.serving.streams import closing, guarded
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


def check_vision(live: LiveModel, media: MediaParts, name: str) -> None:
    """Ollama's 400 for images sent to a model without vision."""
    if media and (live.loaded is None or live.loaded.vision is None):
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


def think_kwargs(live: LiveModel, think: bool | str | None, name: str) -> dict[str, Any]:
    """`think` as the model's template takes it; Ollama's 400 for a model that cannot."""
    kwargs: dict[str, Any] = {}  # above --default-chat-template-kwargs (`serving.job`)
    info, parsers = live.template, live.parsers
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
    """One prepared chat or generate request; answers in either shape."""

    prepared: PreparedJob
    model: str
    render: TokenRenderer
    chat: bool  # /api/chat's message objects, else /api/generate's `response`
    started: int  # perf_counter_ns at the request's arrival
    load_ns: int = 0  # finding the model, loading it if it was not
    eval_start: int | None = None  # the prompt handed to the engine
    first_ns: int | None = None
    output_ids: list[int] = field(default_factory=list)

    async def _steps(self, whole: bool) -> AsyncIterator[ParsedStep]:
        self.eval_start = time.perf_counter_ns()
        async with closing(self.prepared.loop.events(whole)) as events:
            async for ev in events:
                if isinstance(ev, ParsedStep):
                    yield ev

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
        if not self.prepared.params.logprobs or not step.output.logprobs:
            return None
        return token_logprobs(step.output.logprobs, self.render)

    def _seen(self, step: ParsedStep) -> None:
        if self.first_ns is None:
            self.first_ns = time.perf_counter_ns()
        self.output_ids.extend(step.output.token_ids)

    def _final(self, body: dict[str, Any], last: ParsedStep | None) -> dict[str, Any]:
        end = time.perf_counter_ns()
        first = self.first_ns or end
        reason = last.finish_reason if last else "stop"
        prompt_ids = self.prepared.prompt_ids
        # Disjoint spans of [arrival, end], so the total is at least their sum.
        body |= {
            "done": True,
            "done_reason": "length" if reason == "length" else "stop",
            "total_duration": end - self.started,
            "load_duration": self.load_ns,
            "prompt_eval_count": len(prompt_ids),
            "prompt_eval_duration": first - (self.eval_start or first),
            "eval_count": len(self.output_ids),
            "eval_duration": end - first,
        }
        if not self.chat:
            body["context"] = prompt_ids + self.output_ids
        return body

    async def collect(self) -> dict[str, Any]:
        whole = ParsedDelta()
        logprobs: list[dict[str, Any]] = []
        last: ParsedStep | None = None
        async with closing(self._steps(whole=True)) as steps:
            async for step in steps:
                self._seen(step)
                whole.merge(step.parsed)
                logprobs.extend(self._logprobs(step) or [])
                last = step
        body = self._body(whole, tool_calls(whole))
        if self.prepared.params.logprobs:
            body["logprobs"] = logprobs
        return self._final(body, last)

    def stream(self) -> AsyncIterator[bytes]:
        # Ollama's error line: the message alone.
        return guarded(self._lines(), lambda err: line({"error": err.message}))

    async def _lines(self) -> AsyncIterator[bytes]:
        calls = ParsedDelta()  # tool calls go out whole, when the model is done
        last: ParsedStep | None = None
        async with closing(self._steps(whole=False)) as steps:
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


def ollama_job(
    req: GenerateFields,
    messages: list[dict[str, Any]],
    media: MediaParts | None,
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
    *,
    chat: bool,
) -> ChatJob:
    """A chat or generate request as the one chat job: sampling from `options`, the
    `format` grammar."""
    fields, num_predict = sampling_options(req.options)
    spec = format_spec(req.format)
    return ChatJob(
        model=req.model,
        request_id=f"ollama-{uuid.uuid4().hex}",
        messages=messages,
        media=media,
        tools=tools,
        sampling=Sampling(
            **fields, logprobs=bool(req.logprobs), top_logprobs=req.top_logprobs or 0
        ),
        max_tokens=num_predict,
        max_tokens_param="options.num_predict",
        messages_param="messages" if chat else "prompt",
        template_kwargs=lambda live: kwargs,
        output_spec=(lambda live, offered: spec) if spec is not None else None,
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


@dataclass
class _Model:
    live: LiveModel
    name: str  # as answers name it
    load_ns: int  # the time it took to find it, or to load it


async def _model(state: ServerState, req: ChatRequest | GenerateRequest) -> _Model:
    """The chat model a request names, loaded (its `keep_alive` from now on)."""
    t0 = time.perf_counter_ns()
    live = await chat_model(state, req.model, req.keep_alive)
    return _Model(live, chat_name(state, req.model), time.perf_counter_ns() - t0)


def fit_context(job: ChatJob, num_ctx: int | None, prompt_len: int, live: LiveModel) -> None:
    """`options.num_ctx` below the served context caps this request's: a prompt longer
    than it is refused naming it (Ollama would cut the prompt), and the answer stops
    (`done_reason: "length"`) where prompt and answer fill it (Ollama would shift)."""
    limits = live.limits
    assert limits is not None
    if num_ctx is None or num_ctx >= limits.max_model_len:
        return
    room = num_ctx - prompt_len
    if room < 1:
        raise bad_request(
            f"the prompt ({prompt_len} tokens) does not fit num_ctx ({num_ctx})",
            param="options.num_ctx",
        )
    bounds = (job.max_tokens, limits.max_tokens_cap, live.defaults.get("max_tokens"))
    job.max_tokens = min([room, *(b for b in bounds if b is not None and b > 0)])


def _run(m: _Model, prepared: PreparedJob, chat: bool, started: int) -> OllamaRun:
    live = m.live
    return OllamaRun(prepared, m.name, live.token_renderer, chat, started, load_ns=m.load_ns)


@router.post("/api/chat", response_model=None, **ollama_route(ChatRequest, stream=True))
async def chat(request: Request) -> Any:
    started, req, server = await _opened(request, ChatRequest)
    if not req.messages:
        return await loaded_answer(server, req.model, True, req.keep_alive)
    m = await _model(server, req)
    live, name = m.live, m.name
    media = MediaParts()
    messages = template_messages(req.messages, media)
    check_vision(live, media, name)
    tools = [t.model_dump(exclude_none=True) for t in req.tools or []] or None
    job = ollama_job(req, messages, media, tools, think_kwargs(live, req.think, name), chat=True)
    rendered = await render(live, job)
    fit_context(job, context_option(req.options), len(rendered.ids), live)
    run = _run(m, await prepare(live, job, rendered), True, started)
    return await answer(request, run, req.stream)


def _fim_job(req: GenerateRequest, m: _Model, context: list[int]) -> tuple[ChatJob, Rendered]:
    """`suffix`: the prompt and the suffix in the model's fill-in-the-middle tokens, no
    template (a model without them: Ollama's 400)."""
    live = m.live
    assert live.loaded is not None
    tokenizer = live.loaded.tokenizer
    fmt = fim_format(tokenizer)
    if fmt is None:
        raise bad_request(f'"{m.name}" does not support insert', param="suffix")
    for field_name in ("system", "images", "think"):
        if getattr(req, field_name):
            raise bad_request(f"{field_name} cannot be sent with suffix", param=field_name)
    job = ollama_job(req, [], None, None, {}, chat=False)
    # After a `context`, no BOS (as `raw`).
    fim = fim_prompt(tokenizer, fmt, req.prompt or "", req.suffix or "", bos=not context)
    job.sampling.stop_token_ids = fim.stop_token_ids
    return job, Rendered(context + fim.ids)


@router.post("/api/generate", response_model=None, **ollama_route(GenerateRequest, stream=True))
async def generate(request: Request) -> Any:
    started, req, server = await _opened(request, GenerateRequest)
    if req.images and req.raw:
        # A raw prompt has no template to place the images in.
        raise bad_request("images cannot be sent with a raw prompt", param="images")
    if req.template:
        raise bad_request(
            "template is not supported by this server: the model's own chat template is used",
            param="template",
        )
    if not req.prompt and not req.context and not req.suffix:
        return await loaded_answer(server, req.model, False, req.keep_alive)
    m = await _model(server, req)
    live, name = m.live, m.name
    assert live.limits is not None and live.loaded is not None
    context = list(req.context or [])
    bad = next((t for t in context if not 0 <= t < live.limits.vocab_size), None)
    if bad is not None:
        raise bad_request(f"invalid token {bad} in context", param="context")
    if req.suffix:
        job, rendered = await asyncio.to_thread(_fim_job, req, m, context)
    else:
        job, rendered = await _plain_job(req, live, name, context)
    fit_context(job, context_option(req.options), len(rendered.ids), live)
    run = _run(m, await prepare(live, job, rendered), False, started)
    return await answer(request, run, req.stream)


async def _plain_job(
    req: GenerateRequest, live: LiveModel, name: str, context: list[int]
) -> tuple[ChatJob, Rendered]:
    """The prompt as one user turn of the model's template (after `system`), or as
    written (`raw`), after the `context` ids."""
    assert live.loaded is not None
    kwargs = think_kwargs(live, req.think, name)
    prompt = req.prompt or ""
    media = MediaParts()
    messages: list[dict[str, Any]] = (
        [{"role": "system", "content": req.system}] if req.system else []
    )
    if not req.raw:
        messages.append(
            {"role": "user", "content": with_images(prompt, req.images, "images", media)}
        )
        check_vision(live, media, name)
    job = ollama_job(req, messages, media, None, kwargs, chat=False)
    if req.raw:
        # As written; special tokens (BOS) only at the start of a fresh context.
        encode = live.loaded.tokenizer.encode
        rendered = Rendered(await asyncio.to_thread(encode, prompt, add_special_tokens=not context))
    else:
        rendered = await render(live, job)
    rendered.ids = context + rendered.ids
    return job, rendered
