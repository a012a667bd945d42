"""POST/GET/DELETE /v1/responses: the OpenAI Responses API.

A request's input items (after those of the response it continues, when it names a
`previous_response_id`) become template messages; the shared chat pipeline renders,
runs and parses them; `_Output` turns the parsed deltas into output items and the
stream's events. The non-streamed answer is the last event of the same run, so a
streamed response always adds up to the non-streamed one.

Stored responses live in memory (`ResponseStore`, least recently used first out).
"""

from __future__ import annotations

import copy
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import TypeAdapter

from pippin.api.common import (
    SSE_HEADERS,
    cancel_on_disconnect,
    obfuscation,
    parse_request,
    typed_sse,
)
from pippin.api.openai.protocol import SamplingFields
from pippin.api.openai.responses_protocol import (
    BuiltinTool,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    ItemReference,
    McpApprovalRequestItem,
    McpApprovalResponseItem,
    McpCallItem,
    McpListToolsItem,
    McpTool,
    MessageItem,
    NamespaceTool,
    OtherItem,
    ReasoningItem,
    ResponsesRequest,
)
from pippin.api.openai.structured_output import ForcedTool, forced_tool
from pippin.api.openapi import openai_route
from pippin.chat.tool_parsers.base import CallDelta, ParsedDelta, random_call_id
from pippin.engine.client import EngineClient, EngineError
from pippin.engine.types import SamplingParams
from pippin.serving.errors import (
    ApiError,
    bad_request,
    server_error,
    unsupported_param,
    unsupported_value,
)
from pippin.serving.media import MediaParts
from pippin.serving.pipeline import (
    NewParser,
    arguments_for_template,
    effort_kwargs,
    output_parsing,
    render_media_prompt,
    tool_parser,
    verbosity_kwargs,
)
from pippin.serving.sampling import build_sampling_params, resolve_max_tokens
from pippin.serving.state import check_model, get_state, require_engine, use_model
from pippin.serving.tool_loop import (
    ApprovalNeeded,
    CallFinished,
    CallStarted,
    McpCall,
    McpTools,
    ToolLoop,
    Turn,
    error_body,
    openai_mcp_tools,
    request_loop,
)
from pippin.structured.formats import response_format_grammar
from pippin.structured.spec import GrammarSpec, StructuredOutputError
from pippin.structured.tool_calls import forced_tool_grammar

router = APIRouter()

# Stored responses kept in memory before the least recently used is dropped.
STORE_CAPACITY = 1000
# `include` values that name outputs pippin never produces (so they are always empty).
_EMPTY_INCLUDES = frozenset(
    {
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "message.input_image.image_url",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
        "reasoning.encrypted_content",
    }
)
_ITEM_ADAPTER: TypeAdapter[Any] = TypeAdapter(InputItem)


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# --- the store -----------------------------------------------------------------


@dataclass
class StoredResponse:
    body: dict[str, Any]
    # The conversation up to and including this response's output (instructions aside:
    # as OpenAI, they are not carried over to the next response).
    conversation: list[Any]


