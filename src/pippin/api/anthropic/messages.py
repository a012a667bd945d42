"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

Requests become template messages and tools for the model's own chat template, run
through the shared chat pipeline, and come back as content blocks (thinking, text,
tool_use), streamed with Anthropic's event grammar. Any `claude-*` model name is
served by the loaded model, so Claude Code works without configuration.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pippin.api.anthropic.protocol import (
    ClearThinking,
    ClearToolUses,
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    InputMessage,
    McpToolResultBlock,
    McpToolUseBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    ServerTool,
    TextBlock,
    ThinkingBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    Tool,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from pippin.api.common import SSE_HEADERS, cancel_on_disconnect, parse_request, typed_sse
from pippin.api.errors import anthropic_body
from pippin.api.openapi import anthropic_route
from pippin.chat.tool_parsers.base import ParsedDelta
from pippin.engine.client import EngineError
from pippin.engine.types import SamplingParams
from pippin.serving.admission import salted
from pippin.serving.errors import ApiError, bad_request
from pippin.serving.media import MediaParts
from pippin.serving.pipeline import (
    NewParser,
    ParsedStep,
    output_parsing,
    render_media_prompt,
    tool_parser,
)
from pippin.serving.state import check_model, get_state, require_engine, use_model
from pippin.serving.streams import closing, guarded
from pippin.serving.tool_loop import (
    CallFinished,
    CallStarted,
    McpCall,
    McpTools,
    ToolLoop,
    Turn,
    anthropic_mcp_tools,
    request_loop,
)
from pippin.structured.formats import response_format_grammar
from pippin.structured.spec import GrammarSpec, StructuredOutputError
from pippin.structured.tool_calls import forced_tool_grammar

if TYPE_CHECKING:
    from pippin.serving.live_model import LiveModel as ServerState

router = APIRouter()

# Signs thinking blocks so a client can hand them back; nothing checks them on input.
_SIGNING_KEY = secrets.token_bytes(32)
PING_SECONDS = 5.0
# message_start waits this long for the engine's first step, to report cached tokens.
_START_WAIT = 1.0


def _error(message: str, param: str, status: int = 400) -> ApiError:
    return ApiError(status, message, param=param)


# --- request -> prompt -------------------------------------------------------


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n\n".join(b.text for b in system)


def _document_text(block: DocumentBlock, param: str) -> str:
    src = block.source
    if src.get("type") == "text" and isinstance(src.get("data"), str):
        body = src["data"]
    elif src.get("type") == "content" and isinstance(src.get("content"), list | str):
        content = src["content"]
        parts = [content] if isinstance(content, str) else content
        body = "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in parts)
    else:
        raise _error(
            f"{param}.source: only text documents ('text' or 'content' sources) are "
            "supported by this model.",
            f"{param}.source",
        )
    head = "\n".join(x for x in (block.title, block.context) if x)
    return f"{head}\n\n{body}" if head else body


def _image(block: ImageBlock, param: str, media: MediaParts | None) -> dict[str, Any]:
    """An image block's placeholder part (its picture collected in `media`)."""
    if media is None:
        raise _error("This model does not accept images.", param)
    src = block.source
    kind = src.get("type")
    if kind == "base64" and isinstance(src.get("data"), str):
        media_type = src.get("media_type")
        return media.base64(src["data"], media_type if isinstance(media_type, str) else None, param)
    if kind == "url" and isinstance(src.get("url"), str):
        return media.image(src["url"], param)
    raise _error(
        f"{param}.source: images are accepted as 'base64' or 'url' sources.", f"{param}.source"
    )


def _tool_result_text(
    block: ToolResultBlock, param: str, media: MediaParts | None = None
) -> str | list[dict[str, Any]]:
    """A tool result's content: text, or (with images) a list of text and image parts."""
    content = block.content
    prefix = "Error: " if block.is_error else ""
    if content is None:
        return prefix
    if isinstance(content, str):
        return prefix + content
    texts = []
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, TextBlock):
            texts.append(part.text)
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, DocumentBlock):
            texts.append(_document_text(part, f"{param}.content[{j}]"))
            parts.append({"type": "text", "text": texts[-1]})
        elif isinstance(part, ToolReferenceBlock):
            # The tool itself joins the tools the template shows (see `template_tools`).
            texts.append(f"The tool {part.tool_name} is now available.")
            parts.append({"type": "text", "text": texts[-1]})
        else:
            parts.append(_image(part, f"{param}.content[{j}]", media))
    if len(parts) > len(texts):
        return ([{"type": "text", "text": prefix}] if prefix else []) + parts
    return prefix + "\n".join(texts)


