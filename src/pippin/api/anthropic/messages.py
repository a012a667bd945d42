"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A request becomes the one chat job (`messages_input`: messages and tools in the
template's shape; `context_editing`: its `context_management` edits), prepared and run by
`pippin.serving.job`; the loop's events come back as content blocks (`messages_output`),
streamed with Anthropic's event grammar. Any `claude-*` model name is served by the
default model, so Claude Code works without configuration.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pippin.api.anthropic.context_editing import clear_thinking, clear_tool_uses, triggered
from pippin.api.anthropic.messages_input import (
    mcp_tools,
    reject_unsupported,
    structured_spec,
    template_messages,
    template_tools,
)
from pippin.api.anthropic.messages_output import BlockBuilder, stop_fields, tool_id, usage_body
from pippin.api.anthropic.protocol import (
    ClearThinking,
    CountTokensRequest,
    InputMessage,
    MessagesRequest,
    ThinkingDisabled,
    ThinkingEnabled,
)
from pippin.api.common import SSE_HEADERS, cancel_on_disconnect, get_state, parse_request, typed_sse
from pippin.api.errors import anthropic_body
from pippin.api.openapi import anthropic_route
from pippin.serving.errors import bad_request
from pippin.serving.job import ChatJob, PreparedJob, Rendered, prepare, render
from pippin.serving.limits import Limits
from pippin.serving.live_model import LiveModel
from pippin.serving.media import MediaParts
from pippin.serving.pipeline import (
    ParsedStep,
)
from pippin.serving.sampling import Sampling
from pippin.serving.state import ServerState, check_model, use_model
from pippin.serving.streams import closing, guarded
from pippin.serving.tool_loop import CallFinished, CallStarted, ToolLoop

router = APIRouter()

PING_SECONDS = 5.0
# message_start waits this long for the engine to schedule the request (`_Admitted`).
_START_WAIT = 1.0


# --- the job ---------------------------------------------------------------


def fit_max_tokens(model: str, requested: int, prompt_len: int, limits: Limits) -> int:
    """What the engine may generate for `requested`, as the hosted API (Claude Sonnet 4.5
    and later) takes it: a prompt that fills the context and a max_tokens above the most
    the model may give (here --max-tokens) are refused in its words; a max_tokens the rest
    of the context cannot hold is served, cut to that rest, and an answer that reaches the
    context's end stops with "model_context_window_exceeded" (`MessageRun._stop`). So
    Claude Code, which asks for 32,000 tokens and more, is answered the first time."""
    limit = limits.max_model_len
    if prompt_len >= limit:
        raise bad_request(
            f"prompt is too long: {prompt_len} tokens > {limit - 1} maximum",
            param="messages",
            code="context_length_exceeded",
        )
    cap = limits.max_tokens_cap
    if cap is not None and requested > cap:
        raise bad_request(
            f"max_tokens: {requested} > {cap}, which is the maximum allowed number of output "
            f"tokens for {model}",
            param="max_tokens",
            code="invalid_value",
        )
    return min(requested, limit - prompt_len)


def template_kwargs(req: MessagesRequest | CountTokensRequest, live: LiveModel) -> dict[str, Any]:
    """`thinking` and `output_config.effort` as the model's template takes them."""
    thinking = req.thinking
    effort = req.output_config.effort if req.output_config else None
    for i, m in enumerate(req.messages):
        if m.output_config is None:
            continue
        if m.output_config.format is not None:
            param = f"messages[{i}].output_config.format"
            raise bad_request(
                f"{param}: an output format applies to the whole request; set it at the top level.",
                param,
            )
        # A turn's effort holds for the turns that follow it: the latest one is the answer's.
        effort = m.output_config.effort or effort
    if thinking is None and effort is None:
        return {}
    info = live.template
    assert info is not None
    on = thinking is None or not isinstance(thinking, ThinkingDisabled)
    if info.reasoning_kwarg == "enable_thinking":
        return {"enable_thinking": on}
    if info.reasoning_kwarg == "reasoning_effort":
        return {"reasoning_effort": (effort or "high") if on else "low"}
    # A model without a thinking mode answers without thinking, as the hosted API does
    # for a model that cannot think (Claude Code sends `thinking` on every request).
    return {}