class ResponseStore:
    """Responses by id, bounded by count; the least recently used goes first."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str) -> StoredResponse | None:
        hit = self._items.get(response_id)
        if hit is not None:
            self._items.move_to_end(response_id)
        return hit

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._items[response_id] = stored
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None

    def find_item(self, item_id: str) -> Any | None:
        """An item of a stored conversation by its id (for `item_reference`)."""
        for stored in reversed(self._items.values()):
            for item in stored.conversation:
                if getattr(item, "id", None) == item_id and not isinstance(item, ItemReference):
                    return item
        return None


def get_store(request: Request) -> ResponseStore:
    app_state = request.app.state
    store = getattr(app_state, "responses_store", None)
    if store is None:
        store = app_state.responses_store = ResponseStore()
    return store


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"Response with id '{response_id}' not found.",
        param=param,
        code="response_not_found",
    )


# --- request -> prompt -----------------------------------------------------------


def reject_unsupported(req: ResponsesRequest) -> None:
    """Fields of the API reference that pippin cannot honour (yet) -> 400 by name."""
    if req.background:
        raise unsupported_value("background", "Background responses are not supported.")
    for name, why in (
        ("background_options", "Background responses are not supported."),
        ("conversation", "Conversations are not available; use 'previous_response_id'."),
        ("prompt", "Reusable prompts are not available."),
        ("context_management", "Context management is not available."),
        ("moderation", "Moderation is not available."),
        ("access_programs", ""),
        ("image", "Image input is not supported by this model."),
    ):
        if getattr(req, name) is not None:
            raise unsupported_param(name, why)
    if req.top_logprobs:
        raise unsupported_value("top_logprobs", "Log probabilities are not available here yet.")
    for j, inc in enumerate(req.include or []):
        if inc not in _EMPTY_INCLUDES:
            raise unsupported_value(f"include[{j}]", f"'{inc}' is not available here yet.")
    if req.reasoning is not None and req.reasoning.mode not in (None, "standard"):
        raise unsupported_value("reasoning.mode", "Only the 'standard' reasoning mode exists here.")
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )


def forced_call(req: ResponsesRequest) -> ForcedTool | None:
    """The call `tool_choice` forces: "required", or a function by name (flat shape)."""
    choice = req.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return forced_tool(choice, "tool_choice")


def structured_spec(req: ResponsesRequest, state: Any, tools: Any) -> GrammarSpec | None:
    """A forced tool call, else `text.format` (json_schema / json_object)."""
    forced = forced_call(req)
    try:
        if forced is not None:
            return forced_tool_grammar(
                tool_parser(state, tools),
                tools or [],
                forced.name,
                parallel=req.parallel_tool_calls is not False,
                vocab=state.grammars,
                param="tool_choice",
            )
        fmt = req.text.format if req.text is not None else None
        return response_format_grammar(
            fmt.model_dump(exclude_none=True) if fmt is not None else None, "text.format"
        )
    except StructuredOutputError as exc:
        raise bad_request(exc.message, param=exc.param, code="invalid_value") from None


def template_tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Function tools in the chat-template shape; built-in tools are refused by name.

    A namespace's tools are shown as plain function tools, under their own names."""
    forced_call(req)  # refuses kinds of tool_choice that cannot be forced
    tools: list[dict[str, Any]] = []
    for j, t in enumerate(req.tools or []):
        p = f"tools[{j}]"
        if isinstance(t, McpTool):
            continue  # run by pippin: see `mcp_tools`
        if isinstance(t, BuiltinTool):
            raise unsupported_value(
                f"{p}.type",
                f"Built-in tool '{t.type}' is not available on this server; "
                "only 'function' tools are.",
            )
        if isinstance(t, NamespaceTool):
            tools.extend(_function_tool(f, f"{p}.tools[{k}]") for k, f in enumerate(t.tools))
        else:
            tools.append(_function_tool(t, p))
    if req.tool_choice == "none":
        return None  # the model will not call any tool: it is not shown any
    return tools or None


def _function_tool(t: FunctionTool, p: str) -> dict[str, Any]:
    if t.defer_loading:
        raise unsupported_param(f"{p}.defer_loading", "There is no tool search.")
    if t.allowed_callers and "programmatic" in t.allowed_callers:
        raise unsupported_value(f"{p}.allowed_callers", "Only 'direct' calls exist here.")
    if t.output_schema is not None:
        raise unsupported_param(f"{p}.output_schema", "There is no programmatic tool calling.")
    fn = t.model_dump(include={"name", "description", "parameters", "strict"}, exclude_none=True)
    return {"type": "function", "function": fn}


def mcp_tools(req: ResponsesRequest, state: Any) -> McpTools | None:
    """The tools of the request's `mcp` tools, which pippin runs (see api/mcp_loop.py)."""
    specs = [(t, f"tools[{j}]") for j, t in enumerate(req.tools or []) if isinstance(t, McpTool)]
    if not specs or req.tool_choice == "none":
        return None
    return openai_mcp_tools(state, specs, approvals=True)


def _listed_tool(info: Any) -> dict[str, Any]:
    return {
        "name": info.name,
        "description": info.description,
        "input_schema": info.input_schema,
        "annotations": info.annotations,
    }