def template_messages(
    system: str | list[TextBlock] | None, messages: list[Any], media: MediaParts | None = None
) -> list[dict[str, Any]]:
    """Anthropic messages -> the plain dicts Hugging Face chat templates take; images in
    user turns and tool results are collected in `media` (refused without it)."""
    out: list[dict[str, Any]] = []
    sys_parts = [_system_text(system)]
    pending: list[str] = []  # system messages met mid-conversation
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        if m.role == "system":
            text = m.content if isinstance(m.content, str) else _texts(m.content, p)
            # Before the first turn they extend the system prompt; later ones go with the
            # next user turn, since most templates only take a system message first.
            (pending if out else sys_parts).append(text)
            continue
        turn: list[dict[str, Any]]
        if isinstance(m.content, str):
            turn = [{"role": m.role, "content": m.content}]
        elif m.role == "user":
            turn = _user_turn(m.content, p, media)
        else:
            turn = _assistant_turn(m.content, p)
        if pending and m.role == "user":
            _prepend_user(turn, "\n\n".join(pending))
            pending = []
        out.extend(turn)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    sys_text = "\n\n".join(t for t in sys_parts if t)
    return ([{"role": "system", "content": sys_text}] if sys_text else []) + out


def _texts(blocks: list[Any], p: str) -> str:
    texts = []
    for j, b in enumerate(blocks):
        if not isinstance(b, TextBlock):
            raise _error("System messages may only hold text blocks.", f"{p}.content[{j}]")
        texts.append(b.text)
    return "\n\n".join(texts)


def _prepend_user(turn: list[dict[str, Any]], text: str) -> None:
    for msg in turn:
        if msg["role"] == "user":
            if isinstance(msg["content"], list):
                msg["content"] = [{"type": "text", "text": f"{text}\n\n"}, *msg["content"]]
            else:
                msg["content"] = f"{text}\n\n{msg['content']}"
            return
    turn.append({"role": "user", "content": text})


def _user_turn(blocks: list[Any], p: str, media: MediaParts | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # texts and images, when there are images

    def flush() -> None:
        if parts:
            out.append({"role": "user", "content": list(parts)})
        elif texts:
            out.append({"role": "user", "content": "\n\n".join(texts)})
        texts.clear()
        parts.clear()

    for j, b in enumerate(blocks):
        param = f"{p}.content[{j}]"
        if isinstance(b, TextBlock | DocumentBlock):
            text = b.text if isinstance(b, TextBlock) else _document_text(b, param)
            if parts:  # blank lines between texts, none around images
                after_text = parts[-1]["type"] == "text"
                parts.append({"type": "text", "text": ("\n\n" if after_text else "") + text})
            texts.append(text)
        elif isinstance(b, ImageBlock):
            if not parts and texts:  # the texts so far, then the image
                parts.append({"type": "text", "text": "\n\n".join(texts)})
            parts.append(_image(b, param, media))
        elif isinstance(b, ToolResultBlock):
            flush()  # tool results answer the previous turn: they come first
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b.tool_use_id,
                    "content": _tool_result_text(b, param, media),
                }
            )
        else:
            raise _error(f"'{b.type}' blocks may only appear in assistant messages.", param)
    flush()
    return out


