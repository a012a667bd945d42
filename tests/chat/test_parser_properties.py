"""Property-based tests (hypothesis) of the streaming output parsers: for any output, built
from each family's own markers, JSON pieces and any text, feeding it in any split gives what
feeding it whole gives, the arguments of every call that ended are JSON, and nothing raises."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.parser_harness import run, run_reasoning

from pippin.chat.reasoning import REASONING_PARSERS
from pippin.chat.tool_parsers import registry
from pippin.chat.tool_parsers.base import ToolParser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]
# What the families' outputs are made of: their markers, JSON and Python call syntax, the
# tool names, and text of any kind (line breaks of every sort among it).
MARKERS = [
    "<tool_call>",
    "</tool_call>",
    "[TOOL_CALLS]",
    "<|python_tag|>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "<think>",
    "</think>",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "functools",
    "<|start|>",
    "<|channel|>",
    "<|message|>",
    "<|call|>",
    "<|end|>",
    "commentary",
    "analysis",
    "final",
    " to=functions.",
    "<start_function_call>",
    "<end_function_call>",
    "call:",
    "<escape>",
    "[",
    "]",
    "{",
    "}",
    "(",
    ")",
    '"',
    ":",
    ",",
    "=",
    '"name"',
    '"arguments"',
    '"parameters"',
    "get_weather",
    "get_time",
    '"city"',
    '"Paris"',
    "1",
    "true",
    "null",
    "\\",
    "\n",
    " ",
    "\u2028",
    "\x85",
    "é",
    "🙂",
]
PIECES = st.one_of(st.sampled_from(MARKERS), st.text(max_size=4))
OUTPUTS = st.lists(PIECES, max_size=30).map("".join)


def splits(text: str) -> st.SearchStrategy[list[str]]:
    cuts = st.lists(st.integers(0, len(text)), max_size=12).map(sorted)
    return cuts.map(lambda cs: [text[a:b] for a, b in zip([0, *cs], [*cs, len(text)])])


def tool_parser(cls: type[ToolParser]) -> Callable[[], ToolParser]:
    takes_tools = len(inspect.signature(cls).parameters) > 0
    return (lambda: cls(TOOLS)) if takes_tools else cls  # type: ignore[call-arg]


@pytest.mark.parametrize("name", sorted(registry()))
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_tool_parser_any_split_of_any_output(name: str, data: Any) -> None:
    make = tool_parser(registry()[name])
    text = data.draw(OUTPUTS)
    one = run(make, [text])  # run() also checks each ended call's arguments are JSON
    assert run(make, data.draw(splits(text))) == one
    assert run(make, list(text)) == one
    whole = run(make, [text], whole=True)
    assert run(make, data.draw(splits(text)), whole=True) == whole


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("open_in_prompt", [False, True])
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_reasoning_parser_any_split_of_any_output(
    name: str, open_in_prompt: bool, data: Any
) -> None:
    cls = REASONING_PARSERS[name]
    make = lambda: cls(open_in_prompt)  # noqa: E731
    text = data.draw(OUTPUTS)
    whole = run_reasoning(make, [text])
    assert run_reasoning(make, data.draw(splits(text))) == whole
    assert run_reasoning(make, list(text)) == whole
    # Nothing is lost or made up: the text is the reasoning and the content, less the tags.
    assert len(whole[0]) + len(whole[1]) <= len(text)