def echo_tools(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's tools as the response object lists them."""
    out: list[dict[str, Any]] = []
    for t in req.tools or []:
        if isinstance(t, NamespaceTool | McpTool):
            out.append(t.model_dump(exclude_none=True))
        elif isinstance(t, FunctionTool):
            out.append(
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                    "strict": t.strict,
                }
            )
    return out


def _text(content: str | list[Any], param: str) -> str:
    """Text of a message's content or a call's output; non-text parts are refused."""
    out = _content(content, param, None)
    assert isinstance(out, str)
    return out


def _content(
    content: str | list[Any], param: str, media: MediaParts | None
) -> str | list[dict[str, Any]]:
    """A message's content for the template: text, or (with `input_image` parts, which
    `media` collects) a list of text and image parts."""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text"):
            texts.append(part.text)
            parts.append({"type": "text", "text": part.text})
        elif part.type == "refusal":
            texts.append(part.refusal)
            parts.append({"type": "text", "text": part.refusal})
        elif part.type == "input_image" and media is not None:
            if part.image_url is None:
                raise unsupported_value(
                    f"{param}[{j}].file_id", "Files are not available; send 'image_url'."
                )
            parts.append(media.image(part.image_url, f"{param}[{j}]", part.detail))
        else:
            kind = {"input_image": "Image", "input_file": "File", "input_audio": "Audio"}[part.type]
            raise unsupported_value(
                f"{param}[{j}]",
                f"{kind} input ('{part.type}' content parts) is not supported by this model.",
            )
    if len(parts) > len(texts):
        return parts
    return "\n".join(texts)


def _reasoning_text(item: ReasoningItem, param: str) -> str:
    if item.encrypted_content is not None:
        raise unsupported_value(
            f"{param}.encrypted_content", "Encrypted reasoning from another server cannot be read."
        )
    parts = item.content or item.summary
    return "\n".join(p.text for p in parts)


def resolve_items(
    items: Sequence[Any], store: ResponseStore, param: str = "input"
) -> list[tuple[Any, str]]:
    """Input items with references resolved, each with its `param` path for errors."""
    out: list[tuple[Any, str]] = []
    for i, item in enumerate(items):
        p = f"{param}[{i}]"
        if isinstance(item, OtherItem):
            raise unsupported_value(
                f"{p}.type", f"'{item.type}' items are not supported: no built-in tools run here."
            )
        if isinstance(item, ItemReference):
            found = store.find_item(item.id)
            if found is None:
                raise bad_request(
                    f"Item with id '{item.id}' not found in any stored response.",
                    param=f"{p}.id",
                    code="item_not_found",
                )
            item = found
        out.append((item, p))
    return out