def _assistant_turn(blocks: list[Any], p: str) -> list[dict[str, Any]]:
    """An assistant turn; the results of the MCP calls pippin made inside it
    (`mcp_tool_result` blocks) become tool messages between its parts."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []

    def flush() -> None:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if thoughts:
            msg["reasoning_content"] = "\n".join(thoughts)
        if calls:
            msg["tool_calls"] = list(calls)
        out.append(msg)
        texts.clear()
        thoughts.clear()
        calls.clear()

    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            texts.append(b.text)
        elif isinstance(b, ThinkingBlock):
            thoughts.append(b.thinking)
        elif isinstance(b, RedactedThinkingBlock):
            continue  # opaque to us: nothing to show the model
        elif isinstance(b, ToolUseBlock | McpToolUseBlock):
            calls.append(
                {
                    "id": b.id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": b.input},
                }
            )
        elif isinstance(b, McpToolResultBlock):
            if calls or texts or thoughts:
                flush()
            content = b.content
            text = content if isinstance(content, str) else "\n".join(t.text for t in content or [])
            if b.is_error:
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": text})
        else:
            raise _error(
                f"'{b.type}' blocks may only appear in user messages.", f"{p}.content[{j}]"
            )
    if texts or thoughts or calls or not out:
        flush()
    return out


def _loaded_tools(req: MessagesRequest | CountTokensRequest) -> set[str]:
    """The tools that tool results' `tool_reference` blocks load (a client-side tool
    search's answers); each must name one of the request's tools."""
    names = {t.name for t in req.tools or [] if isinstance(t, Tool)}
    loaded: set[str] = set()
    for i, m in enumerate(req.messages):
        for j, b in enumerate(m.content if isinstance(m.content, list) else []):
            if not isinstance(b, ToolResultBlock) or not isinstance(b.content, list):
                continue
            for k, part in enumerate(b.content):
                if isinstance(part, ToolReferenceBlock):
                    if part.tool_name not in names:
                        param = f"messages[{i}].content[{j}].content[{k}].tool_name"
                        raise _error(
                            f"{param}: the tool reference '{part.tool_name}' names none of "
                            "the request's tools.",
                            param,
                        )
                    loaded.add(part.tool_name)
    return loaded


def template_tools(req: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]] | None:
    """The client tools the model is shown: all but the deferred ones (`defer_loading`)
    that no `tool_reference` has loaded yet, in the request's order."""
    loaded = _loaded_tools(req)
    tools: list[dict[str, Any]] = []
    for j, t in enumerate(req.tools or []):
        if isinstance(t, ServerTool) and t.type == "mcp_toolset":
            continue  # chooses MCP tools: see `mcp_tools`
        if isinstance(t, ServerTool):
            raise _error(
                f"tools[{j}]: the server tool '{t.type}' is not available here; "
                "define it as a client tool with an input_schema.",
                f"tools[{j}].type",
            )
        if t.defer_loading and t.name not in loaded:
            continue
        fn: dict[str, Any] = {"name": t.name, "parameters": t.input_schema}
        if t.description:
            fn["description"] = t.description
        if t.strict:
            fn["strict"] = True  # a forced call's grammar then closes the schema's objects
        tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise _error("tool_choice.name is required with type 'tool'.", "tool_choice.name")
        if choice.type != "tool" and choice.name is not None:
            raise _error("tool_choice.name is only allowed with type 'tool'.", "tool_choice.name")
        if choice.type == "none":
            return None
    return tools or None


