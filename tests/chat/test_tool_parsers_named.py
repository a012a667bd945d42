"""A function name, then a raw JSON arguments object: DeepSeek V3 / R1 and V3.1, Kimi K2,
Functionary v3.1 / v3.2.

Transcripts follow each family's chat template (how it writes calls back into the
prompt): DeepSeek-V3's and V3.1's templates (vLLM's examples, llama.cpp's copies),
Kimi-K2-Thinking's, meetkai's functionary-medium-v3.1 / v3.2 templates.
"""

from __future__ import annotations

import json

import pytest
from support.parser_harness import check_split_invariance

from pippin.chat.tool_parsers import detect_tool_parser, get_tool_parser
from pippin.chat.tool_parsers.base import ParsedDelta, ToolParser, collect_calls
from pippin.chat.tool_parsers.named_json import (
    DeepSeekV3Parser,
    DeepSeekV31Parser,
    FunctionaryParser,
    KimiK2Parser,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]
PARIS_ARGS = '{"city": "Paris", "unit": "celsius"}'
TOKYO_ARGS = '{"tz": "Asia/Tokyo"}'
PARIS = ("get_weather", {"city": "Paris", "unit": "celsius"})
TOKYO = ("get_time", {"tz": "Asia/Tokyo"})


def parse(cls: type, text: str, tools: list | None = TOOLS):  # type: ignore[no-untyped-def]
    result = check_split_invariance(lambda: cls(tools), text)
    for raw in result.raw_args:
        assert isinstance(json.loads(raw), dict)
    return result


def whole(p: ToolParser, text: str) -> ParsedDelta:
    d = p.feed(text)
    d.merge(p.finish())
    return d


# --- DeepSeek V3 / R1 ---------------------------------------------------------

DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds3_call(name: str, args: str) -> str:
    head = f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}"
    return f"{head}\n```json\n{args}\n```<｜tool▁call▁end｜>"


DS3_PARIS = DS_BEGIN + ds3_call("get_weather", PARIS_ARGS) + DS_END
DS3_BOTH = (
    DS_BEGIN
    + ds3_call("get_weather", PARIS_ARGS)
    + "\n"
    + ds3_call("get_time", TOKYO_ARGS)
    + DS_END
)


def test_deepseek_v3_one_call() -> None:
    r = parse(DeepSeekV3Parser, DS3_PARIS)
    assert r.calls == [PARIS]
    assert r.content == ""
    assert r.raw_args == [PARIS_ARGS]  # the model's own JSON text, streamed


def test_deepseek_v3_several_calls_and_text_around() -> None:
    r = parse(DeepSeekV3Parser, "Let me check." + DS3_BOTH + " Done.")
    assert r.calls == [PARIS, TOKYO]
    assert r.content == "Let me check. Done."


def test_deepseek_v3_streams_arguments() -> None:
    p = DeepSeekV3Parser(TOOLS)
    head = DS_BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    d = p.feed(head + '{"city": "Pa')
    assert d.calls[0].name == "get_weather"
    assert d.calls[0].arguments == '{"city": "Pa'


def test_deepseek_v3_malformed_is_text() -> None:
    text = DS_BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\nnot json" + DS_END
    r = parse(DeepSeekV3Parser, text)
    assert r.calls == []
    assert r.content == text


def test_deepseek_v3_unknown_tool_is_text() -> None:
    text = DS_BEGIN + ds3_call("launch_rockets", "{}") + DS_END
    r = parse(DeepSeekV3Parser, text)
    assert r.calls == []
    assert r.content == text


def test_deepseek_v3_truncated_call_is_not_a_call() -> None:
    # Streamed, what was sent of it stays (nothing closes it); answered whole, it is text.
    text = DS_BEGIN + "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
    r = parse(DeepSeekV3Parser, text + '{"city": "Par')
    assert (r.calls, r.content, r.cut) == ([], "", ("get_weather", '{"city": "Par'))
    assert (r.whole.calls, r.whole.content) == ([], text + '{"city": "Par')
    r = parse(DeepSeekV3Parser, text + '{"city": "Paris", "unit')
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": "Paris", "unit'))
    # The second call of a section: its own text.
    second = "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{"
    r = parse(DeepSeekV3Parser, DS_BEGIN + ds3_call("get_weather", PARIS_ARGS) + second)
    assert (r.whole.calls, r.whole.content) == ([PARIS], second)
    # Cut off after the arguments, in the closing markers: the call ended.
    r = parse(DeepSeekV3Parser, DS_BEGIN + ds3_call("get_weather", PARIS_ARGS) + "\n<｜tool▁ca")
    assert r.calls == [PARIS]
    assert r.content == ""


# --- DeepSeek V3.1 -----------------------------------------------------------


def ds31_call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


