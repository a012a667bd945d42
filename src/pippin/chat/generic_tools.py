"""Tools for a model whose chat template has none: pippin's generic tool format.

The template would drop the tools without a word, so they go into the system prompt
instead: a JSON list of the functions and an instruction to answer with

    <tool_call>
    {"name": "<function name>", "arguments": {<arguments as JSON>}}
    </tool_call>

which is the hermes format: the hermes parser reads it (also without the tags, as small
models often write it) and `structured.tool_calls` writes it for a forced call. Past
calls and their results become text the template can show: an assistant turn's calls
are appended to its content in that format, and a tool result is a user turn wrapped in
`<tool_response>` tags (how Qwen's template shows them).
"""

from __future__ import annotations

import json
from typing import Any

from pippin.chat.tool_parsers.base import tool_functions

# The parser (and forced-call format) of the generic tool format.
PARSER = "hermes"

INSTRUCTION = (
    "You can call the following functions. Each is described by a JSON schema of its "
    "arguments:\n{tools}\n\n"
    "To call a function, answer with only a JSON object with the function's name and "
    "its arguments inside <tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
    "</tool_call>\n"
    "When no function is needed, answer the user directly."
)


def tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system prompt's part that shows the tools and how to call them."""
    listed = "\n".join(json.dumps(fn, ensure_ascii=False) for fn in tool_functions(tools).values())
    return INSTRUCTION.format(tools=listed)


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            pass
    body = json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _text(content: Any) -> str:
    if isinstance(content, str) or content is None:
        return content or ""
    return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))


def _result(content: Any) -> str | list[dict[str, Any]]:
    """A tool result as the user turn's text; with images (a vision model's screenshot),
    a list of parts that keeps them where they were."""
    if isinstance(content, list) and any(
        isinstance(p, dict) and p.get("type") != "text" for p in content
    ):
        return [
            {"type": "text", "text": "<tool_response>\n"},
            *content,
            {"type": "text", "text": "\n</tool_response>"},
        ]
    return f"<tool_response>\n{_text(content)}\n</tool_response>"


def _join(a: str | list[dict[str, Any]], b: str | list[dict[str, Any]]) -> Any:
    if isinstance(a, str) and isinstance(b, str):
        return a + "\n" + b
    as_parts = [x if isinstance(x, list) else [{"type": "text", "text": x}] for x in (a, b)]
    return [*as_parts[0], {"type": "text", "text": "\n"}, *as_parts[1]]


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` with the tools in the system prompt and tool turns as plain text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            text = _text(m.get("content"))
            msg = {k: v for k, v in m.items() if k != "tool_calls"}
            msg["content"] = f"{text}\n{calls}" if text else calls
            out.append(msg)
        elif role == "tool":
            result = _result(m.get("content"))
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] = _join(out[-1]["content"], result)  # several: one turn
            else:
                out.append({"role": "user", "content": result, "_tool_results": True})
        else:
            out.append(m)
    prompt = tools_prompt(tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{prompt}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