def structured_spec(
    state: ServerState, req: MessagesRequest, tools: list[dict[str, Any]] | None
) -> GrammarSpec | None:
    """A forced tool call (`tool_choice` any / tool), else `output_config.format`."""
    choice = req.tool_choice
    fmt = req.output_config.format if req.output_config is not None else None
    try:
        if choice is not None and choice.type in ("any", "tool"):
            return forced_tool_grammar(
                tool_parser(state, tools),
                tools or [],
                choice.name,
                parallel=not choice.disable_parallel_tool_use,
                vocab=state.grammars,
                param="tool_choice",
            )
        if fmt is None:
            return None
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise StructuredOutputError(
                "output_config.format", "output_config.format must be a json_schema with a schema."
            )
        extra = sorted(set(fmt) - {"type", "schema"})
        if extra:
            raise StructuredOutputError(
                f"output_config.format.{extra[0]}",
                f"output_config.format.{extra[0]}: Extra inputs are not permitted",
            )
        # Anthropic's structured outputs are strict: the schema is the contract.
        openai_fmt = {"type": "json_schema", "name": "output", "schema": fmt["schema"]}
        return response_format_grammar(openai_fmt | {"strict": True}, "output_config.format")
    except StructuredOutputError as exc:
        raise _error(exc.message, exc.param) from None


def mcp_tools(state: Any, req: MessagesRequest | CountTokensRequest) -> McpTools | None:
    """The tools of the request's `mcp_servers`, which pippin runs (see api/mcp_loop.py).
    ``state``: the server's (`pippin.serving.state.ServerState`), which holds the MCP manager."""
    toolsets = [
        (t, f"tools[{j}]")
        for j, t in enumerate(req.tools or [])
        if isinstance(t, ServerTool) and t.type == "mcp_toolset"
    ]
    if not req.mcp_servers:
        if toolsets:
            raise _error("mcp_toolset tools need mcp_servers.", f"{toolsets[0][1]}.type")
        return None
    if req.tool_choice is not None and req.tool_choice.type == "none":
        return None
    return anthropic_mcp_tools(state, req.mcp_servers, toolsets)


def reject_unsupported(req: MessagesRequest | CountTokensRequest) -> None:
    for name in ("output_format",):
        if getattr(req, name) is not None:
            raise _error(f"{name}: not supported by this server.", name)

    if isinstance(req, MessagesRequest) and req.container is not None:
        raise _error("container: not supported by this server.", "container")


def template_kwargs(
    state: ServerState, req: MessagesRequest | CountTokensRequest
) -> dict[str, Any]:
    kwargs = dict(state.settings.default_chat_template_kwargs)
    thinking = req.thinking
    effort = req.output_config.effort if req.output_config else None
    if thinking is None and effort is None:
        return kwargs
    info = state.template
    assert info is not None
    on = thinking is None or not isinstance(thinking, ThinkingDisabled)
    if info.reasoning_kwarg == "enable_thinking":
        kwargs["enable_thinking"] = on
    elif info.reasoning_kwarg == "reasoning_effort":
        kwargs["reasoning_effort"] = (effort or "high") if on else "low"
    # A model without a thinking mode answers without thinking, as the hosted API does
    # for a model that cannot think (Claude Code sends `thinking` on every request).
    return kwargs


@dataclass
class Prompt:
    ids: list[int]
    tools: list[dict[str, Any]] | None
    # What context management did, as the response reports it (None: not asked for),
    # and the prompt's length before it.
    applied_edits: list[dict[str, Any]] | None = None
    original_tokens: int = 0
    # What the MCP loop's later turns need: the template messages, the client's own tools,
    # the MCP tools and the template arguments.
    messages: list[dict[str, Any]] = field(default_factory=list)
    client_tools: list[dict[str, Any]] | None = None
    mcp: McpTools | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    mm: Any = None  # the images' data for the engine (pippin.vision.inputs.MultiModal)
    media: MediaParts | None = None  # their parts, which the MCP loop renders again

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