def test_deepseek_v31_one_and_several_calls() -> None:
    r = parse(DeepSeekV31Parser, DS_BEGIN + ds31_call("get_weather", PARIS_ARGS) + DS_END)
    assert r.calls == [PARIS]
    both = DS_BEGIN + ds31_call("get_weather", PARIS_ARGS) + ds31_call("get_time", TOKYO_ARGS)
    r = parse(DeepSeekV31Parser, "Checking." + both + DS_END + "Ok.")
    assert r.calls == [PARIS, TOKYO]
    assert r.content == "Checking.Ok."


def test_deepseek_v31_malformed_and_unknown_are_text() -> None:
    text = (
        DS_BEGIN
        + "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜>"
        + DS_END
    )
    assert parse(DeepSeekV31Parser, text).content == text
    text = DS_BEGIN + ds31_call("launch_rockets", "{}") + DS_END
    r = parse(DeepSeekV31Parser, text)
    assert (r.calls, r.content) == ([], text)


def test_deepseek_v31_bad_arguments_close_the_call() -> None:
    text = DS_BEGIN + '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"] oops'
    r = parse(DeepSeekV31Parser, text)
    assert r.calls == [("get_weather", {"city": "Paris"})]
    assert r.content == "] oops"


def test_deepseek_v31_truncated_call_is_not_a_call() -> None:
    text = DS_BEGIN + '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": ["Par'
    r = parse(DeepSeekV31Parser, text)
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": ["Par'))
    assert (r.whole.calls, r.whole.content) == ([], text)


DS3_TEMPLATE = (
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + "
    "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + "
    "'\\n' + '```' + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}"
)
DS31_TEMPLATE = (
    "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + "
    "'<｜tool▁sep｜>' + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
    "{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{{'<｜Assistant｜></think>'}}"
)


def test_deepseek_detection_tells_v3_from_v31() -> None:
    assert detect_tool_parser(DS3_TEMPLATE, "deepseek_v3", set()) is DeepSeekV3Parser
    assert detect_tool_parser(DS31_TEMPLATE, "deepseek_v3", set()) is DeepSeekV31Parser
    assert get_tool_parser("deepseek_r1") is DeepSeekV3Parser


# --- Kimi K2 -----------------------------------------------------------------

KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def kimi_call(ident: str, args: str, ws: str = "") -> str:
    return (
        f"<|tool_call_begin|>{ws}{ident}<|tool_call_argument_begin|>{ws}{args}{ws}<|tool_call_end|>"
    )


def test_kimi_k2_one_call_with_its_id() -> None:
    text = KIMI_BEGIN + kimi_call("functions.get_weather:0", PARIS_ARGS) + KIMI_END
    assert parse(KimiK2Parser, text).calls == [PARIS]
    calls = collect_calls(whole(KimiK2Parser(TOOLS), text).calls)
    assert [c.id for c in calls] == ["functions.get_weather:0"]


def test_kimi_k2_several_calls_and_text_around() -> None:
    both = kimi_call("functions.get_weather:0", PARIS_ARGS, "\n")
    both += "\n" + kimi_call("functions.get_time:1", TOKYO_ARGS, "\n")
    text = f"Let me help you with that.\n{KIMI_BEGIN}\n{both}\n{KIMI_END}\nThe weather is..."
    r = parse(KimiK2Parser, text)
    assert r.calls == [PARIS, TOKYO]
    assert r.content == "Let me help you with that.\n\nThe weather is..."
    ids = [c.id for c in collect_calls(whole(KimiK2Parser(TOOLS), text).calls)]
    assert ids == ["functions.get_weather:0", "functions.get_time:1"]


def test_kimi_k2_malformed_is_text() -> None:
    text = KIMI_BEGIN + kimi_call("functions.get weather:0", PARIS_ARGS) + KIMI_END
    r = parse(KimiK2Parser, text)
    assert (r.calls, r.content) == ([], text)


def test_kimi_k2_unknown_tool_is_text() -> None:
    text = KIMI_BEGIN + kimi_call("functions.launch_rockets:0", "{}") + KIMI_END
    r = parse(KimiK2Parser, text)
    assert (r.calls, r.content) == ([], text)


def test_kimi_k2_truncated_call_is_not_a_call() -> None:
    text = KIMI_BEGIN + "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    r = parse(KimiK2Parser, text + '{"city": "Paris", "unit": "cel')
    assert (r.calls, r.cut) == ([], ("get_weather", '{"city": "Paris", "unit": "cel'))
    assert (r.whole.calls, r.whole.content) == ([], text + '{"city": "Paris", "unit": "cel')


KIMI_TEMPLATE = (
    "{%- macro render_toolcalls(message) -%}\n  <|tool_calls_section_begin|>\n"
    "  {%- for tool_call in message['tool_calls'] -%}\n"
    "    {%- set formatted_id = tool_call['id'] -%}\n"
    "    <|tool_call_begin|>{{ formatted_id }}<|tool_call_argument_begin|>"
    "{{ tool_call['function']['arguments'] }}<|tool_call_end|>\n"
    "  {%- endfor -%}\n  <|tool_calls_section_end|>\n{%- endmacro -%}"
)


