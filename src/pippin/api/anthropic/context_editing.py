"""Anthropic's `context_management` edits: clearing old thinking and old tool results (and
their inputs) from the conversation before it is rendered."""

from __future__ import annotations

from typing import Any

from pippin.api.anthropic.protocol import (
    ClearThinking,
    ClearToolUses,
    RedactedThinkingBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)

# --- context editing -------------------------------------------------------


def triggered(edit: ClearToolUses, history: list[Any], prompt_tokens: int) -> bool:
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