async def _prompt(
    state: ServerState,
    tokenizer: Any,
    req: MessagesRequest | CountTokensRequest,
    mcp: McpTools | None,
) -> Prompt:
    """``mcp``: the request's MCP tools (`mcp_tools`, from the server's state)."""
    reject_unsupported(req)
    tools = template_tools(req)
    client_tools = tools
    if mcp is not None:
        mcp.check_clash(tools, "tools")
        tools = [*(tools or []), *mcp.functions()] or None
    kwargs = template_kwargs(state, req)

    prefill = _prefill(req.messages)
    rendered: list[dict[str, Any]] = []

    mm: list[Any] = [None]
    medias: list[MediaParts] = []

    async def render(history: list[Any]) -> list[int]:
        media = MediaParts()
        messages = template_messages(req.system, history, media)
        medias[:] = [media]
        rendered[:] = messages
        ids, mm[0] = await render_media_prompt(
            state,
            tokenizer,
            messages,
            tools,
            kwargs,
            media,
            add_generation_prompt=not prefill,
            continue_final_message=prefill,
        )
        return ids

    history = req.messages
    ids = await render(history)
    original = len(ids)
    extra: dict[str, Any] = {
        "messages": rendered,
        "client_tools": client_tools,
        "mcp": mcp,
        "kwargs": kwargs,
    }
    if req.context_management is None:
        return Prompt(ids, tools, mm=mm[0], media=medias[0], **extra)
    applied: list[dict[str, Any]] = []
    # Edits apply in order (Anthropic: clear_thinking first), each to the last one's result.
    for edit in req.context_management.edits:
        if isinstance(edit, ClearThinking):
            history, turns = clear_thinking(history, edit)
            if not turns:
                continue
            kind, count = "cleared_thinking_turns", turns
        else:
            if not _triggered(edit, history, len(ids)):
                continue
            history, uses = clear_tool_uses(history, edit)
            if not uses:
                continue
            kind, count = "cleared_tool_uses", uses
        before, ids = len(ids), await render(history)
        applied.append({"type": edit.type, kind: count, "cleared_input_tokens": before - len(ids)})
    return Prompt(ids, tools, applied, original, mm=mm[0], media=medias[0], **extra)


def _triggered(edit: ClearToolUses, history: list[Any], prompt_tokens: int) -> bool:
    trigger = edit.trigger
    if trigger is None or trigger.type == "input_tokens":
        return prompt_tokens > (trigger.value if trigger else 100_000)
    uses = sum(
        isinstance(b, ToolUseBlock)
        for m in history
        if not isinstance(m.content, str)
        for b in m.content
    )
    return uses > trigger.value


def clear_thinking(history: list[Any], edit: ClearThinking) -> tuple[list[Any], int]:
    """Drop thinking from all but the last N assistant turns (default 1); and how many."""
    if edit.keep == "all":
        return history, 0
    keep = 1 if edit.keep is None else edit.keep.value
    turns = [i for i, m in enumerate(history) if m.role == "assistant"]
    drop = set(turns[: max(len(turns) - keep, 0)])
    out, cleared = [], 0
    for i, m in enumerate(history):
        if i in drop and not isinstance(m.content, str):
            kept = [
                b for b in m.content if not isinstance(b, ThinkingBlock | RedactedThinkingBlock)
            ]
            if len(kept) < len(m.content):
                cleared += 1
                m = m.model_copy(update={"content": kept})
        out.append(m)
    return out, cleared


_CLEARED = "[tool result cleared to save context]"


