"""JSON call lists behind a marker: Granite 3.x, Phi-4-mini, Llama-Nemotron, xLAM.

Transcripts follow each family's chat template (how it writes calls back into the
prompt) and vLLM's parser tests for the same formats.
"""

from __future__ import annotations

import json

import pytest
from support.parser_harness import check_split_invariance

from pippin.chat.tool_parsers import detect_tool_parser, get_tool_parser
from pippin.chat.tool_parsers.json_lists import (
    GraniteParser,
    NemotronParser,
    Phi4MiniParser,
    XlamParser,
)
from pippin.chat.tool_parsers.tagged_json import HermesParser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
TOKYO = '{"name": "get_time", "arguments": {"tz": "Asia/Tokyo"}}'
CALLS = [
    ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ("get_time", {"tz": "Asia/Tokyo"}),
]


def parse(cls: type, text: str, tools: list | None = TOOLS):  # type: ignore[no-untyped-def]
    result = check_split_invariance(lambda: cls(tools), text)
    for raw in result.raw_args:
        assert isinstance(json.loads(raw), dict)
    return result


# --- Hermes / Qwen: the same JSON objects, one per <tool_call> ------------------


def test_hermes_truncated_call_is_not_a_call() -> None:
    # Qwen2.5-Coder cut off by max_tokens: once returned with arguments
    # {"a": 42, "": null}. Streamed, what was sent of it stays and nothing closes it;
    # answered whole, it is text.
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"a": 42, "'
    r = parse(HermesParser, text)
    assert (r.calls, r.content, r.cut) == ([], "Sure.\n", ("get_weather", '{"a": 42, "'))
    assert (r.whole.calls, r.whole.content) == ([], text)
    # Without the tags, as this model often writes its calls.
    text = '{"name": "get_weather", "arguments": {"city": "Par'
    r = parse(HermesParser, text)
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": "Par'))
    assert (r.whole.calls, r.whole.content) == ([], text)
    # A call that ended stays one; only the one cut off is text.
    cut = '<tool_call>\n{"name": "get_time", "arguments": {"tz'
    r = parse(HermesParser, f"<tool_call>\n{PARIS}\n</tool_call>\n{cut}")
    assert (r.calls, r.content, r.cut) == (CALLS[:1], "\n", ("get_time", '{"tz'))
    assert (r.whole.calls, r.whole.content) == (CALLS[:1], "\n" + cut)
    # Cut off after the call object, in the closing tag: the call ended.
    r = parse(HermesParser, f"<tool_call>\n{PARIS}\n</tool_")
    assert (r.calls, r.cut, r.whole.calls) == (CALLS[:1], None, CALLS[:1])


# --- Granite 3.x -------------------------------------------------------------

GRANITE_33_TEMPLATE = (
    '{%- set system_message = system_message + " You are a helpful assistant with access to '
    "the following tools. When a tool is required to answer the user's query, respond only "
    'with <|tool_call|> followed by a JSON list of tools used." %}'
    "{{- '<|start_of_role|>available_tools<|end_of_role|>' }}"
    "{{- available_tools | tojson(indent=4) }}"
    "{{- '<|start_of_role|>assistant<|end_of_role|>' }}"
)
GRANITE_4_TEMPLATE = (
    "{%- set tools_system_message_suffix = '\\n</tools>\\n\\nFor each tool call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\\n"
    '<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n'
    "</tool_call>.' %}"
    '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{{- '<|start_of_role|>assistant<|end_of_role|>' }}"
)


def test_granite_one_call() -> None:
    r = parse(GraniteParser, f"<|tool_call|>[{PARIS}]")
    assert r.calls == CALLS[:1] and r.content == ""


def test_granite_several_calls_indented_like_its_template() -> None:
    # The template writes calls back with tojson(indent=4), arguments as a JSON string.
    body = json.dumps(
        [
            {"name": "get_weather", "arguments": json.dumps(CALLS[0][1])},
            {"name": "get_time", "arguments": CALLS[1][1]},
        ],
        indent=4,
    )
    r = parse(GraniteParser, "<|tool_call|>" + body)
    assert r.calls == CALLS


def test_granite_text_before_and_after() -> None:
    r = parse(GraniteParser, f"Let me check.<|tool_call|>[{PARIS}, {TOKYO}] Done.")
    assert r.calls == CALLS
    assert r.content == "Let me check. Done."


def test_granite_31_plain_marker() -> None:
    r = parse(GraniteParser, f"<tool_call>[{PARIS}]")
    assert r.calls == CALLS[:1] and r.content == ""


