"""A Responses request -> the chat job's parts: fields refused by name, the tools (function,
MCP, forced calls and the output grammar), the input items (and those of the response it
continues) as template messages (`Conversation`), and the template's arguments."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

from pippin.api.openai.mcp import openai_mcp_tools
from pippin.api.openai.responses_protocol import (
    BuiltinTool,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    Includable,
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
from pippin.api.openai.responses_store import ResponseStore
from pippin.api.openai.structured_output import ForcedTool, forced_tool
from pippin.serving.errors import (
    bad_request,
    unsupported_param,
    unsupported_value,
)
from pippin.serving.live_model import LiveModel
from pippin.serving.media import MediaParts
from pippin.serving.pipeline import (
    arguments_for_template,
    effort_kwargs,
    tool_parser,
    verbosity_kwargs,
)
from pippin.serving.state import ServerState
from pippin.serving.tool_loop import (
    McpCall,
    McpTools,
)
from pippin.structured.formats import response_format_grammar
from pippin.structured.spec import GrammarSpec, StructuredOutputError
from pippin.structured.tool_calls import forced_tool_grammar

# --- request -> prompt -----------------------------------------------------------


# `include` values that name outputs pippin never produces (so they are always empty):
# all that the API defines but the output's logprobs.
_EMPTY_INCLUDES = frozenset(get_args(Includable)) - {"message.output_text.logprobs"}


def check_includes(include: list[str]) -> None:
    """`include` values pippin cannot produce -> 400 naming the value."""
    for j, inc in enumerate(include):
        if inc not in _EMPTY_INCLUDES:
            raise unsupported_value(f"include[{j}]", f"'{inc}' is not available here yet.")


def current_turn_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`reasoning.context: current_turn`: the reasoning of turns before the last user
    message is left out (that of the current turn's tool calls stays)."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    return [
        {k: v for k, v in m.items() if k != "reasoning_content"} if i < last_user else m
        for i, m in enumerate(messages)
    ]


def reject_unsupported(req: ResponsesRequest) -> None:
    """Fields of the API reference that pippin cannot honour (yet) -> 400 by name."""
    if req.background and req.store is False:
        # As OpenAI: a background response is polled, so it must be stored.
        raise bad_request(
            "Background responses must be stored: 'background': true cannot be used with "
            "'store': false.",
            param="background",
            code="invalid_value",
        )
    for name, why in (
        ("background_options", "Background options are not supported."),
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
    check_includes(req.include or [])
    cache = req.prompt_cache_options
    if cache is not None and cache.prewarm:
        raise unsupported_value(
            "prompt_cache_options.prewarm",
            "Prewarming without an answer is not available; send the request itself (its "
            "prefix is cached for the next one).",
        )
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


def structured_spec(
    req: ResponsesRequest, live: LiveModel, tools: list[dict[str, Any]] | None
) -> GrammarSpec | None:
    """A forced tool call, else `text.format` (json_schema / json_object)."""
    forced = forced_call(req)
    try:
        if forced is not None:
            return forced_tool_grammar(
                tool_parser(live, tools),
                tools or [],
                forced.name,
                parallel=req.parallel_tool_calls is not False,
                vocab=live.grammars,
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


def mcp_tools(req: ResponsesRequest, state: ServerState) -> McpTools | None:
    """The tools of the request's `mcp` tools, which pippin runs (see api/mcp_loop.py)."""
    specs = [(t, f"tools[{j}]") for j, t in enumerate(req.tools or []) if isinstance(t, McpTool)]
    if not specs or req.tool_choice == "none":
        return None
    return openai_mcp_tools(state, specs, approvals=True)


def listed_tool(info: Any) -> dict[str, Any]:
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
class Conversation:
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


def template_messages(instructions: str | None, items: Sequence[tuple[Any, str]]) -> Conversation:
    conv = Conversation()
    if instructions:
        conv.out.append({"role": "system", "content": instructions})
    for item, p in items:
        conv.add(item, p)
    return conv


def template_kwargs(req: ResponsesRequest, live: LiveModel) -> dict[str, Any]:
    """The chat template's arguments: reasoning effort and verbosity, as the model takes them."""
    kwargs: dict[str, Any] = {}
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        assert live.template is not None
        kwargs |= effort_kwargs(effort, live.template.reasoning_kwarg, "reasoning.effort")
    verbosity = req.text.verbosity if req.text is not None else None
    return kwargs | verbosity_kwargs(verbosity, live.template_source, "text.verbosity")