def clear_tool_uses(history: list[Any], edit: ClearToolUses) -> tuple[list[Any], int]:
    """Replace all but the last `keep` tool results (and optionally inputs) with a note;
    and how many were replaced."""
    keep = edit.keep.value if edit.keep else 3
    excluded = set(edit.exclude_tools or [])
    names: dict[str, str] = {}
    results: list[str] = []
    for m in history:
        for b in [] if isinstance(m.content, str) else m.content:
            if isinstance(b, ToolUseBlock):
                names[b.id] = b.name
            elif isinstance(b, ToolResultBlock) and names.get(b.tool_use_id) not in excluded:
                results.append(b.tool_use_id)
    cleared = set(results[: max(len(results) - keep, 0)])
    inputs = edit.clear_tool_inputs
    out = []
    for m in history:
        if isinstance(m.content, str):
            out.append(m)
            continue
        blocks = []
        for b in m.content:
            if isinstance(b, ToolResultBlock) and b.tool_use_id in cleared:
                b = b.model_copy(update={"content": _CLEARED})
            elif (
                isinstance(b, ToolUseBlock)
                and b.id in cleared
                and (inputs is True or (isinstance(inputs, list) and b.name in inputs))
            ):
                b = b.model_copy(update={"input": {}})
            blocks.append(b)
        out.append(m.model_copy(update={"content": blocks}))
    return out, len(cleared)


def sampling_params(state: ServerState, req: MessagesRequest, prompt_len: int) -> SamplingParams:
    limits = state.limits
    assert limits is not None
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise _error(
            f"prompt is too long: {prompt_len} tokens > {limits.max_model_len - 1} maximum",
            "messages",
        )
    # Clients such as Claude Code ask for more than a local model's context holds; the
    # answer is capped by what is left (and stops with "max_tokens" there).
    max_tokens = min(req.max_tokens, room)
    if limits.max_tokens_cap is not None:
        max_tokens = min(max_tokens, limits.max_tokens_cap)
    d = state.defaults

    def pick(value: Any, name: str) -> Any:
        return d[name] if value is None else value

    temperature = float(pick(req.temperature, "temperature"))
    top_p = float(pick(req.top_p, "top_p"))
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=int(pick(req.top_k, "top_k")),
        min_p=float(d["min_p"]),
        repetition_penalty=float(d["repetition_penalty"]),
        presence_penalty=float(d["presence_penalty"]),
        frequency_penalty=float(d["frequency_penalty"]),
        stop=[s for s in req.stop_sequences or [] if s],
        cache_salt=salted(None),  # the API key's own prefix cache (--api-keys)
    )


# --- engine output -> content blocks ------------------------------------------


def _signature(thinking: str) -> str:
    mac = hmac.new(_SIGNING_KEY, thinking.encode(), hashlib.sha256).digest()
    return base64.b64encode(mac).decode()


def _tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