@dataclass
class _Messages:
    """Input items -> the plain message dicts Hugging Face chat templates take."""

    out: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None  # for the next assistant message
    names: dict[str, str] = field(default_factory=dict)  # call_id -> function name
    # MCP approvals: the requests by id, those approved, and those already run.
    requests: dict[str, McpApprovalRequestItem] = field(default_factory=dict)
    approved: list[McpApprovalRequestItem] = field(default_factory=list)
    answered: set[str] = field(default_factory=set)
    listed: set[str] = field(default_factory=set)  # server labels with an mcp_list_tools
    media: MediaParts = field(default_factory=MediaParts)  # the user messages' images

    def pending(self) -> list[McpCall]:
        """Approved calls not run yet: the loop runs them before the model's turn."""
        return [
            McpCall(r.id, r.server_label, r.name, r.arguments, approval_request_id=r.id)
            for r in self.approved
            if r.id not in self.answered
        ]

    def _call(self, call_id: str, name: str, arguments: str, result: str) -> None:
        last = self.out[-1] if self.out else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.out.append(last)
        self._take_reasoning(last)
        call = {"name": name, "arguments": arguments_for_template(arguments)}
        last.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function", "function": call}
        )
        self.out.append({"role": "tool", "content": result, "tool_call_id": call_id, "name": name})

    def add_mcp(self, item: Any, p: str) -> None:
        if isinstance(item, McpListToolsItem):
            self.listed.add(item.server_label)
        elif isinstance(item, McpCallItem):
            if item.approval_request_id is not None:
                self.answered.add(item.approval_request_id)
            if item.output is not None:
                result = item.output
            else:
                err = item.error
                text = err.get("message") or json.dumps(err) if isinstance(err, dict) else err
                result = f"Error: {text or 'the call failed'}"
            self._call(item.id, item.name, item.arguments, result)
        elif isinstance(item, McpApprovalRequestItem):
            self.requests[item.id] = item
        else:
            assert isinstance(item, McpApprovalResponseItem)
            req = self.requests.get(item.approval_request_id)
            if req is None:
                raise bad_request(
                    f"No mcp_approval_request with id '{item.approval_request_id}' precedes "
                    "this response.",
                    param=f"{p}.approval_request_id",
                )
            if item.approve:
                self.approved.append(req)
            else:
                why = f" ({item.reason})" if item.reason else ""
                self._call(req.id, req.name, req.arguments, f"The user declined this call{why}.")
                self.answered.add(req.id)

    def add(self, item: Any, p: str) -> None:
        if isinstance(
            item, McpListToolsItem | McpCallItem | McpApprovalRequestItem | McpApprovalResponseItem
        ):
            self.add_mcp(item, p)
        elif isinstance(item, ReasoningItem):
            self.reasoning = _reasoning_text(item, p) or None
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            media = self.media if role == "user" else None
            msg = {"role": role, "content": _content(item.content, f"{p}.content", media)}
            if role == "assistant":
                self._take_reasoning(msg)
            else:
                self.reasoning = None
            self.out.append(msg)
        elif isinstance(item, FunctionCallItem):
            self.names[item.call_id] = item.name
            last = self.out[-1] if self.out else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                self.out.append(last)
            self._take_reasoning(last)
            call = {"name": item.name, "arguments": arguments_for_template(item.arguments)}
            last.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": call}
            )
        else:
            assert isinstance(item, FunctionCallOutputItem)
            msg = {
                "role": "tool",
                "content": _text(item.output, f"{p}.output"),
                "tool_call_id": item.call_id,
            }
            name = item.name or self.names.get(item.call_id)
            if name:
                msg["name"] = name
            self.out.append(msg)

    def _take_reasoning(self, msg: dict[str, Any]) -> None:
        if self.reasoning is not None and "reasoning_content" not in msg:
            msg["reasoning_content"] = self.reasoning
        self.reasoning = None


def template_messages(instructions: str | None, items: Sequence[tuple[Any, str]]) -> _Messages:
    conv = _Messages()
    if instructions:
        conv.out.append({"role": "system", "content": instructions})
    for item, p in items:
        conv.add(item, p)
    return conv


def template_kwargs(req: ResponsesRequest, defaults: dict[str, Any], state: Any) -> dict[str, Any]:
    """The chat template's arguments: reasoning effort and verbosity, as the model takes them."""
    kwargs = dict(defaults)
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        kwargs |= effort_kwargs(effort, state.template.reasoning_kwarg, "reasoning.effort")
    verbosity = req.text.verbosity if req.text is not None else None
    return kwargs | verbosity_kwargs(verbosity, state.template_source, "text.verbosity")


# --- parsed deltas -> output items and events --------------------------------------


