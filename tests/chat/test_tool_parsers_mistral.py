"""Mistral's `[TOOL_CALLS]`: the JSON-list form (tokenizers before v11) and the
`NAME[ARGS]{...}` form (v11+: Mistral Small 3.2, Devstral, Magistral).

Transcripts follow the chat templates (Mistral Small 3.1's, Devstral's) and vLLM's
mistral parser tests.
"""

from __future__ import annotations

import json

import pytest
from support.parser_harness import check_split_invariance

from pippin.chat.tool_parsers import detect_tool_parser, get_tool_parser
from pippin.chat.tool_parsers.base import collect_calls
from pippin.chat.tool_parsers.mistral import MistralParser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
    {"type": "function", "function": {"name": "add", "parameters": {}}},
]
PARIS = ("get_weather", {"city": "San Francisco", "state": "CA", "unit": "celsius"})
ADD = ("add", {"a": 3.5, "b": 4})
PARIS_ARGS = '{"city": "San Francisco", "state": "CA", "unit": "celsius"}'
ADD_ARGS = '{"a": 3.5, "b": 4}'


def parse(text: str, tools: list | None = TOOLS):  # type: ignore[no-untyped-def]
    result = check_split_invariance(lambda: MistralParser(tools), text)
    for raw in result.raw_args:
        assert isinstance(json.loads(raw), dict)
    return result


def call_ids(text: str) -> list[str]:
    p = MistralParser(TOOLS)
    d = p.feed(text)
    d.merge(p.finish())
    return [c.id for c in collect_calls(d.calls)]


# --- the JSON-list form ------------------------------------------------------


def test_list_form_one_call() -> None:
    r = parse(f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {PARIS_ARGS}}}]')
    assert (r.calls, r.content) == ([PARIS], "")
    assert r.raw_args == [PARIS_ARGS]


def test_list_form_several_calls_and_text_around() -> None:
    text = (
        f'Hello[TOOL_CALLS] [{{"name": "add", "arguments": {ADD_ARGS}, "id": "abc123def"}}, '
        f'{{"name": "get_weather", "arguments":{PARIS_ARGS}, "id": "xyz789uvw"}}]\nextra data'
    )
    r = parse(text)
    assert r.calls == [ADD, PARIS]
    assert r.content == "Hello\nextra data"


def test_list_form_arguments_before_name() -> None:
    r = parse(f'[TOOL_CALLS] [{{"arguments": {PARIS_ARGS}, "name": "get_weather"}}]')
    assert r.calls == [PARIS]


def test_list_form_malformed_is_text() -> None:
    text = "[TOOL_CALLS] [not json at all"
    r = parse(text)
    assert (r.calls, r.content) == ([], text)


def test_list_form_unknown_tool_is_text() -> None:
    text = '[TOOL_CALLS] [{"name": "launch_rockets", "arguments": {}}]'
    r = parse(text)
    assert (r.calls, r.content) == ([], text)


def test_list_form_truncated_call_is_not_a_call() -> None:
    # Streamed, what was sent of it stays; answered whole, it is text.
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "San Fr'
    r = parse(text)
    assert (r.calls, r.content, r.cut) == ([], "", ("get_weather", '{"city": "San Fr'))
    assert (r.whole.calls, r.whole.content) == ([], text)


# --- the NAME[ARGS]{...} form ------------------------------------------------


def test_args_form_one_call() -> None:
    r = parse(f"[TOOL_CALLS]get_weather[ARGS]{PARIS_ARGS}")
    assert (r.calls, r.content) == ([PARIS], "")
    assert r.raw_args == [PARIS_ARGS]


def test_args_form_several_calls_and_text_around() -> None:
    text = f"Let me see.[TOOL_CALLS]add[ARGS]{ADD_ARGS}[TOOL_CALLS]get_weather[ARGS]{PARIS_ARGS}"
    r = parse(text + " Anything else?")
    assert r.calls == [ADD, PARIS]
    assert r.content == "Let me see. Anything else?"


def test_args_form_streams_arguments() -> None:
    p = MistralParser(TOOLS)
    d = p.feed('[TOOL_CALLS]get_weather[ARGS]{"city": "San')
    assert d.calls[0].name == "get_weather"
    assert d.calls[0].arguments == '{"city": "San'


