"""Llama 3.1 / 3.2 / 3.3 JSON calls (and Llama 4's official template, which asks for the same).

Transcripts follow the official templates: a call is written back as
`{"name": "...", "parameters": {...}}`, built-in tools as
`<|python_tag|>brave_search.call(query="...")`.
"""

from __future__ import annotations

import json

import pytest
from support.parser_harness import check_split_invariance

from pippin.chat.tool_parsers import detect_tool_parser, get_tool_parser
from pippin.chat.tool_parsers.llama import Llama3JsonParser
from pippin.chat.tool_parsers.pythonic import PythonicParser
from pippin.chat.tool_parsers.tagged_json import HermesParser

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {}}}
    for n in ("get_weather", "get_time")
]
WITH_SEARCH = [*TOOLS, {"type": "function", "function": {"name": "brave_search"}}]
PARIS = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
TOKYO = '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}'


def llama(tools=TOOLS):  # type: ignore[no-untyped-def]
    return lambda: Llama3JsonParser(tools)


def check(make, text: str):  # type: ignore[no-untyped-def]
    r = check_split_invariance(make, text)
    for raw in r.raw_args:
        assert isinstance(json.loads(raw), dict)
    return r


def test_one_call() -> None:
    r = check(llama(), PARIS)
    assert r.calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert r.content == ""


def test_several_calls_separated_by_semicolons() -> None:
    r = check(llama(), f"\n{PARIS}; {TOKYO};\n")
    assert r.calls == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"tz": "Asia/Tokyo"}),
    ]
    assert r.content == ""


def test_calls_on_separate_lines() -> None:
    r = check(llama(), f"{PARIS}\n{TOKYO}")
    assert [name for name, _ in r.calls] == ["get_weather", "get_time"]
    assert r.content == ""


def test_python_tag() -> None:
    r = check(llama(), f"<|python_tag|>{PARIS}; {TOKYO}")
    assert [name for name, _ in r.calls] == ["get_weather", "get_time"]
    assert r.content == ""


def test_text_before_json_is_all_text() -> None:
    # A model quoting JSON in prose does not call anything.
    text = f"Here is how a call looks: {PARIS}"
    r = check(llama(), text)
    assert (r.content, r.calls) == (text, [])


def test_text_before_python_tag() -> None:
    r = check(llama(), f"Let me check.<|python_tag|>{PARIS}")
    assert r.content == "Let me check."
    assert [name for name, _ in r.calls] == ["get_weather"]


def test_text_after_calls() -> None:
    r = check(llama(), f"{PARIS}\n\nI asked for the weather.")
    assert r.calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert r.content == "\n\nI asked for the weather."


def test_other_key_order_is_reported_whole() -> None:
    text = '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris"}}'
    assert check(llama(), text).calls == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": get_weather, "parameters": {}}',
        '{"answer": 42}',
        '<|python_tag|>{"name": "get_weather" "parameters": {}}',
        "<|python_tag|>import math\nprint(math.pi)",
        "<|python_tag|>",
    ],
)
def test_malformed_is_text(text: str) -> None:
    r = check(llama(), text)
    assert (r.content, r.calls) == (text, [])


def test_arguments_going_wrong_close_the_call() -> None:
    r = check(llama(), '{"name": "get_weather", "parameters": {"city": "Paris", "days": x}}')
    assert r.calls == [("get_weather", {"city": "Paris", "days": None})]
    assert r.content == "x}}"


def test_unknown_tool_is_text() -> None:
    text = '{"name": "send_email", "parameters": {"to": "bob@example.com"}}'
    r = check(llama(), text)
    assert (r.content, r.calls) == (text, [])
    r = check(llama(), f'{PARIS}; {{"name": "send_email", "parameters": {{}}}}')
    assert [name for name, _ in r.calls] == ["get_weather"]
    assert r.content == '; {"name": "send_email", "parameters": {}}'


def test_truncated_arguments() -> None:
    # A call the output ends inside is no call: streamed, what was sent of it stays
    # (nothing is invented to close it); answered whole, it is text.
    text = '{"name": "get_weather", "parameters": {"city": "Par'
    r = check(llama(), text)
    assert (r.calls, r.content, r.cut) == ([], "", ("get_weather", '{"city": "Par'))
    assert (r.whole.calls, r.whole.content) == ([], text)
    cut = '{"name": "get_time", "parameters": {"tz": "Europe/Paris", "days": '
    r = check(llama(), f"{PARIS}; {cut}")
    assert r.cut == ("get_time", '{"tz": "Europe/Paris", "days": ')
    assert r.whole.calls == r.calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert r.whole.content == "; " + cut


def test_arguments_stream() -> None:
    p = Llama3JsonParser(TOOLS)
    d = p.feed('{"name": "get_weather", "parameters": {"city": "Pa')
    assert [(c.name, c.arguments) for c in d.calls] == [("get_weather", '{"city": "Pa')]
    d = p.feed('ris"}}')
    assert [c.arguments for c in d.calls] == ['ris"}']


def test_builtin_tool() -> None:
    text = '<|python_tag|>brave_search.call(query="current weather in Menlo Park, California")'
    r = check(llama(WITH_SEARCH), text)
    assert r.calls == [("brave_search", {"query": "current weather in Menlo Park, California"})]
    assert r.content == ""


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_builtin_tool_not_in_request_is_text(tools) -> None:  # type: ignore[no-untyped-def]
    text = '<|python_tag|>brave_search.call(query="weather")'
    r = check(llama(tools), text)
    assert (r.content, r.calls) == (text, [])


def test_builtin_malformed_is_text() -> None:
    text = "<|python_tag|>brave_search.call(weather)"
    r = check(llama(WITH_SEARCH), text)
    assert (r.content, r.calls) == (text, [])


# --- choosing the parser --------------------------------------------------------

LLAMA31 = (
    '{{- "Environment: ipython\\n" }}\n'
    '{{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.' }}\n"
    '{{- "<|python_tag|>" + tool_call.name + ".call(" }}\n'
    '{{- "<|eom_id|>" }}'
)
LLAMA4 = (
    '{{- "Given the following functions, please respond with a JSON for a function call " }}\n'
    '{{- \'Respond in the format {"name": function name, "parameters": dictionary of '
    "argument name and its value}.' }}\n"
    "{{- '<|python_start|>' }}{{- message['content'] }}{{- '<|python_end|>' }}"
    "{{- '<|header_start|>assistant<|header_end|>\\n\\n' }}"
)
LLAMA4_PYTHONIC = (
    "- Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]\\n"
    "{{- '<|header_start|>ipython<|header_end|>\\n\\n' }}"
)
HERMES = (
    "{{- '<|im_start|>system\\n# Tools\\n<tools>' }}"
    '{{- \'<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n'
    "</tool_call>' }}"
)
SMOLLM2 = "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' }}"


@pytest.mark.parametrize(
    ("template", "model_type", "expected"),
    [
        (LLAMA31, "llama", Llama3JsonParser),
        (LLAMA4, "llama4", Llama3JsonParser),
        (LLAMA4_PYTHONIC, "llama4", PythonicParser),
        (HERMES, "llama", HermesParser),
        (SMOLLM2, "llama", None),
    ],
)
def test_detect(template: str, model_type: str, expected: type | None) -> None:
    assert detect_tool_parser(template, model_type, {"<|python_tag|>", "<|eom_id|>"}) is expected


def test_names() -> None:
    for name in ("llama3_json", "llama3", "llama", "llama4_json"):
        assert get_tool_parser(name) is Llama3JsonParser
    assert Llama3JsonParser.special_tokens == ("<|python_tag|>",)