@dataclass
class _Open:
    kind: str  # "reasoning", "message" or "function_call"
    index: int  # output_index
    item: dict[str, Any]
    text: str = ""


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class _Output:
    """Output items built from parsed deltas, and the stream events that build them.

    Whitespace that would open an item is held back until something else follows, so
    the blank line between a model's thinking and its tool call makes no empty message.
    """

    def __init__(self, loop: ToolLoop | None = None) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: _Open | None = None
        self.held: tuple[str, str] | None = None  # (kind, whitespace)
        self.calls: dict[int, dict[str, Any]] = {}  # parser call index -> item
        self.loop = loop  # tells MCP calls (and those to approve) from the client's
        self.mcp: dict[str, dict[str, Any]] = {}  # call id -> mcp_call item

    def feed(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if parsed.reasoning:
            events += self._text("reasoning", parsed.reasoning)
        if parsed.content:
            events += self._text("message", parsed.content)
        for c in parsed.calls:
            events += self._call(c)
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """Close the open item (its status: completed or incomplete)."""
        self.held = None
        o, self.open = self.open, None
        if o is None:
            return []
        item, index, item_id = o.item, o.index, o.item["id"]
        item["status"] = status
        where = {"item_id": item_id, "output_index": index}
        events: list[dict[str, Any]]
        if o.kind == "function_call":
            item["arguments"] = o.text
            events = [
                {"type": "response.function_call_arguments.done", **where, "arguments": o.text}
            ]
        elif o.kind == "mcp_call":
            item["arguments"] = o.text
            item["status"] = "in_progress" if status == "completed" else status
            events = [{"type": "response.mcp_call_arguments.done", **where, "arguments": o.text}]
            if status == "completed":
                return events  # done once the call has run (`call_finished`)
        elif o.kind == "mcp_approval_request":
            item["arguments"] = o.text
            del item["status"]
            events = []
        else:
            part = _part(o.kind, o.text)
            item["content"] = [part]
            done: dict[str, Any] = {"type": "", **where, "content_index": 0, "text": o.text}
            if o.kind == "reasoning":
                done["type"] = "response.reasoning_text.done"
            else:
                done["type"] = "response.output_text.done"
                done["logprobs"] = []
            events = [
                done,
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]
        events.append(
            {
                "type": "response.output_item.done",
                "output_index": index,
                "item": copy.deepcopy(item),
            }
        )
        return events

    def _start(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close("completed")
        index = len(self.items)
        self.items.append(item)
        self.open = _Open(kind, index, item)
        events.append(
            {
                "type": "response.output_item.added",
                "output_index": index,
                "item": copy.deepcopy(item),
            }
        )
        if kind in ("message", "reasoning"):
            events.append(
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "part": _part(kind, ""),
                }
            )
        return events

    def _delta(self, text: str) -> dict[str, Any]:
        o = self.open
        assert o is not None
        o.text += text
        where = {"item_id": o.item["id"], "output_index": o.index}
        if o.kind == "function_call":
            return {"type": "response.function_call_arguments.delta", **where, "delta": text}
        if o.kind == "mcp_call":
            return {"type": "response.mcp_call_arguments.delta", **where, "delta": text}
        if o.kind == "reasoning":
            return {
                "type": "response.reasoning_text.delta",
                **where,
                "content_index": 0,
                "delta": text,
            }
        return {
            "type": "response.output_text.delta",
            **where,
            "content_index": 0,
            "delta": text,
            "logprobs": [],
        }

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        if self.open is not None and self.open.kind == kind:
            return [self._delta(text)]
        if self.held is not None and self.held[0] == kind:
            text = self.held[1] + text
        if not text.strip():
            self.held = (kind, text)
            return []
        self.held = None
        if kind == "reasoning":
            item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": []}
        else:
            item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "content": []}
        item["status"] = "in_progress"
        events = self._start(kind, item)
        events.append(self._delta(text))
        return events

    def _call(self, c: CallDelta) -> list[dict[str, Any]]:
        if c.name is None:  # more of a call's arguments
            o = self.open
            if o is not None and o.item is self.calls.get(c.index):
                if o.kind == "mcp_approval_request":
                    o.text += c.arguments  # the item comes whole: no delta events
                    return []
                return [self._delta(c.arguments)]
            self.calls[c.index]["arguments"] += c.arguments  # never seen: calls come in order
            return []
        self.held = None
        call_id = c.id or random_call_id()
        loop = self.loop
        kind = "function_call"
        item: dict[str, Any]
        if loop is not None and loop.tools is not None and loop.owns(c.name):
            label = loop.tools.label(c.name)
            if loop.needs_approval(c.name):
                # Its id is what the client's mcp_approval_response names.
                kind = "mcp_approval_request"
                item = {"id": call_id, "type": kind, "server_label": label, "name": c.name}
            else:
                kind = "mcp_call"
                item = {"id": _new_id("mcp"), "type": kind, "server_label": label, "name": c.name}
                item |= {"output": None, "error": None}
                self.mcp[call_id] = item
            item |= {"arguments": "", "status": "in_progress"}
        else:
            item = {
                "id": _new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "arguments": "",
                "call_id": call_id,
                "name": c.name,
            }
        self.calls[c.index] = item
        events = self._start(kind, item)
        if c.arguments:
            events += self._call(CallDelta(c.index, arguments=c.arguments))
        return events

    # MCP: the tools listed, and each call as pippin runs it.

    def list_tools(self, label: str, tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = self.close("completed")
        index = len(self.items)
        item = {"id": _new_id("mcpl"), "type": "mcp_list_tools", "server_label": label}
        where = {"item_id": item["id"], "output_index": index}
        added = {"type": "response.output_item.added", "output_index": index}
        added["item"] = {**item, "tools": []}
        item["tools"] = tools
        self.items.append(item)
        return [
            *events,
            added,
            {"type": "response.mcp_list_tools.in_progress", **where},
            {"type": "response.mcp_list_tools.completed", **where},
            {
                "type": "response.output_item.done",
                "output_index": index,
                "item": copy.deepcopy(item),
            },
        ]

    def call_started(self, call: McpCall) -> list[dict[str, Any]]:
        events = self.close("completed")
        self.calls = {}  # the next turn numbers its calls anew
        item = self.mcp.get(call.id)
        if item is None:  # an approved call, run before the model's turn
            item = {"id": _new_id("mcp"), "type": "mcp_call", "server_label": call.label}
            item |= {"name": call.name, "arguments": call.arguments, "output": None}
            item |= {"error": None, "approval_request_id": call.approval_request_id}
            item["status"] = "in_progress"
            self.mcp[call.id] = item
            self.items.append(item)
            events.append(
                {
                    "type": "response.output_item.added",
                    "output_index": len(self.items) - 1,
                    "item": copy.deepcopy(item),
                }
            )
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        events.append({"type": "response.mcp_call.in_progress", **where})
        return events

    def call_finished(self, call: McpCall) -> list[dict[str, Any]]:
        item = self.mcp[call.id]
        result = call.result
        assert result is not None
        if result.is_error:
            item["error"], item["status"] = error_body(result), "failed"
        else:
            item["output"], item["status"] = result.output, "completed"
        index = self.items.index(item)
        where = {"item_id": item["id"], "output_index": index}
        kind = "failed" if result.is_error else "completed"
        return [
            {"type": f"response.mcp_call.{kind}", **where},
            {
                "type": "response.output_item.done",
                "output_index": index,
                "item": copy.deepcopy(item),
            },
        ]


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
    """One validated request: runs it and answers it, streamed or whole."""

    engine: EngineClient
    prompt_ids: list[int]
    params: SamplingParams
    new_parser: NewParser
    # The response object's fields that echo the request.
    echo: dict[str, Any]
    # The conversation before this response's output (stored with it when asked to).
    conversation: list[Any]
    store: ResponseStore | None
    obfuscate: bool = False
    id: str = field(default_factory=lambda: _new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))
    usage: dict[str, Any] | None = None
    output: _Output | None = None
    # With MCP tools: the tool loop, and the (server label, tools) to list first.
    loop: ToolLoop | None = None
    list_tools: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)

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
        loop = self.loop or ToolLoop(
            self.engine,
            self.id,
            [],
            Turn(self.prompt_ids, self.params, self.new_parser),
            None,
        )
        out = self.output = _Output(loop)
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

    async def stream(self) -> AsyncIterator[str]:
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

        try:
            async for event in self.events():
                yield frame(event)
        except Exception as exc:
            yield frame({"type": "response.failed", "response": self._failed(exc)})

    def _failed(self, exc: Exception) -> dict[str, Any]:
        if isinstance(exc, EngineError):
            exc = server_error(f"The engine could not take this request: {exc}", "engine_error")
        if not isinstance(exc, ApiError):
            exc = server_error(f"Internal server error ({type(exc).__name__}).")
        return self.body("failed", error={"code": "server_error", "message": exc.message})