def message_job(req: MessagesRequest | CountTokensRequest, server: ServerState) -> ChatJob:
    """The request as the one chat job (its messages rendered by `render_prompt`, which
    applies context management); what can be refused without the model is."""
    mcp = mcp_tools(server, req)
    reject_unsupported(req)
    tools = template_tools(req)
    prefill = _prefill(req.messages)
    job = ChatJob(
        model=req.model,
        request_id="msg_" + uuid.uuid4().hex[:24],
        messages=[],
        tools=tools,
        mcp=mcp,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        new_id=tool_id,
        # disable_parallel_tool_use: only the first call the model writes is answered.
        one_call=bool(req.tool_choice and req.tool_choice.disable_parallel_tool_use),
        template_kwargs=lambda live: template_kwargs(req, live),
    )
    if not isinstance(req, MessagesRequest):
        return job
    if isinstance(req.thinking, ThinkingEnabled):
        if req.thinking.budget_tokens >= req.max_tokens:
            raise bad_request(
                "`max_tokens` must be greater than `thinking.budget_tokens`.",
                "thinking.budget_tokens",
            )
        job.thinking_budget = req.thinking.budget_tokens
    job.sampling = Sampling(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=req.stop_sequences,
        # The API key's own prefix cache (--api-keys) is salted in `build_sampling_params`.
    )
    job.max_tokens = req.max_tokens
    job.max_tokens_rule = partial(fit_max_tokens, req.model)
    job.budget_param = "thinking.budget_tokens"
    job.budget_if_possible = True  # the template's switch is all such a model has
    job.output_spec = lambda live, offered: structured_spec(live, req, offered)
    return job


@dataclass
class Prompt:
    """A request's prompt once context management has edited its conversation."""

    job: ChatJob  # with the messages (and media) the prompt holds
    rendered: Rendered
    # What context management did, as the response reports it (None: not asked for),
    # and the prompt's length before it.
    applied_edits: list[dict[str, Any]] | None = None
    original_tokens: int = 0

    def context_management(self) -> dict[str, Any] | None:
        if self.applied_edits is None:
            return None
        return {"applied_edits": self.applied_edits}


def _prefill(messages: list[InputMessage]) -> bool:
    """Whether the conversation ends with an assistant turn of text that the answer goes on
    from (Anthropic's prefill): then the prompt ends inside that turn, not after it."""
    last = messages[-1] if messages else None
    if last is None or last.role != "assistant":
        return False
    blocks = [last.content] if isinstance(last.content, str) else last.content
    texts = [b if isinstance(b, str) else getattr(b, "text", None) for b in blocks]
    if not texts or any(t is None for t in texts):
        return False  # a tool call or thinking block: the turn is complete
    if texts[-1] != texts[-1].rstrip():
        raise bad_request(
            "messages: final assistant content cannot end with trailing whitespace",
            param=f"messages[{len(messages) - 1}].content",
        )
    return True


async def render_prompt(
    live: LiveModel, job: ChatJob, req: MessagesRequest | CountTokensRequest
) -> Prompt:
    """The conversation rendered, then edited and rendered again by each of the request's
    `context_management` edits that applies."""

    async def rendered(history: list[Any]) -> tuple[ChatJob, Rendered]:
        media = MediaParts()
        edited = replace(job, messages=template_messages(req.system, history, media), media=media)
        return edited, await render(live, edited)

    history = req.messages
    job, prompt = await rendered(history)
    original = len(prompt.ids)
    if req.context_management is None:
        return Prompt(job, prompt)
    applied: list[dict[str, Any]] = []
    # Edits apply in order (Anthropic: clear_thinking first), each to the last one's result.
    for edit in req.context_management.edits:
        if isinstance(edit, ClearThinking):
            edited, count = clear_thinking(history, edit)
            kind, least = "cleared_thinking_turns", 0
        elif triggered(edit, history, len(prompt.ids)):
            edited, count = clear_tool_uses(history, edit)
            kind = "cleared_tool_uses"
            least = edit.clear_at_least.value if edit.clear_at_least else 0
        else:
            continue
        if not count:
            continue
        edited_job, edited_prompt = await rendered(edited)
        cleared = len(prompt.ids) - len(edited_prompt.ids)
        if cleared < least:
            continue  # as Anthropic: an edit that would clear too little is not made
        history, job, prompt = edited, edited_job, edited_prompt
        applied.append({"type": edit.type, kind: count, "cleared_input_tokens": cleared})
    return Prompt(job, prompt, applied, original)


# --- the run -----------------------------------------------------------------


