"""POST/GET/DELETE /v1/responses: the OpenAI Responses API.

A request's input items (after those of the response it continues, when it names a
`previous_response_id`) become the one chat job (`responses_input`), prepared and run by
`pippin.serving.job`; `OutputItems` (`responses_output`) turns the loop's events into
output items and the stream's events. The non-streamed answer is the last event of the
same run, so a streamed response always adds up to the non-streamed one.

Stored responses live in memory (`ResponseStore`, least recently used first out).
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
    obfuscation,
    parse_request,
    typed_sse,
)
from pippin.api.openai.responses_input import (
    Conversation,
    check_includes,
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
from pippin.api.openai.responses_output import OutputItems, new_id
from pippin.api.openai.responses_protocol import (
    InputItem,
    MessageItem,
    ResponsesRequest,
)
from pippin.api.openai.responses_store import ResponseStore, StoredResponse, get_store, not_found
from pippin.api.openapi import openai_route
from pippin.serving.errors import (
    ApiError,
    bad_request,
    unsupported_param,
    unsupported_value,
)
from pippin.serving.job import ChatJob, PreparedJob, prepare
from pippin.serving.live_model import LiveModel
from pippin.serving.sampling import Sampling
from pippin.serving.state import ServerState, check_model, use_model
from pippin.serving.streams import guarded
from pippin.serving.tool_loop import (
    ApprovalNeeded,
    CallFinished,
    CallStarted,
)

router = APIRouter()

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
    obfuscate: bool = False
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
            "background": False,
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
        self._save(body)
        yield {"type": f"response.{body['status']}", "response": body}

    def _save(self, body: dict[str, Any]) -> None:
        if self.store is None:
            return
        items = [_ITEM_ADAPTER.validate_python(i, strict=True) for i in body["output"]]
        self.store.put(self.id, StoredResponse(body, [*self.conversation, *items]))

    async def collect(self) -> dict[str, Any]:
        last: dict[str, Any] = {}
        async for event in self.events(whole=True):
            last = event
        return last["response"]

    def stream(self) -> AsyncIterator[str]:
        """Server-sent events with `event:` lines and sequence numbers; a failure midway
        ends the stream with `response.failed`."""
        seq = 0

        def frame(event: dict[str, Any]) -> str:
            nonlocal seq
            event["sequence_number"] = seq
            seq += 1
            if self.obfuscate and event["type"].endswith(".delta"):
                event["obfuscation"] = obfuscation()
            return typed_sse(event)

        async def framed() -> AsyncIterator[str]:
            async for event in self.events():
                yield frame(event)

        def failed(err: ApiError) -> str:
            error = {"code": "server_error", "message": err.message}
            return frame({"type": "response.failed", "response": self.body("failed", error=error)})

        return guarded(framed(), failed)


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
        sampling=Sampling(temperature=req.temperature, top_p=req.top_p),
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
        conversation=conversation,
        store=store if req.store is not False else None,
        obfuscate=bool(req.stream_options and req.stream_options.include_obfuscation),
    )
    if job.mcp is not None:
        # As OpenAI: a server's tools are listed once in a conversation.
        run.list_tools = [
            (label, [listed_tool(t) for t in job.mcp.listed(label)])
            for label in job.mcp.servers
            if label not in conv.listed
        ]
    if req.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await cancel_on_disconnect(request.receive, run.collect()))


@router.get("/v1/responses/{response_id}", **openai_route())
async def retrieve_response(
    response_id: str, request: Request, stream: bool | None = None
) -> dict[str, Any]:
    if stream:
        raise unsupported_param("stream", "Stored responses cannot be streamed again.")
    query = request.query_params
    check_includes([*query.getlist("include"), *query.getlist("include[]")])
    stored = get_store(request).get(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored.body


@router.delete("/v1/responses/{response_id}", **openai_route())
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not get_store(request).delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
