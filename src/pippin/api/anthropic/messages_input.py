"""An Anthropic Messages request -> the chat job's parts: the system prompt and the
messages (text, images, documents, tool uses and results, thinking) as template messages,
the client's tools (deferred ones hidden until a `tool_reference` loads them), MCP
servers, a forced call's or `output_config.format`'s grammar, and fields refused by name."""

from __future__ import annotations

import json
from typing import Any

from pippin.api.anthropic.mcp import anthropic_mcp_tools
from pippin.api.anthropic.protocol import (
    CountTokensRequest,
    DocumentBlock,
    ImageBlock,
    McpToolResultBlock,
    McpToolUseBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    ServerTool,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from pippin.serving.errors import bad_request
from pippin.serving.live_model import LiveModel
from pippin.serving.media import MediaParts
from pippin.serving.pipeline import (
    tool_parser,
)
from pippin.serving.state import ServerState
from pippin.serving.tool_loop import McpTools
from pippin.structured.formats import response_format_grammar
from pippin.structured.spec import GrammarSpec, StructuredOutputError
from pippin.structured.tool_calls import forced_tool_grammar

# --- request -> prompt -------------------------------------------------------

# Claude Code's first system block: its version and a fingerprint of the conversation,
# which the hosted API strips before the model sees the prompt. Kept, it would differ
# between conversations at the prompt's very start, so no two could share a cached prefix.
BILLING_HEADER = "x-anthropic-billing-header:"


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n\n".join(b.text for b in system if not b.text.startswith(BILLING_HEADER))


def _document_text(block: DocumentBlock, param: str) -> str:
    src = block.source
    if src.get("type") == "text" and isinstance(src.get("data"), str):
        body = src["data"]
    elif src.get("type") == "content" and isinstance(src.get("content"), list | str):
        content = src["content"]
        parts = [content] if isinstance(content, str) else content
        body = "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in parts)
    else:
        raise bad_request(
            f"{param}.source: only text documents ('text' or 'content' sources) are "
            "supported by this model.",
            f"{param}.source",
        )
    if block.citations and block.citations.get("enabled"):
        raise bad_request(
            f"{param}.citations.enabled: citations are not produced by this server.",
            f"{param}.citations.enabled",
        )
    head = "\n".join(x for x in (block.title, block.context) if x)
    return f"{head}\n\n{body}" if head else body


def _image(block: ImageBlock, param: str, media: MediaParts | None) -> dict[str, Any]:
    """An image block's placeholder part (its picture collected in `media`)."""
    if media is None:
        raise bad_request("This model does not accept images.", param)
    src = block.source
    kind = src.get("type")
    if kind == "base64" and isinstance(src.get("data"), str):
        media_type = src.get("media_type")
        return media.base64(src["data"], media_type if isinstance(media_type, str) else None, param)
    if kind == "url" and isinstance(src.get("url"), str):
        return media.image(src["url"], param)
    raise bad_request(
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
            # Most templates only take a system message first. Before the first turn they
            # extend the system prompt; right after a user's own turn they join its end
            # (Claude Code's environment, after the first question), where they stay in
            # every later request, so each prompt extends the last one; later ones go
            # with the next user turn.
            if not out:
                sys_parts.append(text)
            elif out[-1]["role"] == "user" and not pending:
                _append_user(out[-1], text)
            else:
                pending.append(text)
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
            raise bad_request("System messages may only hold text blocks.", f"{p}.content[{j}]")
        texts.append(b.text)
    return "\n\n".join(texts)


def _append_user(msg: dict[str, Any], text: str) -> None:
    if isinstance(msg["content"], list):
        msg["content"] = [*msg["content"], {"type": "text", "text": f"\n\n{text}"}]
    else:
        msg["content"] = f"{msg['content']}\n\n{text}"


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
            raise bad_request(f"'{b.type}' blocks may only appear in assistant messages.", param)
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
            raise bad_request(
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
                        raise bad_request(
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
            raise bad_request(
                f"tools[{j}]: the server tool '{t.type}' is not available here; "
                "define it as a client tool with an input_schema.",
                f"tools[{j}].type",
            )
        if t.allowed_callers is not None and "direct" not in t.allowed_callers:
            # Only code execution may call it, and there is no code execution here.
            raise bad_request(
                f"tools[{j}].allowed_callers: the tool must be callable by the model "
                "('direct'); code execution is not available here.",
                f"tools[{j}].allowed_callers",
            )
        if t.defer_loading and t.name not in loaded:
            continue
        # In the OpenAI shape and order (name, description, parameters): templates write
        # tools with `tojson`, which keeps the order, so a tool renders as it does through
        # chat completions, and as the models were trained on (description first).
        fn: dict[str, Any] = {"name": t.name}
        description = t.description or ""
        if t.input_examples:
            # As the hosted API does, the model sees them with the tool.
            examples = "\n".join(json.dumps(x, ensure_ascii=False) for x in t.input_examples)
            description = f"{description}\n\nExample inputs:\n{examples}".lstrip()
        if description:
            fn["description"] = description
        fn["parameters"] = t.input_schema
        if t.strict:
            fn["strict"] = True  # a forced call's grammar then closes the schema's objects
        tools.append({"type": "function", "function": fn})
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool" and not choice.name:
            raise bad_request("tool_choice.name is required with type 'tool'.", "tool_choice.name")
        if choice.type != "tool" and choice.name is not None:
            raise bad_request(
                "tool_choice.name is only allowed with type 'tool'.", "tool_choice.name"
            )
        if choice.type == "none":
            return None
    return tools or None


def structured_spec(
    live: LiveModel, req: MessagesRequest, tools: list[dict[str, Any]] | None
) -> GrammarSpec | None:
    """A forced tool call (`tool_choice` any / tool), else `output_config.format`."""
    choice = req.tool_choice
    fmt = req.output_config.format if req.output_config is not None else None
    try:
        if choice is not None and choice.type in ("any", "tool"):
            return forced_tool_grammar(
                tool_parser(live, tools),
                tools or [],
                choice.name,
                parallel=not choice.disable_parallel_tool_use,
                vocab=live.grammars,
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
        raise bad_request(exc.message, exc.param) from None


def mcp_tools(state: ServerState, req: MessagesRequest | CountTokensRequest) -> McpTools | None:
    """The tools of the request's `mcp_servers`, which pippin runs (see api/mcp_loop.py).
    ``state``: the server's (`pippin.serving.state.ServerState`), which holds the MCP manager."""
    toolsets = [
        (t, f"tools[{j}]")
        for j, t in enumerate(req.tools or [])
        if isinstance(t, ServerTool) and t.type == "mcp_toolset"
    ]
    if not req.mcp_servers:
        if toolsets:
            raise bad_request("mcp_toolset tools need mcp_servers.", f"{toolsets[0][1]}.type")
        return None
    if req.tool_choice is not None and req.tool_choice.type == "none":
        return None
    return anthropic_mcp_tools(state, req.mcp_servers, toolsets)


def reject_unsupported(req: MessagesRequest | CountTokensRequest) -> None:
    for name in ("output_format",):
        if getattr(req, name) is not None:
            raise bad_request(f"{name}: not supported by this server.", name)

    if isinstance(req, MessagesRequest) and req.container is not None:
        raise bad_request("container: not supported by this server.", "container")
