"""POST/GET/DELETE /v1/responses: the OpenAI Responses API.

A request's input items (after those of the response it continues, when it names a
`previous_response_id`) become the one chat job (`responses_input`), prepared and run by
`pippin.serving.job`; `OutputItems` (`responses_output`) turns the loop's events into
output items and the stream's events. The non-streamed answer is the last event of the
same run, so a streamed response always adds up to the non-streamed one.

Stored responses live in memory (`ResponseStore`, least recently used first out).
Streamed and background responses run as tasks apart from their request
(`responses_live`), so that they can be cancelled and background ones polled; the routes
of stored responses (GET, DELETE, cancel, input items) are in `responses_objects`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import TypeAdapter

from pippin.api.common import (
    SSE_HEADERS,
    cancel_on_disconnect,
    get_state,
    parse_request,
)
from pippin.api.openai.responses_input import (
    Conversation,
    current_turn_only,
    echo_tools,
    listed_tool,
    mcp_tools,
    reject_unsupported,
    resolve_items,
    structured_spec,
    template_kwargs,
    template_messages,
    template_tools,
)
from pippin.api.openai.responses_live import LiveResponse, get_live
from pippin.api.openai.responses_objects import router as objects_router
from pippin.api.openai.responses_objects import with_ids
from pippin.api.openai.responses_output import OutputItems, new_id
from pippin.api.openai.responses_protocol import (
    InputItem,
    MessageItem,
    ResponsesRequest,
)
from pippin.api.openai.responses_store import ResponseStore, StoredResponse, get_store
from pippin.api.openapi import openai_route
from pippin.serving.errors import (
    ApiError,
    bad_request,
    unsupported_value,
)
from pippin.serving.job import ChatJob, PreparedJob, prepare
from pippin.serving.live_model import LiveModel
from pippin.serving.sampling import Sampling
from pippin.serving.state import ServerState, check_model, use_model
from pippin.serving.tool_loop import (
    ApprovalNeeded,
    CallFinished,
    CallStarted,
)

router = APIRouter()
router.include_router(objects_router)

_ITEM_ADAPTER: TypeAdapter[Any] = TypeAdapter(InputItem)


# --- the run -----------------------------------------------------------------------


def usage_body(prompt: int, cached: int, output: int, reasoning: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": prompt + output,
    }


@dataclass
class ResponseRun:
    """One prepared request: runs it and answers it, streamed or whole."""

    prepared: PreparedJob
    # The response object's fields that echo the request.
    echo: dict[str, Any]
    # The conversation before this response's output (stored with it when asked to).
    conversation: list[Any]
    store: ResponseStore | None
    background: bool = False
    created_at: int = field(default_factory=lambda: int(time.time()))
    usage: dict[str, Any] | None = None
    output: OutputItems | None = None
    # With MCP tools: the (server label, tools) to list first.
    list_tools: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.prepared.job.request_id

    def body(self, status: str, **extra: Any) -> dict[str, Any]:
        out = self.output
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": self.background,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": None,
            **self.echo,
            "output": copy.deepcopy(out.items) if out is not None else [],
            "usage": self.usage,
            **extra,
        }

    async def events(self, whole: bool = False) -> AsyncIterator[dict[str, Any]]:
        """The stream's events, without sequence numbers; the last holds the response.
        `whole`: only the last is answered (a call cut off comes back as text).

        Engine failures raise (as ApiError)."""
        if self.background:  # as OpenAI: queued first
            yield {"type": "response.created", "response": self.body("queued")}
            yield {"type": "response.queued", "response": self.body("queued")}
        else:
            yield {"type": "response.created", "response": self.body("in_progress")}
        yield {"type": "response.in_progress", "response": self.body("in_progress")}
        loop = self.prepared.loop
        out = self.output = OutputItems(loop)
        for label, tools in self.list_tools:
            for event in out.list_tools(label, tools):
                yield event
        async for ev in loop.events(whole):
            if isinstance(ev, CallStarted):
                events = out.call_started(ev.call)
            elif isinstance(ev, CallFinished):
                events = out.call_finished(ev.call)
            elif isinstance(ev, ApprovalNeeded):
                events = out.close("completed")
            else:
                self.usage = usage_body(
                    loop.prompt_tokens,
                    loop.cached_tokens,
                    loop.completion_tokens,
                    loop.reasoning_tokens,
                )
                events = out.feed(ev.parsed)
            for event in events:
                yield event
        incomplete = loop.finish_reason == "length"
        for event in out.close("incomplete" if incomplete else "completed"):
            yield event
        if incomplete:
            body = self.body("incomplete", incomplete_details={"reason": "max_output_tokens"})
        else:
            body = self.body("completed")
        self.save(body)
        yield {"type": f"response.{body['status']}", "response": body}

    def cancelled(self) -> list[dict[str, Any]]:
        """The events that end a run stopped by `cancel` (its open item cut short); the
        cancelled response is stored. The stream's event types (the SDK's) have none for
        a cancelled response: it ends with `response.incomplete`, whose response says
        `cancelled`."""
        events = self.output.close("incomplete") if self.output is not None else []
        body = self.body("cancelled")
        self.save(body)
        return [*events, {"type": "response.incomplete", "response": body}]

    def save(self, body: dict[str, Any]) -> None:
        if self.store is None:
            return
        items = [_ITEM_ADAPTER.validate_python(i, strict=True) for i in body["output"]]
        stored = StoredResponse(body, [*self.conversation, *items], len(self.conversation))
        self.store.put(self.id, stored)

    async def collect(self) -> dict[str, Any]:
        last: dict[str, Any] = {}
        async for event in self.events(whole=True):
            last = event
        return last["response"]


# --- routes ------------------------------------------------------------------------


def _conversation(req: ResponsesRequest, store: ResponseStore) -> list[tuple[Any, str]]:
    """Each item of the conversation with its param path for errors; the earlier
    conversation comes from `previous_response_id`."""
    earlier: list[tuple[Any, str]] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise bad_request(
                f"Previous response with id '{req.previous_response_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        earlier = [(item, "previous_response_id") for item in prev.conversation]
    if isinstance(req.input, str):
        new = [(MessageItem(role="user", content=req.input), "input")]
    else:
        new = resolve_items(req.input or [], store)
    return [*earlier, *new]


def _echo(req: ResponsesRequest, live: LiveModel) -> dict[str, Any]:
    def pick(name: str) -> Any:
        value = getattr(req, name)
        return live.defaults.get(name) if value is None else value

    return {
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "max_tool_calls": req.max_tool_calls,
        "model": req.model,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "prompt_cache_key": req.prompt_cache_key,
        "reasoning": {
            "effort": req.reasoning.effort if req.reasoning else None,
            "summary": req.reasoning.summary if req.reasoning else None,
        },
        "safety_identifier": req.safety_identifier,
        "service_tier": "default",  # there is one tier
        "store": req.store is not False,
        "temperature": pick("temperature"),
        "text": {
            "format": {"type": "text"},
            "verbosity": (req.text.verbosity if req.text else None) or "medium",
        },
        "tool_choice": req.tool_choice or "auto",
        "tools": echo_tools(req),
        "top_logprobs": req.top_logprobs or 0,
        "top_p": pick("top_p"),
        "truncation": req.truncation or "disabled",
        "user": req.user,
        "metadata": req.metadata or {},
    }


def _overflow(req: ResponsesRequest) -> Callable[[ApiError], ApiError] | None:
    """A context overflow under `truncation: auto`, which pippin cannot do yet."""
    if req.truncation != "auto":
        return None
    return lambda exc: unsupported_value(
        "truncation",
        f"{exc.message} Dropping input items to make it fit ('truncation': 'auto') "
        "is not supported yet.",
    )


def response_job(
    req: ResponsesRequest, server: ServerState, store: ResponseStore
) -> tuple[ChatJob, list[Any], Conversation]:
    """The request as the one chat job, with its conversation's items (stored with the
    response) and the conversation in the template's shape; everything that can be
    refused without the model is refused first."""
    reject_unsupported(req)
    tools = template_tools(req)
    mcp = mcp_tools(req, server)
    if mcp is not None:
        mcp.check_clash(tools, "tools")
    conversation = _conversation(req, store)
    conv = template_messages(req.instructions, conversation)
    pending = conv.pending()
    if pending and mcp is None:
        raise bad_request(
            "Approved MCP calls run with the request's 'mcp' tools; name their server in 'tools'.",
            param="tools",
        )
    if not conv.out:
        raise bad_request("Missing required parameter: 'input'.", param="input")
    messages = conv.out
    if req.reasoning is not None and req.reasoning.context == "current_turn":
        messages = current_turn_only(messages)
    job = ChatJob(
        model=req.model,
        request_id=new_id("resp"),
        messages=messages,
        media=conv.media,
        tools=tools,
        mcp=mcp,
        sampling=Sampling(temperature=req.temperature, top_p=req.top_p, priority=req.priority),
        max_tokens=req.max_output_tokens,
        max_tokens_param="max_output_tokens",
        messages_param="input",
        one_call=req.parallel_tool_calls is False,
        max_calls=req.max_tool_calls,
        pending=pending,
        template_kwargs=lambda live: template_kwargs(req, live),
        output_spec=lambda live, offered: structured_spec(req, live, offered),
        overflow=_overflow(req),
    )
    return job, [item for item, _ in conversation], conv


@router.post("/v1/responses", response_model=None, **openai_route(ResponsesRequest, stream=True))
async def create_response(request: Request) -> Any:
    req = await parse_request(ResponsesRequest, await request.body())
    server = get_state(request)
    check_model(server, req.model)
    store = get_store(request)
    job, conversation, conv = response_job(req, server, store)
    live = await use_model(server, req.model)
    run = ResponseRun(
        await prepare(live, job),
        echo=_echo(req, live),
        conversation=with_ids(conversation),
        store=store if req.store is not False else None,
        background=bool(req.background),
    )
    if job.mcp is not None:
        # As OpenAI: a server's tools are listed once in a conversation.
        run.list_tools = [
            (label, [listed_tool(t) for t in job.mcp.listed(label)])
            for label in job.mcp.servers
            if label not in conv.listed
        ]
    if not (req.stream or req.background):
        return JSONResponse(await cancel_on_disconnect(request.receive, run.collect()))
    running = LiveResponse(run, background=run.background)
    # A background run not streamed ends as `collect`'s (a call cut off as text).
    get_live(request).start(running, whole=not req.stream)
    if not req.stream:
        return JSONResponse(run.body("queued"))
    obfuscate = bool(req.stream_options and req.stream_options.include_obfuscation)
    return StreamingResponse(
        running.sse(obfuscate=obfuscate), media_type="text/event-stream", headers=SSE_HEADERS
    )