# --- routes ------------------------------------------------------------------------


def _conversation(
    req: ResponsesRequest, store: ResponseStore
) -> tuple[list[tuple[Any, str]], list[Any]]:
    """(each item of the conversation with its param path for errors, this request's
    items); the earlier conversation comes from `previous_response_id`."""
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
    return [*earlier, *new], [item for item, _ in new]


def _echo(req: ResponsesRequest, state: Any) -> dict[str, Any]:
    def pick(name: str) -> Any:
        value = getattr(req, name)
        return state.defaults.get(name) if value is None else value

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


def _max_tokens(req: ResponsesRequest, prompt_len: int, state: Any) -> int:
    try:
        return resolve_max_tokens(
            req.max_output_tokens,
            prompt_len,
            state.limits,
            state.defaults.get("max_tokens"),
            None,
            "input",
            "max_output_tokens",
        )
    except ApiError as exc:
        if exc.code == "context_length_exceeded" and req.truncation == "auto":
            raise unsupported_value(
                "truncation",
                f"{exc.message} Dropping input items to make it fit ('truncation': 'auto') "
                "is not supported yet.",
            ) from None
        raise


@router.post("/v1/responses", response_model=None, **openai_route(ResponsesRequest, stream=True))
async def create_response(request: Request) -> Any:
    req = await parse_request(ResponsesRequest, await request.body())
    state = get_state(request)
    check_model(state, req.model)
    # Everything that can be refused without the model is refused first.
    reject_unsupported(req)
    tools = template_tools(req)
    client_tools = tools
    mcp = mcp_tools(req, state)
    if mcp is not None:
        mcp.check_clash(tools, "tools")
        tools = [*(tools or []), *mcp.functions()] or None
    store = get_store(request)
    conversation, items = _conversation(req, store)
    conv = template_messages(req.instructions, conversation)
    messages = conv.out
    pending = conv.pending()
    if pending and mcp is None:
        raise bad_request(
            "Approved MCP calls run with the request's 'mcp' tools; name their server in 'tools'.",
            param="tools",
        )
    if not messages:
        raise bad_request("Missing required parameter: 'input'.", param="input")
    state = await use_model(state, req.model)
    engine, loaded = require_engine(state)
    assert state.template is not None and state.limits is not None
    kwargs = template_kwargs(req, state.settings.default_chat_template_kwargs, state)
    prompt_ids, mm = await render_media_prompt(
        state, loaded.tokenizer, messages, tools, kwargs, conv.media, messages_param="input"
    )
    sampling = SamplingFields(model=req.model, temperature=req.temperature, top_p=req.top_p)
    params = build_sampling_params(
        sampling,
        max_tokens=_max_tokens(req, len(prompt_ids), state),
        limits=state.limits,
        defaults=state.defaults,
        logprobs=False,
        top_logprobs=0,
    )
    params.mm = mm
    new_parser, params = await output_parsing(
        state,
        loaded.tokenizer,
        prompt_ids,
        params,
        tools,
        spec=structured_spec(req, state, tools),
        one_call=req.parallel_tool_calls is False,
    )
    try:
        engine.check(prompt_ids, params)
    except EngineError as exc:
        raise bad_request(str(exc), param="input") from None
    run = ResponseRun(
        engine=engine,
        prompt_ids=prompt_ids,
        params=params,
        new_parser=new_parser,
        echo=_echo(req, state),
        conversation=[item for item, _ in conversation],
        store=store if req.store is not False else None,
        obfuscate=bool(req.stream_options and req.stream_options.include_obfuscation),
    )
    if mcp is not None:
        run.loop = request_loop(
            state,
            engine,
            loaded.tokenizer,
            run.id,
            messages,
            Turn(prompt_ids, params, new_parser),
            client_tools,
            mcp,
            kwargs,
            max_calls=req.max_tool_calls,
            pending=pending,
            one_call=req.parallel_tool_calls is False,
            messages_param="input",
            media=conv.media,
        )
        # As OpenAI: a server's tools are listed once in a conversation.
        run.list_tools = [
            (label, [_listed_tool(t) for t in mcp.listed(label)])
            for label in mcp.servers
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
    stored = get_store(request).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored.body


@router.delete("/v1/responses/{response_id}", **openai_route())
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    if not get_store(request).delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