@dataclass
class BlockBuilder:
    """Turns parsed deltas into content blocks and the stream events that build them."""

    # thinking.display "omitted": thinking blocks come with their signature, their text empty.
    omit_thinking: bool = False
    blocks: list[dict[str, Any]] = field(default_factory=list)
    kind: str | None = None  # type of the open block
    _space: str = ""  # whitespace-only text, sent only if more text follows
    _args: str = ""
    _thought: str = ""  # the open thinking block's text, signed even when omitted
    # With MCP tools: their calls become mcp_tool_use blocks (and their results follow).
    loop: ToolLoop | None = None

    def feed(self, d: ParsedDelta) -> list[dict[str, Any]]:
        ev: list[dict[str, Any]] = []
        if d.reasoning:
            if self.kind != "thinking":
                ev += self._open({"type": "thinking", "thinking": ""})
                self._thought = ""
            self._thought += d.reasoning
            if not self.omit_thinking:
                self.blocks[-1]["thinking"] += d.reasoning
                ev.append(self._delta({"type": "thinking_delta", "thinking": d.reasoning}))
        if d.content:
            text = self._space + d.content
            if not text.strip() and self.kind != "text":
                self._space = text
            else:
                self._space = ""
                if self.kind != "text":
                    ev += self._open({"type": "text", "text": ""})
                self.blocks[-1]["text"] += text
                ev.append(self._delta({"type": "text_delta", "text": text}))
        for c in d.calls:
            if c.name is not None:
                self._space = ""
                block = {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}
                loop = self.loop
                if loop is not None and loop.tools is not None and loop.owns(c.name):
                    block["type"] = "mcp_tool_use"
                    block["server_name"] = loop.tools.label(c.name)
                ev += self._open(block)
                self._args = ""
            if not c.arguments:
                continue
            self._args += c.arguments
            ev.append(self._delta({"type": "input_json_delta", "partial_json": c.arguments}))
        return ev

    def close(self) -> list[dict[str, Any]]:
        if self.kind is None:
            return []
        ev: list[dict[str, Any]] = []
        block = self.blocks[-1]
        if self.kind == "thinking":
            block["signature"] = _signature(self._thought)
            ev.append(self._delta({"type": "signature_delta", "signature": block["signature"]}))
        elif self.kind in ("tool_use", "mcp_tool_use"):
            try:
                block["input"] = json.loads(self._args) if self._args else {}
            except ValueError:
                pass  # streamed, a call the output ended inside: its input was never whole
        ev.append({"type": "content_block_stop", "index": len(self.blocks) - 1})
        self.kind = None
        return ev

    def result(self, call: McpCall) -> list[dict[str, Any]]:
        """An MCP call's result, as a whole block."""
        assert call.result is not None
        ev = self._open(
            {
                "type": "mcp_tool_result",
                "tool_use_id": call.id,
                "is_error": call.result.is_error,
                "content": [{"type": "text", "text": call.result.output}],
            }
        )
        return ev + self.close()

    def client_called(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.blocks)

    def _open(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        ev = self.close()
        self.blocks.append(block)
        self.kind = block["type"]
        start = dict(block)
        if self.kind == "thinking":
            start["signature"] = ""
        ev.append(
            {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": start}
        )
        return ev

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}


def stop_fields(step: ParsedStep | None, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) as Anthropic names them."""
    if step is None:
        return "end_turn", None
    reason = step.finish_reason
    if reason == "length":
        return "max_tokens", None
    if isinstance(step.stop_reason, str):
        # A stop sequence ended the turn, also one that cut a tool call short (that call
        # is no call: see the tool-call parsers).
        return "stop_sequence", step.stop_reason
    if called or reason == "tool_calls":
        return "tool_use", None
    return "end_turn", None


def usage_body(prompt: int, cached: int, output: int) -> dict[str, Any]:
    # Anthropic's input_tokens leaves out what was read from the cache.
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": output,
    }


@dataclass
class MessageRun:
    state: ServerState
    prompt_ids: list[int]
    params: SamplingParams
    new_parser: NewParser
    model: str
    context_management: dict[str, Any] | None = None
    omit_thinking: bool = False
    message_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex[:24])
    # With MCP tools: the tool loop (else one turn of the same loop).
    loop: ToolLoop | None = None

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
        }

    def _loop(self) -> ToolLoop:
        if self.loop is None:
            engine = self.state.engine
            assert engine is not None
            first = Turn(self.prompt_ids, self.params, self.new_parser)
            self.loop = ToolLoop(engine, self.message_id, [], first, None)
        return self.loop

    def _stop(self, builder: BlockBuilder) -> tuple[str, str | None]:
        loop = self._loop()
        if loop.finish_reason == "length":
            return "max_tokens", None
        reason, seq = stop_fields(loop.last_step, builder.client_called())
        if reason == "tool_use" and loop.tools is not None and not builder.client_called():
            reason = "end_turn"  # only pippin's calls were made: the model answered
        return reason, seq

    def _usage(self) -> dict[str, Any]:
        loop = self._loop()
        prompt = loop.prompt_tokens or len(self.prompt_ids)
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
        loop = self._loop()
        builder = BlockBuilder(self.omit_thinking, loop=loop)
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
        loop = self._loop()
        builder = BlockBuilder(self.omit_thinking, loop=loop)
        queue: asyncio.Queue[Any] = asyncio.Queue()

        async def pump() -> None:
            try:
                async with closing(loop.events()) as events:
                    async for ev in events:
                        await queue.put(ev)
                await queue.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the stream
                await queue.put(exc)

        task = asyncio.ensure_future(pump())
        try:
            first = await _get(queue, _START_WAIT)
            cached = first.cached_tokens if isinstance(first, ParsedStep) else 0
            start = {
                **self._head(),
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage_body(len(self.prompt_ids), cached, 0),
            }
            yield typed_sse({"type": "message_start", "message": start})
            yield typed_sse({"type": "ping"})
            item: Any = first
            while True:
                while item is _TIMEOUT:
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


async def _get(queue: asyncio.Queue[Any], timeout: float) -> Any:
    try:
        return await asyncio.wait_for(queue.get(), timeout)
    except asyncio.TimeoutError:
        return _TIMEOUT


# --- routes ------------------------------------------------------------------


@router.post("/v1/messages", response_model=None, **anthropic_route(MessagesRequest, stream=True))
async def create_message(request: Request) -> Any:
    req = await parse_request(MessagesRequest, await request.body())
    state = get_state(request)
    check_model(state, req.model)
    if not req.messages:
        raise bad_request("messages: at least one message is required.", param="messages")
    mcp = mcp_tools(state, req)
    state = await use_model(state, req.model)
    engine, loaded = require_engine(state)
    prompt = await _prompt(state, loaded.tokenizer, req, mcp)
    prompt_ids, tools = prompt.ids, prompt.tools
    params = sampling_params(state, req, len(prompt_ids))
    params.mm = prompt.mm
    budget = None
    if isinstance(req.thinking, ThinkingEnabled):
        if req.thinking.budget_tokens >= req.max_tokens:
            raise _error(
                "`max_tokens` must be greater than `thinking.budget_tokens`.",
                "thinking.budget_tokens",
            )
        budget = req.thinking.budget_tokens
    if budget is not None and (state.parsers is None or state.parsers.reasoning is None):
        budget = None  # the template's switch is all this model has
    new_parser, params = await output_parsing(
        state,
        loaded.tokenizer,
        prompt_ids,
        params,
        tools,
        budget,
        spec=structured_spec(state, req, tools),
        budget_param="thinking.budget_tokens",
        new_id=_tool_id,
        # disable_parallel_tool_use: only the first call the model writes is answered.
        one_call=bool(req.tool_choice and req.tool_choice.disable_parallel_tool_use),
    )
    try:
        engine.check(prompt_ids, params)
    except EngineError as exc:
        raise bad_request(str(exc), param="messages") from None
    omit = getattr(req.thinking, "display", None) == "omitted"
    run = MessageRun(
        state,
        prompt_ids,
        params,
        new_parser,
        req.model,
        prompt.context_management(),
        omit_thinking=omit,
    )
    if prompt.mcp is not None:
        run.loop = request_loop(
            state,
            engine,
            loaded.tokenizer,
            run.message_id,
            prompt.messages,
            Turn(prompt_ids, params, new_parser),
            prompt.client_tools,
            prompt.mcp,
            prompt.kwargs,
            thinking_budget=budget,
            new_id=_tool_id,
            one_call=bool(req.tool_choice and req.tool_choice.disable_parallel_tool_use),
            media=prompt.media,
        )
    if req.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
    return JSONResponse(await cancel_on_disconnect(request.receive, run.collect()))


@router.post(
    "/v1/messages/count_tokens", response_model=None, **anthropic_route(CountTokensRequest)
)
async def count_tokens(request: Request) -> Any:
    req = await parse_request(CountTokensRequest, await request.body())
    state = get_state(request)
    check_model(state, req.model)
    mcp = mcp_tools(state, req)
    state = await use_model(state, req.model)
    _, loaded = require_engine(state)
    prompt = await _prompt(state, loaded.tokenizer, req, mcp)
    body: dict[str, Any] = {"input_tokens": len(prompt.ids)}
    if prompt.applied_edits is not None:
        body["context_management"] = {"original_input_tokens": prompt.original_tokens}
    return JSONResponse(body)
