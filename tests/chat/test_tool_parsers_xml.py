"""Calls as a name plus key/value parameters in XML-ish tags: Qwen3-Coder, GLM 4.5-4.7, MiniMax M2.

Transcripts follow each family's chat template (how it writes calls back into the
prompt): Qwen3-Coder's `tool_chat_template_qwen3coder.jinja`, GLM-4.6's template in
llama.cpp, MiniMax-M2's template; values are typed by the tool's JSON schema.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from support.parser_harness import check_split_invariance

from pippin.chat.tool_parsers import detect_tool_parser, get_tool_parser
from pippin.chat.tool_parsers.base import collect_calls
from pippin.chat.tool_parsers.tagged_json import HermesParser
from pippin.chat.tool_parsers.xml_params import (
    DeepSeekV32Parser,
    Glm45Parser,
    MiniMaxM2Parser,
    Qwen3CoderParser,
    convert_value,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "mode": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "meta": {"type": "object"},
                    "note": {"type": ["string", "null"]},
                    "level": {"enum": ["low", "high"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]


def parse(cls: type, text: str, tools: list | None = TOOLS):  # type: ignore[no-untyped-def]
    result = check_split_invariance(lambda: cls(tools), text)
    for raw in result.raw_args:
        assert isinstance(json.loads(raw), dict)
    return result


# --- Qwen3-Coder --------------------------------------------------------------


def qwen_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


QWEN_PARIS = qwen_call("get_weather", city="Paris", days="3", metric="true")
QWEN_TOKYO = qwen_call("get_weather", city="Tokyo", days="1", metric="false")
PARIS = ("get_weather", {"city": "Paris", "days": 3, "metric": True})
TOKYO = ("get_weather", {"city": "Tokyo", "days": 1, "metric": False})


def test_qwen3_coder_one_call() -> None:
    r = parse(Qwen3CoderParser, QWEN_PARIS)
    assert r.content == ""
    assert r.calls == [PARIS]


def test_qwen3_coder_several_calls_and_text_around() -> None:
    text = f"I'll check both cities.\n\n{QWEN_PARIS}\n{QWEN_TOKYO}\nDone."
    r = parse(Qwen3CoderParser, text)
    assert r.calls == [PARIS, TOKYO]
    assert r.content == "I'll check both cities.\n\n\n\nDone."


def test_qwen3_coder_schema_types() -> None:
    text = qwen_call(
        "write_file",
        path="/tmp/a.py",
        content="def f(x):\n    return x < 3  # </param not the end\n",
        mode="420",
        ratio="0.5",
        tags='["a", "b"]',
        meta="{'owner': 'me', 'ok': True}",  # a Python literal is read too
        note="null",
        level="high",
    )
    r = parse(Qwen3CoderParser, text)
    assert r.calls == [
        (
            "write_file",
            {
                "path": "/tmp/a.py",
                "content": "def f(x):\n    return x < 3  # </param not the end\n",
                "mode": 420,
                "ratio": 0.5,
                "tags": ["a", "b"],
                "meta": {"owner": "me", "ok": True},
                "note": None,
                "level": "high",
            },
        )
    ]


def test_qwen3_coder_streams_string_values_as_written() -> None:
    p = Qwen3CoderParser(TOOLS)
    d = p.feed("<tool_call>\n<function=write_file>\n<parameter=content>\nline one\nline")
    assert d.calls[0].name == "write_file"
    assert "".join(c.arguments for c in d.calls) == '{"content": "line one\\nline'
    d = p.feed(" two\n</parameter>\n<parameter=mode>\n42\n</parameter>\n</function>\n</tool_call>")
    assert "".join(c.arguments for c in d.calls) == ' two", "mode": 42}'
    assert not p.finish()
    assert p.called


def test_qwen3_coder_without_tools_reads_json_else_text() -> None:
    text = qwen_call("anything", n="12", s="hello world", b="True", o='{"a": 1}')
    r = parse(Qwen3CoderParser, text, tools=None)
    assert r.calls == [("anything", {"n": 12, "s": "hello world", "b": True, "o": {"a": 1}})]


def test_qwen3_coder_call_without_parameters() -> None:
    r = parse(Qwen3CoderParser, "<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    assert r.calls == [("get_time", {})]
    assert r.raw_args == ["{}"]


def test_qwen3_coder_malformed_is_text() -> None:
    text = "Calling: <tool_call>\n<func=get_weather>\n<parameter=city>\nParis\n</parameter>"
    r = parse(Qwen3CoderParser, text)
    assert r.calls == []
    assert r.content == text


def test_qwen3_coder_unknown_tool_is_text() -> None:
    text = qwen_call("launch_rockets", count="3")
    r = parse(Qwen3CoderParser, text)
    assert r.calls == []
    assert r.content == text


def test_qwen3_coder_garbage_after_a_parameter_closes_the_call() -> None:
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "oops</function>\n</tool_call>"
    )
    r = parse(Qwen3CoderParser, text)
    assert r.calls == [("get_weather", {"city": "Paris"})]
    assert r.content == "\noops</function>\n</tool_call>"


@pytest.mark.parametrize(
    ("cut", "sent"),
    [
        ("<parameter=city>\nPar", '{"city": "Par'),  # a string is sent as it comes
        ("<parameter=city>\nParis\n</parameter>\n<parameter=days>\n1", '{"city": "Paris"'),
        ("<parameter=city>\nParis\n</parameter>\n<parame", '{"city": "Paris"'),
        ("<parameter=city>\nParis\n</param", '{"city": "Paris'),  # not the marker's start
        ("", ""),
    ],
)
def test_qwen3_coder_truncated_call_is_not_a_call(cut: str, sent: str) -> None:
    # Before `</function>`: streamed, what was sent of it stays (nothing closes it);
    # answered whole, it is text.
    text = "Sure.\n<tool_call>\n<function=get_weather>\n" + cut
    r = parse(Qwen3CoderParser, text)
    assert (r.calls, r.content, r.cut) == ([], "Sure.\n", ("get_weather", sent))
    assert (r.whole.calls, r.whole.content) == ([], text)


def test_qwen3_coder_truncated_after_the_function_is_a_call() -> None:
    cut = "<parameter=city>\nParis\n</parameter>\n</function>\n</tool"
    r = parse(Qwen3CoderParser, "Sure.\n<tool_call>\n<function=get_weather>\n" + cut)
    assert (r.calls, r.content) == ([("get_weather", {"city": "Paris"})], "Sure.\n")


def test_qwen3_coder_truncated_before_the_name_is_text() -> None:
    text = "Sure.\n<tool_call>\n<function=get_wea"
    r = parse(Qwen3CoderParser, text)
    assert r.calls == []
    assert r.content == text


QWEN3_CODER_TEMPLATE = (
    "{{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO "
    "suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n"
    "<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}"
    "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{{- '<parameter=' + args_name + '>\\n' }}{{- args_value }}{{- '\\n</parameter>\\n' }}"
    "{{- '</function>\\n</tool_call>' }}"
)


def test_qwen3_coder_detected_before_hermes() -> None:
    assert detect_tool_parser(QWEN3_CODER_TEMPLATE, "qwen3_moe", set()) is Qwen3CoderParser
    hermes = '{{- \'<tool_call>\\n{"name": "\' }}{{- tool_call.name }}'
    assert detect_tool_parser(hermes, "qwen3", set()) is HermesParser
    assert get_tool_parser("qwen3_xml") is Qwen3CoderParser


# --- GLM 4.5 / 4.6 / 4.7 ------------------------------------------------------


def glm_call(name: str, sep: str, **params: str) -> str:
    body = "".join(
        f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}" for k, v in params.items()
    )
    return f"<tool_call>{name}{sep}{body}</tool_call>"


@pytest.mark.parametrize("sep", ["\n", ""], ids=["glm45", "glm47"])
def test_glm_one_and_several_calls(sep: str) -> None:
    paris = glm_call("get_weather", sep, city="Paris", days="3", metric="true")
    tokyo = glm_call("get_weather", sep, city="Tokyo", days="1", metric="false")
    assert parse(Glm45Parser, paris).calls == [PARIS]
    r = parse(Glm45Parser, f"Let me look.\n{paris}\n{tokyo}\nBoth done.")
    assert r.calls == [PARIS, TOKYO]
    assert r.content == "Let me look.\n\n\nBoth done."


def test_glm_schema_types_and_raw_strings() -> None:
    text = glm_call(
        "write_file",
        "\n",
        path=" /tmp/with space ",  # string values are kept exactly
        content='{"not": "parsed"}',
        mode="7",
        tags='["x"]',
        meta='{"k": [1, 2]}',
    )
    r = parse(Glm45Parser, text)
    assert r.calls == [
        (
            "write_file",
            {
                "path": " /tmp/with space ",
                "content": '{"not": "parsed"}',
                "mode": 7,
                "tags": ["x"],
                "meta": {"k": [1, 2]},
            },
        )
    ]


def test_glm_call_without_arguments() -> None:
    assert parse(Glm45Parser, "<tool_call>get_time</tool_call>").calls == [("get_time", {})]
    assert parse(Glm45Parser, "<tool_call>get_time\n</tool_call>").calls == [("get_time", {})]


def test_glm_malformed_is_text() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    r = parse(Glm45Parser, text)
    assert r.calls == []
    assert r.content == text


def test_glm_unknown_tool_is_text() -> None:
    text = glm_call("launch_rockets", "\n", count="3")
    r = parse(Glm45Parser, text)
    assert r.calls == []
    assert r.content == text


def test_glm_truncated_call_is_not_a_call() -> None:
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"
    r = parse(Glm45Parser, text)
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": "Par'))
    assert (r.whole.calls, r.whole.content) == ([], text)
    text = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_k"
    r = parse(Glm45Parser, text)
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": "Paris"'))
    assert (r.whole.calls, r.whole.content) == ([], text)


GLM_TEMPLATE = (
    "For each function call, output the function name and arguments within the following "
    "XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
    "<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>{%- endif -%}"
    "{{ '\\n<tool_call>' + tc.name }}\n{% for k, v in _args.items() %}\n"
    "<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v | tojson(ensure_ascii=False) if v is not "
    "string else v }}</arg_value>\n{% endfor %}\n</tool_call>"
)


def test_glm_detected_before_hermes() -> None:
    assert detect_tool_parser(GLM_TEMPLATE, "glm4_moe", set()) is Glm45Parser
    assert get_tool_parser("glm47") is Glm45Parser
    assert get_tool_parser("glm4_moe") is Glm45Parser


# --- MiniMax M2 --------------------------------------------------------------


def invoke(name: str, **params: str) -> str:
    body = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in params.items())
    return f'<invoke name="{name}">\n{body}</invoke>\n'


MINIMAX = (
    "<minimax:tool_call>\n"
    + invoke("get_weather", city="Paris", days="3", metric="true")
    + invoke("get_weather", city="Tokyo", days="1", metric="false")
    + "</minimax:tool_call>"
)


def test_minimax_one_call() -> None:
    text = "<minimax:tool_call>\n" + invoke("get_weather", city="Paris", days="3", metric="true")
    r = parse(MiniMaxM2Parser, text + "</minimax:tool_call>")
    assert r.calls == [PARIS]
    assert r.content == ""


def test_minimax_several_calls_in_one_block_and_text_around() -> None:
    r = parse(MiniMaxM2Parser, "Checking both.\n" + MINIMAX + "\nThat is all.")
    assert r.calls == [PARIS, TOKYO]
    assert r.content == "Checking both.\n\nThat is all."


def test_minimax_schema_types() -> None:
    body = invoke("write_file", path="a.txt", content="\nkept\n", ratio="1.5", meta='{"a": null}')
    r = parse(MiniMaxM2Parser, "<minimax:tool_call>\n" + body + "</minimax:tool_call>")
    # One newline on each side of a value is layout, not value.
    assert r.calls == [
        ("write_file", {"path": "a.txt", "content": "kept", "ratio": 1.5, "meta": {"a": None}})
    ]


def test_minimax_malformed_is_text() -> None:
    text = "<minimax:tool_call>\n<call get_weather>\n</minimax:tool_call>"
    r = parse(MiniMaxM2Parser, text)
    assert r.calls == []
    assert r.content == text


def test_minimax_unknown_tool_is_text() -> None:
    text = "<minimax:tool_call>\n" + invoke("launch_rockets", count="3") + "</minimax:tool_call>"
    r = parse(MiniMaxM2Parser, text)
    assert r.calls == []
    assert r.content == text


def test_minimax_unknown_second_call_is_text_after_the_first() -> None:
    text = (
        "<minimax:tool_call>\n"
        + invoke("get_weather", city="Paris", days="3", metric="true")
        + invoke("launch_rockets", count="3")
        + "</minimax:tool_call>"
    )
    r = parse(MiniMaxM2Parser, text)
    assert r.calls == [PARIS]
    assert r.content == "\n" + invoke("launch_rockets", count="3") + "</minimax:tool_call>"


def test_minimax_truncated_call_is_not_a_call() -> None:
    text = '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</pa'
    r = parse(MiniMaxM2Parser, text)
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": "Paris'))
    assert (r.whole.calls, r.whole.content) == ([], text)
    # The second call of a block: its own text.
    second = '<invoke name="write_file">\n<parameter name="mode">64'
    r = parse(MiniMaxM2Parser, "<minimax:tool_call>\n" + invoke("get_time") + second)
    assert (r.calls, r.cut) == ([("get_time", {})], ("write_file", ""))
    assert (r.whole.calls, r.whole.content) == (r.calls, second)


MINIMAX_TEMPLATE = (
    "{%- set toolcall_begin_token   = '<minimax:tool_call>'         -%}\n"
    "{%- set toolcall_end_token     = '</minimax:tool_call>'        -%}\n"
    "{{- '\\n' ~ toolcall_begin_token }}\n<invoke name=\"tool-name-1\">\n"
    '<parameter name="param-key-1">param-value-1</parameter>\n...\n</invoke>\n'
    "{{- '<invoke name=\"' + tool_call.name + '\">\\n' }}"
)


def test_minimax_detected() -> None:
    assert detect_tool_parser(MINIMAX_TEMPLATE, "minimax_m2", set()) is MiniMaxM2Parser
    assert get_tool_parser("minimax") is MiniMaxM2Parser


# --- DeepSeek V3.2 (DSML) ----------------------------------------------------


def dsml_invoke(name: str, *params: tuple[str, str, str]) -> str:
    body = "\n".join(
        f'<｜DSML｜parameter name="{k}" string="{s}">{v}</｜DSML｜parameter>' for k, s, v in params
    )
    return f'\n<｜DSML｜invoke name="{name}">\n{body}\n</｜DSML｜invoke>'


DSML_PARIS = dsml_invoke(
    "get_weather", ("city", "true", "Paris"), ("days", "false", "3"), ("metric", "false", "true")
)
DSML_TOKYO = dsml_invoke(
    "get_weather", ("city", "true", "Tokyo"), ("days", "false", "1"), ("metric", "false", "false")
)


def dsml(*invokes: str) -> str:
    return "\n\n<｜DSML｜function_calls>" + "".join(invokes) + "\n</｜DSML｜function_calls>"


def test_deepseek_v32_one_and_several_calls() -> None:
    assert parse(DeepSeekV32Parser, dsml(DSML_PARIS)).calls == [PARIS]
    r = parse(DeepSeekV32Parser, "Checking." + dsml(DSML_PARIS, DSML_TOKYO) + "\nDone.")
    assert r.calls == [PARIS, TOKYO]
    assert r.content == "Checking.\n\n\nDone."


def test_deepseek_v32_string_attribute_decides_the_type() -> None:
    text = dsml(
        dsml_invoke(
            "write_file",
            ("path", "true", "007"),  # a string, though it reads as a number
            ("mode", "true", "420"),  # the attribute wins over the schema
            ("tags", "false", '["a"]'),
            ("meta", "false", "oops"),  # unreadable JSON: the text
        )
    )
    r = parse(DeepSeekV32Parser, text)
    assert r.calls == [
        ("write_file", {"path": "007", "mode": "420", "tags": ["a"], "meta": "oops"})
    ]


def test_deepseek_v32_malformed_unknown_truncated() -> None:
    bad = dsml(
        '\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter city>x</｜DSML｜parameter>'
    )
    r = parse(DeepSeekV32Parser, bad)
    assert r.calls == [("get_weather", {})]  # the call was open: closed, the rest is text
    assert r.content.startswith("\n\n\n<｜DSML｜parameter city>")
    unknown = dsml(dsml_invoke("launch_rockets", ("n", "false", "3")))
    r = parse(DeepSeekV32Parser, unknown)
    assert (r.calls, r.content) == ([], unknown)
    cut = dsml(DSML_PARIS)[:-60]
    r = parse(DeepSeekV32Parser, cut)
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": "Paris", "days": 3'))
    assert (r.whole.calls, r.whole.content) == ([], cut)


DSML_TEMPLATE = (
    '{%- set dsml_token = "｜DSML｜" -%}\n'
    'You can invoke functions by writing a "<{{ dsml_token }}function_calls>" block like the '
    "following as part of your reply to the user:\n<{{ dsml_token }}function_calls>\n"
    '<{{ dsml_token }}invoke name="$FUNCTION_NAME">\n'
)


def test_deepseek_v32_detected() -> None:
    assert detect_tool_parser(DSML_TEMPLATE, "deepseek_v32", set()) is DeepSeekV32Parser


# --- values by schema --------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "schema", "value"),
    [
        ("123", {"type": "string"}, "123"),
        ("true", {"type": "string"}, "true"),
        ("5", {"type": "integer"}, 5),
        ("-2.5e3", {"type": "number"}, -2500.0),
        ("true", {"type": "boolean"}, True),
        ("False", {"type": "boolean"}, False),
        ("null", {"type": "null"}, None),
        ("None", {"type": ["integer", "null"]}, None),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("(1, 2)", {"type": "array"}, [1, 2]),
        (' {"a": 1} ', {"type": "object"}, {"a": 1}),
        ("abc", {"type": "integer"}, "abc"),  # unreadable: the text
        ("NaN", {"type": "number"}, "NaN"),  # not JSON
        ("1e999", {"type": "number"}, "1e999"),
        ("{1, 2}", {"type": "array"}, "{1, 2}"),  # a Python set is no JSON value
        ("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 7),
        ("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x"),
        ("low", {"enum": ["low", "high"]}, "low"),
        ("42", None, 42),  # unknown parameter: JSON if it reads, else the text
        ("hello", None, "hello"),
        ("", {"type": "integer"}, ""),
    ],
)
def test_convert_value(raw: str, schema: Any, value: Any) -> None:
    assert convert_value(raw, schema) == value
    assert type(convert_value(raw, schema)) is type(value)


def test_call_ids_are_fresh_per_call() -> None:
    p = Qwen3CoderParser(TOOLS)
    d = p.feed(QWEN_PARIS + QWEN_TOKYO)
    d.merge(p.finish())
    ids = [c.id for c in collect_calls(d.calls)]
    assert len(set(ids)) == 2 and all(ids)