def test_kimi_k2_detected() -> None:
    assert detect_tool_parser(KIMI_TEMPLATE, "kimi_k2", set()) is KimiK2Parser


# --- Functionary v3.1 / v3.2 -------------------------------------------------


def test_functionary_v32_one_call() -> None:
    # The generation prompt ends with `>>>`: the output starts with the recipient.
    r = parse(FunctionaryParser, "get_weather\n" + PARIS_ARGS)
    assert (r.calls, r.content) == ([PARIS], "")


def test_functionary_v32_several_calls_and_text() -> None:
    text = f"all\nLet me check.>>>get_weather\n{PARIS_ARGS}>>>get_time\n{TOKYO_ARGS}"
    r = parse(FunctionaryParser, text)
    assert r.calls == [PARIS, TOKYO]
    assert r.content == "Let me check."
    text = f"get_weather\n{PARIS_ARGS}\n>>>all\nChecking the time too."
    r = parse(FunctionaryParser, text)
    assert r.calls == [PARIS]
    assert r.content == "\nChecking the time too."


def test_functionary_v32_plain_answers_are_text() -> None:
    assert parse(FunctionaryParser, "all\nHello there!").content == "Hello there!"
    assert parse(FunctionaryParser, "Hello there!").content == "Hello there!"
    doctest = "Try:\n>>> print(1)\n1"
    assert parse(FunctionaryParser, doctest).content == doctest


def test_functionary_v31_calls() -> None:
    text = f"<function=get_weather>{PARIS_ARGS}</function>"
    assert parse(FunctionaryParser, text).calls == [PARIS]
    text = "Sure." + text + f"<function=get_time>{TOKYO_ARGS}</function>"
    r = parse(FunctionaryParser, text)
    assert (r.calls, r.content) == ([PARIS, TOKYO], "Sure.")


def test_functionary_malformed_is_text() -> None:
    for text in (
        "get_weather\nnot json",
        "all\nok>>>get_weather\nnope",
        "<function=get weather>{}",
    ):
        r = parse(FunctionaryParser, text)
        assert r.calls == []
        assert r.content == text.removeprefix("all\n")


def test_functionary_unknown_tool_is_text() -> None:
    for text in ("launch_rockets\n{}", "<function=launch_rockets>{}</function>"):
        r = parse(FunctionaryParser, text)
        assert (r.calls, r.content) == ([], text)


def test_functionary_truncated_call_is_not_a_call() -> None:
    r = parse(FunctionaryParser, 'all\nOne sec.>>>get_weather\n{"city": "Pa')
    assert (r.calls, r.content, r.cut) == ([], "One sec.", ("get_weather", '{"city": "Pa'))
    assert r.whole.content == 'One sec.>>>get_weather\n{"city": "Pa'
    # A number cut off may have been longer: it is not sent.
    text = '<function=get_weather>{"unit": "c", "days": 12'
    r = parse(FunctionaryParser, text)
    assert (r.calls, r.cut) == ([], ("get_weather", '{"unit": "c", "days": '))
    assert (r.whole.calls, r.whole.content) == ([], text)


FUNCTIONARY_V32_TEMPLATE = (
    "{{ bos_token + '<|start_header_id|>system<|end_header_id|>\\n\\nYou are capable of "
    "executing available function(s) if required.\\nOnly execute function(s) when absolutely "
    "necessary.\\nAsk for the required input to:recipient==all\\nUse JSON for function "
    "arguments.\\nRespond in this format:\\n>>>${recipient}\\n${content}\\nAvailable "
    "functions:\\n' + generate_schema_from_functions(tools) + '<|eot_id|>' -}}"
    "{{ '>>>all\\n' + message['content'] }}"
    "{{ '>>>' + tool_call['function']['name'] + '\\n' + tool_call['function']['arguments'] }}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n>>>' }}"
)
FUNCTIONARY_V31_TEMPLATE = (
    '{%- if tool_call["function"]["name"] == "python" -%}'
    "{{ '<|python_tag|>' + tool_call['function']['arguments'] }}{%- else -%}"
    "{{ '<function=' + tool_call['function']['name'] + '>' + tool_call['function']['arguments']"
    " + '</function>' }}{%- endif -%}{{ '<|eom_id|>' }}"
)


def test_functionary_detected() -> None:
    assert detect_tool_parser(FUNCTIONARY_V32_TEMPLATE, "llama", set()) is FunctionaryParser
    assert detect_tool_parser(FUNCTIONARY_V31_TEMPLATE, "llama", set()) is FunctionaryParser
    assert get_tool_parser("functionary_v3") is FunctionaryParser


@pytest.mark.parametrize(
    "cls", [DeepSeekV3Parser, DeepSeekV31Parser, KimiK2Parser, FunctionaryParser]
)
def test_special_tokens_cover_the_markers(cls: type[ToolParser]) -> None:
    assert cls.special_tokens
    assert all(m in cls.special_tokens for m in cls.starts if m != ">>>")