def test_granite_malformed_is_text() -> None:
    text = "<|tool_call|>[get_weather(city='Paris')]"
    r = parse(GraniteParser, text)
    assert r.calls == [] and r.content == "<|tool_call|>[get_weather(city='Paris')]"


def test_granite_unknown_tool_is_text() -> None:
    text = '<|tool_call|>[{"name": "send_email", "arguments": {"to": "bob"}}]'
    r = parse(GraniteParser, text)
    assert r.calls == [] and r.content == text


def test_granite_truncated_arguments() -> None:
    # A call the output ends inside is no call: streamed, what was sent of it stays;
    # answered whole, it is text.
    text = '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa'
    r = parse(GraniteParser, text)
    assert (r.calls, r.content, r.cut) == ([], "", ("get_weather", '{"city": "Pa'))
    assert (r.whole.calls, r.whole.content) == ([], text)


def test_granite_detection_3x_vs_4() -> None:
    assert detect_tool_parser(GRANITE_33_TEMPLATE, "granite", {}) is GraniteParser
    # Granite 4 writes hermes <tool_call>{...}</tool_call>.
    assert detect_tool_parser(GRANITE_4_TEMPLATE, "granitemoehybrid", {}) is HermesParser
    assert get_tool_parser("granite3") is GraniteParser


# --- Phi-4-mini --------------------------------------------------------------

PHI4_MINI_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message "
    "and message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] "
    "+ '<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
    "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)


def test_phi4_mini_one_call() -> None:
    r = parse(Phi4MiniParser, f"functools[{PARIS}]")
    assert r.calls == CALLS[:1] and r.content == ""


def test_phi4_mini_several_calls_with_text() -> None:
    r = parse(Phi4MiniParser, f"I'll look both up. functools[{PARIS}, {TOKYO}]")
    assert r.calls == CALLS
    assert r.content == "I'll look both up. "


def test_phi4_mini_parameters_key() -> None:
    # vLLM's parser also reads "parameters" in place of "arguments".
    r = parse(Phi4MiniParser, 'functools[{"name": "get_time", "parameters": {"tz": "UTC"}}]')
    assert r.calls == [("get_time", {"tz": "UTC"})]


def test_phi4_mini_word_in_prose_and_malformed_are_text() -> None:
    text = "Python's functools module caches results."
    assert parse(Phi4MiniParser, text).content == text
    text = "functools[get_weather('Paris')]"
    r = parse(Phi4MiniParser, text)
    assert r.calls == [] and r.content == text


def test_phi4_mini_unknown_tool_is_text() -> None:
    text = 'functools[{"name": "book_flight", "arguments": {"to": "Oslo"}}]'
    r = parse(Phi4MiniParser, text)
    assert r.calls == [] and r.content == text


def test_phi4_mini_truncated_arguments() -> None:
    cut = '{"name": "get_time", "arguments": {"tz": '
    r = parse(Phi4MiniParser, f"functools[{PARIS}, {cut}")
    assert (r.calls, r.cut) == ([CALLS[0]], ("get_time", '{"tz": '))
    # The calls that ended stay calls; the one cut off is the text of its entry.
    assert (r.whole.calls, r.whole.content) == ([CALLS[0]], cut)


def test_phi4_mini_detection() -> None:
    assert detect_tool_parser(PHI4_MINI_TEMPLATE, "phi3", {}) is Phi4MiniParser
    vllm_template = "* prefix function calls with functools marker (no closing marker required)"
    assert detect_tool_parser(vllm_template, "phi3", {}) is Phi4MiniParser
    assert get_tool_parser("phi4_mini_json") is Phi4MiniParser


# --- Llama-Nemotron ----------------------------------------------------------

NEMOTRON_TEMPLATE = (
    "{{- 'You can use the following tools to assist the user if required:\\n"
    "<AVAILABLE_TOOLS>' + tools|tojson + '</AVAILABLE_TOOLS>\\n\\nIf you decide to call any "
    'tool(s), use the following format:\\n<TOOLCALL>[{{\\"name\\": \\"tool_name1\\", '
    '\\"arguments\\": \\"tool_args1\\"}}]</TOOLCALL>\' }}'
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)


def test_nemotron_one_call() -> None:
    r = parse(NemotronParser, f"<TOOLCALL>[{PARIS}]</TOOLCALL>")
    assert r.calls == CALLS[:1] and r.content == ""


def test_nemotron_several_calls_text_around() -> None:
    r = parse(NemotronParser, f"Checking.\n<TOOLCALL>[{PARIS}, {TOKYO}]</TOOLCALL>\nOne moment.")
    assert r.calls == CALLS
    assert r.content == "Checking.\n\nOne moment."


