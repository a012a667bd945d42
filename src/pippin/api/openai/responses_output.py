"""The Responses API's output: parsed deltas and MCP calls -> output items (reasoning,
message, function and MCP calls, tool listings) and the stream's events, opened and
closed in order, with their ids (`new_id`) and the usage body."""

from __future__ import annotations

import copy
import secrets
from dataclasses import dataclass
from typing import Any

from pippin.api.openai.mcp import error_body
from pippin.chat.tool_parsers.base import CallDelta, ParsedDelta, random_call_id
from pippin.serving.tool_loop import (
    McpCall,
    ToolLoop,
)

# --- parsed deltas -> output items and events --------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


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


class OutputItems:
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
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "content": []}
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
                item = {"id": new_id("mcp"), "type": kind, "server_label": label, "name": c.name}
                item |= {"output": None, "error": None}
                self.mcp[call_id] = item
            item |= {"arguments": "", "status": "in_progress"}
        else:
            item = {
                "id": new_id("fc"),
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
        item = {"id": new_id("mcpl"), "type": "mcp_list_tools", "server_label": label}
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
            item = {"id": new_id("mcp"), "type": "mcp_call", "server_label": call.label}
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