@dataclass
class MessageRun:
    """A prepared request, answered as one message or streamed as its events."""

    prepared: PreparedJob
    model: str
    context_management: dict[str, Any] | None = None
    omit_thinking: bool = False
    # Thinking off: a model that reasons anyway shows none of it, as the hosted API shows none.
    drop_thinking: bool = False

    @property
    def loop(self) -> ToolLoop:
        return self.prepared.loop

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.prepared.job.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
        }

    def _stop(self, builder: BlockBuilder) -> tuple[str, str | None]:
        loop = self.loop
        if loop.finish_reason == "length":
            # Cut before the max_tokens asked for: the context ended it (`fit_max_tokens`).
            asked = self.prepared.job.max_tokens
            if asked is not None and loop.completion_tokens < asked:
                return "model_context_window_exceeded", None
            return "max_tokens", None
        reason, seq = stop_fields(loop.last_step, builder.client_called())
        if reason == "tool_use" and loop.tools is not None and not builder.client_called():
            reason = "end_turn"  # only pippin's calls were made: the model answered
        return reason, seq

    def _usage(self) -> dict[str, Any]:
        loop = self.loop
        prompt = loop.prompt_tokens or len(self.prepared.prompt_ids)
        return usage_body(prompt, loop.cached_tokens, loop.completion_tokens)

    def _feed(self, builder: BlockBuilder, ev: Any) -> list[dict[str, Any]]:
        if isinstance(ev, ParsedStep):
            return builder.feed(ev.parsed)
        if isinstance(ev, CallStarted):
            return builder.close()
        if isinstance(ev, CallFinished):
            return builder.result(ev.call)
        return []

    async def collect(self) -> dict[str, Any]:
        loop = self.loop
        builder = BlockBuilder(self.omit_thinking, self.drop_thinking, loop=loop)
        async with closing(loop.events(whole=True)) as events:
            async for ev in events:
                self._feed(builder, ev)
        builder.close()
        reason, seq = self._stop(builder)
        body = {
            **self._head(),
            "content": builder.blocks,
            "stop_reason": reason,
            "stop_sequence": seq,
            "usage": self._usage(),
        }
        if self.context_management is not None:
            body["context_management"] = self.context_management
        return body

    def stream(self) -> AsyncIterator[str]:
        return guarded(self._events(), lambda err: typed_sse(anthropic_body(err)))

    async def _events(self) -> AsyncIterator[str]:
        loop = self.loop
        builder = BlockBuilder(self.omit_thinking, self.drop_thinking, loop=loop)
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async with closing(loop.events()) as events:
                    async for ev in events:
                        await queue.put(ev)
                await queue.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the stream
                await queue.put(exc)

        # The engine tells the prompt's cached tokens once it has matched the prefix, before
        # the prefill runs; a request still waiting for room in the batch gets its
        # message_start without them after _START_WAIT (message_delta has them all).
        loop.on_admitted = lambda cached: queue.put_nowait(_Admitted(cached))
        task = asyncio.ensure_future(pump())
        try:
            first = await _get(queue, _START_WAIT)
            cached = first.cached_tokens if isinstance(first, ParsedStep | _Admitted) else 0
            start = {
                **self._head(),
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage_body(len(self.prepared.prompt_ids), cached, 0),
            }
            yield typed_sse({"type": "message_start", "message": start})
            yield typed_sse({"type": "ping"})
            item: Any = first
            while True:
                while item is _TIMEOUT or isinstance(item, _Admitted):
                    if item is _TIMEOUT:
                        yield typed_sse({"type": "ping"})  # still reading the prompt
                    item = await _get(queue, PING_SECONDS)
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                for ev in self._feed(builder, item):
                    yield typed_sse(ev)
                item = await _get(queue, PING_SECONDS)
            for ev in builder.close():
                yield typed_sse(ev)
            reason, seq = self._stop(builder)
            final: dict[str, Any] = {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": seq},
                "usage": self._usage(),
            }
            if self.context_management is not None:
                final["context_management"] = self.context_management
            yield typed_sse(final)
            yield typed_sse({"type": "message_stop"})
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


_TIMEOUT = object()


@dataclass
class _Admitted:
    """The engine has scheduled the first turn: its prompt's cached tokens."""

    cached_tokens: int


async def _get(queue: asyncio.Queue[Any], timeout: float) -> Any:
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except asyncio.TimeoutError:
        return _TIMEOUT


# --- routes ------------------------------------------------------------------


@router.post("/v1/messages", response_model=None, **anthropic_route(MessagesRequest, stream=True))
async def create_message(request: Request) -> Any:
    req = await parse_request(MessagesRequest, await request.body())
    server = get_state(request)
    check_model(server, req.model)
    if not req.messages:
        raise bad_request("messages: at least one message is required.", param="messages")
    job = message_job(req, server)
    live = await use_model(server, req.model)
    prompt = await render_prompt(live, job, req)
    run = MessageRun(
        await prepare(live, prompt.job, prompt.rendered),
        req.model,
        prompt.context_management(),
        omit_thinking=getattr(req.thinking, "display", None) == "omitted",
        drop_thinking=isinstance(req.thinking, ThinkingDisabled),
    )
    if req.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await cancel_on_disconnect(request.receive, run.collect()))


@router.post(
    "/v1/messages/count_tokens", response_model=None, **anthropic_route(CountTokensRequest)
)
async def count_tokens(request: Request) -> Any:
    req = await parse_request(CountTokensRequest, await request.body())
    server = get_state(request)
    check_model(server, req.model)
    job = message_job(req, server)
    live = await use_model(server, req.model)
    prompt = await render_prompt(live, job, req)
    body: dict[str, Any] = {"input_tokens": len(prompt.rendered.ids)}
    if prompt.applied_edits is not None:
        body["context_management"] = {"original_input_tokens": prompt.original_tokens}
    return JSONResponse(body)