def test_nemotron_malformed_is_text() -> None:
    text = "<TOOLCALL>[get_weather: Paris]</TOOLCALL>"
    r = parse(NemotronParser, text)
    assert r.calls == [] and r.content == text


def test_nemotron_unknown_tool_is_text() -> None:
    text = '<TOOLCALL>[{"name": "delete_all", "arguments": {}}]</TOOLCALL>'
    r = parse(NemotronParser, text)
    assert r.calls == [] and r.content == text


def test_nemotron_truncated_arguments() -> None:
    text = '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", '
    r = parse(NemotronParser, text)
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": "Paris"'))  # no comma yet
    assert (r.whole.calls, r.whole.content) == ([], text)


def test_nemotron_detection() -> None:
    assert detect_tool_parser(NEMOTRON_TEMPLATE, "llama", {}) is NemotronParser
    for alias in ("nemotron_json", "llama_nemotron_json"):
        assert get_tool_parser(alias) is NemotronParser


# --- xLAM --------------------------------------------------------------------

XLAM_TEMPLATE = (
    '{%- set system_message = "You are a helpful assistant. You are developed by Salesforce '
    'xLAM team." %}'
    "{% set format_instruction %}You have access to a set of tools. When using tools, make "
    'calls in a single JSON array: \\n\\n[{"name": "tool_call_name", "arguments": {"arg1": '
    '"value1", "arg2": "value2"}}, ... (additional parallel tool calls as needed)]{% endset %}'
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
)


def test_xlam_bare_list() -> None:
    r = parse(XlamParser, f"[{PARIS}]")
    assert r.calls == CALLS[:1] and r.content == ""


def test_xlam_several_calls_as_its_template_writes_them() -> None:
    r = parse(XlamParser, f"\n[{PARIS}, {TOKYO}]")
    assert r.calls == CALLS and r.content == ""


def test_xlam_fenced_list_with_text_around() -> None:
    r = parse(XlamParser, f"I'll call the tool.\n```json\n[{PARIS}]\n```\nWaiting for results.")
    assert r.calls == CALLS[:1]
    assert r.content == "I'll call the tool.\n\nWaiting for results."
    r = parse(XlamParser, f"Sure:\n```\n[{PARIS}, {TOKYO}]\n```")
    assert r.calls == CALLS and r.content == "Sure:\n"


def test_xlam_other_markers() -> None:
    r = parse(XlamParser, f"[TOOL_CALLS][{PARIS}]")
    assert r.calls == CALLS[:1] and r.content == ""
    r = parse(XlamParser, f"<tool_call>{TOKYO}</tool_call>")
    assert r.calls == CALLS[1:] and r.content == ""


def test_xlam_brackets_and_code_in_prose_are_text() -> None:
    for text in (
        "[1] Smith et al. say so.",
        "Lists look like [1, 2, 3].",
        "Use this:\n```python\nprint([1, 2])\n```",
        'A sample:\n```json\n{"a": 1}\n```',
    ):
        r = parse(XlamParser, text)
        assert r.calls == [] and r.content == text


def test_xlam_malformed_is_text() -> None:
    text = '[{"name": get_weather, "arguments": {"city": "Paris"}}]'
    r = parse(XlamParser, text)
    assert r.calls == [] and r.content == text


def test_arguments_that_are_not_an_object_are_text() -> None:
    text = '[{"name": "get_weather", "arguments": ["Paris"]}]'
    r = parse(XlamParser, text)
    assert r.calls == [] and r.content == text


def test_xlam_unknown_tool_is_text() -> None:
    text = '[{"name": "get_stock", "arguments": {"symbol": "CRM"}}]'
    r = parse(XlamParser, text)
    assert r.calls == [] and r.content == text


def test_xlam_truncated_arguments() -> None:
    text = '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c'
    r = parse(XlamParser, text)
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": "Paris", "unit": "c'))
    assert (r.whole.calls, r.whole.content) == ([], text)


def test_xlam_detection() -> None:
    assert detect_tool_parser(XLAM_TEMPLATE, "llama", {}) is XlamParser
    # Without its template nothing marks the format: chosen by name only.
    assert not XlamParser.matches("{{ messages }}", "llama", {})


@pytest.mark.parametrize("cls", [GraniteParser, Phi4MiniParser, NemotronParser, XlamParser])
def test_any_name_without_a_tools_list(cls: type) -> None:
    starts = {GraniteParser: "<|tool_call|>", Phi4MiniParser: "functools", XlamParser: ""}
    text = starts.get(cls, "<TOOLCALL>") + '[{"name": "anything", "arguments": {"x": 1}}]'
    assert parse(cls, text, tools=None).calls == [("anything", {"x": 1})]
