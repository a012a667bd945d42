"""The Messages API's output: parsed deltas and MCP calls -> content blocks (thinking with
its signature, text, tool_use, mcp_tool_use / mcp_tool_result) and their stream events,
the stop reason and the usage body."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from pippin.chat.tool_parsers.base import ParsedDelta
from pippin.serving.pipeline import (
    ParsedStep,
)
from pippin.serving.tool_loop import McpCall, ToolLoop

# --- engine output -> content blocks ------------------------------------------


# Signs thinking blocks so a client can hand them back; nothing checks them on input.
_SIGNING_KEY = secrets.token_bytes(32)


def _signature(thinking: str) -> str:
    mac = hmac.new(_SIGNING_KEY, thinking.encode(), hashlib.sha256).digest()
    return base64.b64encode(mac).decode()


def tool_id() -> str:
    return "toolu_" + secrets.token_hex(12)


@dataclass
class BlockBuilder:
    """Turns parsed deltas into content blocks and the stream events that build them."""

    # thinking.display "omitted": thinking blocks come with their signature, their text empty.
    omit_thinking: bool = False
    drop_thinking: bool = False  # `thinking` disabled: no thinking blocks at all
    blocks: list[dict[str, Any]] = field(default_factory=list)
    kind: str | None = None  # type of the open block
    _space: str = ""  # whitespace-only text, sent only if more text follows
    _args: str = ""
    _thought: str = ""  # the open thinking block's text, signed even when omitted
    # With MCP tools: their calls become mcp_tool_use blocks (and their results follow).
    loop: ToolLoop | None = None

    def feed(self, d: ParsedDelta) -> list[dict[str, Any]]:
        ev: list[dict[str, Any]] = []
        if d.reasoning and not self.drop_thinking:
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