def test_args_form_call_ids() -> None:
    text = f"[TOOL_CALLS]add[CALL_ID]abc123def[ARGS]{ADD_ARGS}"
    text += f"[TOOL_CALLS]get_weather[CALL_ID]XyZ987uvw[ARGS]{PARIS_ARGS}"
    assert parse(text).calls == [ADD, PARIS]
    assert call_ids(text) == ["abc123def", "XyZ987uvw"]
    # Without one, each call gets a fresh id.
    ids = call_ids(f"[TOOL_CALLS]add[ARGS]{ADD_ARGS}[TOOL_CALLS]add[ARGS]{ADD_ARGS}")
    assert len(set(ids)) == 2


def test_args_form_with_special_tokens_skipped() -> None:
    # What vLLM's tests see once `[ARGS]` was dropped from the decoded text.
    text = f'[TOOL_CALLS]add{ADD_ARGS}[TOOL_CALLS]get_weather{{"city": "Dallas"}}'
    assert parse(text).calls == [ADD, ("get_weather", {"city": "Dallas"})]


@pytest.mark.parametrize(
    "text",
    [
        "[TOOL_CALLS]get_weather[ARGS]not json",
        "[TOOL_CALLS]get weather[ARGS]{}",
        "[TOOL_CALLS]",
        "Use [TOOL_CALLS] to call tools.",
    ],
)
def test_args_form_malformed_is_text(text: str) -> None:
    r = parse(text)
    assert (r.calls, r.content) == ([], text)


def test_args_form_unknown_tool_is_text() -> None:
    text = f"[TOOL_CALLS]launch_rockets[ARGS]{ADD_ARGS}"
    r = parse(text)
    assert (r.calls, r.content) == ([], text)
    # An unknown tool after a known one stays text too.
    r = parse(f"[TOOL_CALLS]add[ARGS]{ADD_ARGS}" + text)
    assert (r.calls, r.content) == ([ADD], text)


def test_args_form_bad_arguments_close_the_call() -> None:
    r = parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"]]')
    assert (r.calls, r.content) == ([("get_weather", {"city": "Paris"})], "]]")


def test_args_form_truncated_call_is_not_a_call() -> None:
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "San Francisco", "st'
    r = parse(text)
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": "San Francisco", "st'))
    assert (r.whole.calls, r.whole.content) == ([], text)
    text = f"[TOOL_CALLS]add[ARGS]{ADD_ARGS}[TOOL_CALLS]add[CALL_ID]abc123def[ARGS]{{"
    r = parse(text)
    assert (r.calls, r.cut) == ([ADD], ("add", "{"))
    assert r.whole.calls == [ADD]
    assert r.whole.content == "[TOOL_CALLS]add[CALL_ID]abc123def[ARGS]{"


def test_without_tools_any_name_is_called() -> None:
    r = parse('[TOOL_CALLS]anything[ARGS]{"x": 1}', tools=None)
    assert r.calls == [("anything", {"x": 1})]


# --- detection ---------------------------------------------------------------

MISTRAL_SMALL_31_TEMPLATE = (
    '{%- elif message["role"] == "tool_calls" or message.tool_calls is defined %}\n'
    '        {{- "[TOOL_CALLS] [" }}\n        {%- for tool_call in tool_calls %}\n'
    "            {%- set out = tool_call.function|tojson %}\n            {{- out[:-1] }}\n"
    "            {{- ', \"id\": \"' + tool_call.id[-9:] + '\"}' }}"
)
DEVSTRAL_TEMPLATE = (
    "{%- set arguments = tool['function']['arguments'] %}\n"
    "{%- if arguments is not string %}{%- set arguments = arguments|tojson %}{%- endif %}\n"
    "{{- \"[TOOL_CALLS]\" + tool['function']['name'] + \"[ARGS]\" + arguments }}"
)


def test_detected_from_templates_and_vocab() -> None:
    assert detect_tool_parser(MISTRAL_SMALL_31_TEMPLATE, "mistral3", set()) is MistralParser
    assert detect_tool_parser(DEVSTRAL_TEMPLATE, "mistral", set()) is MistralParser
    # Repositories without a template (mistral_common renders the prompt).
    assert detect_tool_parser("", "mistral", {"[TOOL_CALLS]": 5, "[ARGS]": 6}) is MistralParser
    assert get_tool_parser("mistral") is MistralParser


def test_special_tokens() -> None:
    assert {"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"} <= set(MistralParser.special_tokens)
