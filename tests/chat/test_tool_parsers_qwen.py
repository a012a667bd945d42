"""vllm-mlx's `qwen` parser: a call in `<tool_call>` tags as hermes JSON or as
Qwen3-Coder's `<function=…>` XML, read whole, char by char and in random pieces."""

from __future__ import annotations

import pytest
from support.parser_harness import check_split_invariance

from pippin.chat.tool_parsers import get_tool_parser
from pippin.chat.tool_parsers.qwen import QwenParser
from pippin.structured.tool_calls import forced_tool_grammar

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]
JSON_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
)
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
WANT = [("get_weather", {"city": "Paris", "days": 3})]


def make() -> QwenParser:
    return QwenParser(TOOLS)


@pytest.mark.parametrize("call", [JSON_CALL, XML_CALL], ids=["json", "xml"])
def test_both_forms(call: str) -> None:
    r = check_split_invariance(make, f"Let me look.\n{call}")
    assert r.calls == WANT and r.content == "Let me look.\n"
    two = check_split_invariance(make, f"{call}\n{call}")
    assert two.calls == WANT * 2


def test_bare_json_and_plain_text() -> None:
    bare = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    assert check_split_invariance(make, bare).calls == WANT
    text = "No call here: <tool_ is only text, and so is <function=x>."
    r = check_split_invariance(make, text)
    assert r.calls == [] and r.content == text


def test_calls_in_code_fences() -> None:
    """Qwen2.5-Coder often answers a tool call with a ```json block (seen with Claude
    Code's tools): at the start of the output, a fenced call of a known tool is a call."""
    body = '{\n  "name": "get_weather",\n  "arguments": {"city": "Paris", "days": 3}\n}'
    fenced = f"```json\n{body}\n```"
    r = check_split_invariance(make, fenced)
    assert r.calls == WANT and r.content == ""
    assert check_split_invariance(make, f"```\n{body}\n```").calls == WANT
    two = check_split_invariance(make, f"{fenced}\n{fenced}")
    assert two.calls == WANT * 2
    # Other fenced JSON, unknown tools, other languages and fences after prose are text.
    for text in (
        '```json\n{"city": "Paris"}\n```',
        fenced.replace("get_weather", "get_time"),
        f"```python\n{body}\n```",
        f"Here is how a call looks:\n{fenced}",
    ):
        r = check_split_invariance(make, text)
        assert r.calls == [] and r.content == text, text


def test_names() -> None:
    # vllm-mlx's names for its qwen parser; hermes stays the JSON-only format.
    assert get_tool_parser("qwen") is QwenParser and get_tool_parser("qwen3") is QwenParser
    assert get_tool_parser("hermes") is not QwenParser
    # A forced call writes the JSON form, which this parser reads.
    assert forced_tool_grammar(QwenParser, TOOLS, "get_weather").param == "tool_choice"
