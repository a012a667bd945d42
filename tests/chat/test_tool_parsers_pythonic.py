"""Pythonic calls: Llama 3.2 / 4 pythonic templates, LFM2, Olmo 3, Gemma 3 tool_code blocks.

Transcripts follow how each template writes calls back into the prompt (vLLM's
`tool_chat_template_llama3.2_pythonic.jinja`, `..._llama4_pythonic.jinja`,
`..._olmo3.jinja`, LFM2's model card, Google's Gemma function-calling guide).
"""

from __future__ import annotations

import json

import pytest
from support.parser_harness import check_split_invariance

from pippin.chat.tool_parsers import detect_tool_parser, get_tool_parser
from pippin.chat.tool_parsers.pythonic import (
    Gemma3Parser,
    Olmo3Parser,
    PythonicParser,
    parse_call,
)

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {}}}
    for n in ("get_weather", "get_time", "search")
]


def pythonic() -> PythonicParser:
    return PythonicParser(TOOLS)


def check(make, text: str):  # type: ignore[no-untyped-def]
    r = check_split_invariance(make, text)
    for raw in r.raw_args:
        assert isinstance(json.loads(raw), dict)
    return r


# --- Llama 3.2 / Llama 4: a bare list opening the answer ---------------------


def test_one_call() -> None:
    r = check(pythonic, '[get_weather(city="Paris", days=3)]')
    assert r.calls == [("get_weather", {"city": "Paris", "days": 3})]
    assert r.content == ""


def test_several_calls_with_nested_literals() -> None:
    text = (
        "[get_weather(city=\"San Francisco, CA\", unit='celsius'), "
        'search(q="a) ] [ (\\"quoted\\"", tags=["x", "y"], limits={"n": 5, "ok": True}, '
        'page=None, ratio=-0.5, doc="""two\nlines"""), get_time(tz="Asia/Tokyo")]'
    )
    r = check(pythonic, text)
    assert r.calls == [
        ("get_weather", {"city": "San Francisco, CA", "unit": "celsius"}),
        (
            "search",
            {
                "q": 'a) ] [ ("quoted"',
                "tags": ["x", "y"],
                "limits": {"n": 5, "ok": True},
                "page": None,
                "ratio": -0.5,
                "doc": "two\nlines",
            },
        ),
        ("get_time", {"tz": "Asia/Tokyo"}),
    ]
    assert r.content == ""


def test_json_literals_and_leading_whitespace() -> None:
    # Templates render nested values as JSON, so models copy true/false/null.
    r = check(pythonic, '\n [get_weather(city="Paris", metric=true, extra=null, f=[false])]')
    assert r.calls == [
        ("get_weather", {"city": "Paris", "metric": True, "extra": None, "f": [False]})
    ]


def test_text_after_the_list_is_content() -> None:
    r = check(pythonic, '[get_time(tz="UTC")]\nI asked for the time.')
    assert r.calls == [("get_time", {"tz": "UTC"})]
    assert r.content == "\nI asked for the time."


def test_list_not_at_start_is_text() -> None:
    # Llama 4's template calls this INCORRECT; a list quoted in prose is not a call.
    text = 'Let me check the weather: [get_weather(city="New York")]'
    r = check(pythonic, text)
    assert (r.content, r.calls) == (text, [])


@pytest.mark.parametrize(
    "text",
    [
        '[get_weather("Paris")]',  # positional
        "[get_weather(city=paris)]",  # not a literal
        "[get_weather(city=f(1))]",
        "[get_weather(**{'city': 'Paris'})]",
        "[get_weather(city={1, 2})]",  # a set is not JSON
        "[1, 2, 3]",
        "[Note] the weather is nice.",
        "[get weather(city='Paris')]",
        "[get_weather(city='Par\nis')]",
    ],
)
def test_malformed_is_text(text: str) -> None:
    r = check(pythonic, text)
    assert (r.content, r.calls) == (text, [])


def test_unclosed_list_keeps_its_calls() -> None:
    r = check(pythonic, "[get_weather(city='Paris')")
    assert (r.content, r.calls) == ("", [("get_weather", {"city": "Paris"})])


def test_unknown_tool_is_text() -> None:
    r = check(pythonic, '[send_email(to="bob@example.com")]')
    assert (r.content, r.calls) == ('[send_email(to="bob@example.com")]', [])
    # After a good call the rest of the list comes back as text.
    r = check(pythonic, '[get_time(tz="UTC"), send_email(to="bob@example.com")]')
    assert r.calls == [("get_time", {"tz": "UTC"})]
    assert r.content == ', send_email(to="bob@example.com")]'


def test_any_name_without_tools() -> None:
    r = check(lambda: PythonicParser(), '[send_email(to="bob@example.com")]')
    assert r.calls == [("send_email", {"to": "bob@example.com"})]


def test_truncated_call() -> None:
    # Calls are reported whole when their parenthesis closes: one cut short is text.
    text = '[get_weather(city="Paris"), get_time(tz="Europe/Lon'
    r = check(pythonic, text)
    assert r.calls == [("get_weather", {"city": "Paris"})]
    assert r.content == ', get_time(tz="Europe/Lon'
    assert r.raw_args == ['{"city": "Paris"}']
    # Nothing of it was sent, so streamed and answered whole agree.
    assert r.cut is None and r.whole == r


def test_nothing_is_held_back_from_plain_text() -> None:
    p = pythonic()
    assert p.feed("The answer is 4").content == "The answer is 4"
    p = pythonic()
    assert p.feed("[get_weather(").content == ""  # may be a call: held


def test_arguments_arrive_per_call() -> None:
    p = pythonic()
    d = p.feed('[get_weather(city="Paris"), get_ti')
    assert [(c.name, c.arguments) for c in d.calls] == [("get_weather", '{"city": "Paris"}')]
    d = p.feed('me(tz="UTC")]')
    assert [(c.index, c.name, c.arguments) for c in d.calls] == [(1, "get_time", '{"tz": "UTC"}')]
    assert p.called


def test_llama4_python_start() -> None:
    r = check(pythonic, '<|python_start|>[get_weather(city="Paris")]<|python_end|>')
    assert r.calls == [("get_weather", {"city": "Paris"})]
    assert r.content == ""


# --- LFM2: marked list anywhere ------------------------------------------------


def test_lfm2_markers_with_text_around() -> None:
    text = (
        "Let me look that up.<|tool_call_start|>"
        '[get_weather(city="Paris"), get_time(tz="Europe/Paris")]'
        "<|tool_call_end|>Checking the weather and time in Paris."
    )
    r = check(pythonic, text)
    assert r.calls == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "Europe/Paris"}),
    ]
    assert r.content == "Let me look that up.Checking the weather and time in Paris."


def test_lfm2_malformed_gives_marker_back() -> None:
    text = "<|tool_call_start|>[get_weather(Paris)]<|tool_call_end|>"
    r = check(pythonic, text)
    assert (r.content, r.calls) == (text, [])


def test_lfm2_truncated() -> None:
    r = check(pythonic, '<|tool_call_start|>[get_weather(city="Paris"), get_time(tz=')
    assert r.calls == [("get_weather", {"city": "Paris"})]
    assert r.content == ", get_time(tz="


# --- Olmo 3 ---------------------------------------------------------------------


def test_olmo3_lines() -> None:
    text = (
        "<function_calls>\n"
        "get_weather(city='New York', units='celsius')\n"
        "get_time(tz=null, verbose=true)\n"
        "</function_calls>"
    )
    r = check(lambda: Olmo3Parser(TOOLS), text)
    assert r.calls == [
        ("get_weather", {"city": "New York", "units": "celsius"}),
        ("get_time", {"tz": None, "verbose": True}),
    ]
    assert r.content == ""


def test_olmo3_malformed_and_unknown() -> None:
    text = "<function_calls>\nget_weather('New York')\n</function_calls>"
    assert check(lambda: Olmo3Parser(TOOLS), text).content == text
    text = "<function_calls>\nbook(city='Rome')\n</function_calls>"
    assert check(lambda: Olmo3Parser(TOOLS), text).content == text


# --- Gemma 3: ```tool_code blocks -------------------------------------------------


def gemma3() -> Gemma3Parser:
    return Gemma3Parser(TOOLS)


def test_gemma3_block_with_text_around() -> None:
    text = (
        "I'll check the weather for you.\n"
        "```tool_code\n"
        'get_weather(city="London", unit="celsius")\n'
        "```\n"
        "One moment."
    )
    r = check(gemma3, text)
    assert r.calls == [("get_weather", {"city": "London", "unit": "celsius"})]
    assert r.content == "I'll check the weather for you.\n\nOne moment."


def test_gemma3_several_calls_and_blocks() -> None:
    text = (
        "```tool_code\n"
        'get_weather(city="London")\n'
        'get_time(tz="Europe/London")\n'
        "```\n"
        "and\n"
        "```tool_code\n"
        '[search(q="events in London"), search(q="museums")]\n'
        "```"
    )
    r = check(gemma3, text)
    assert r.calls == [
        ("get_weather", {"city": "London"}),
        ("get_time", {"tz": "Europe/London"}),
        ("search", {"q": "events in London"}),
        ("search", {"q": "museums"}),
    ]
    assert r.content == "\nand\n"


def test_gemma3_other_code_blocks_and_malformed() -> None:
    text = "```python\nprint(get_weather(city='x'))\n```"
    assert check(gemma3, text).content == text
    text = "```tool_code\nx = get_weather(city='London')\n```"
    assert check(gemma3, text).content == text
    text = '```tool_code\nsend_email(to="a@b.c")\n```'
    assert check(gemma3, text).content == text


def test_gemma3_truncated() -> None:
    r = check(gemma3, '```tool_code\nget_weather(city="London")\nget_time(tz="Eur')
    assert r.calls == [("get_weather", {"city": "London"})]
    assert r.content == '\nget_time(tz="Eur'


# --- the call parser itself -----------------------------------------------------


def test_parse_call() -> None:
    assert parse_call('f(a=1, b="x")') == '{"a": 1, "b": "x"}'
    assert parse_call("f(a=(1, 2), b={'k': [None]})") == '{"a": [1, 2], "b": {"k": [null]}}'
    assert parse_call("f(a='é')") == '{"a": "é"}'
    assert parse_call("f()") == "{}"
    for bad in ("f(1)", "f(a=1e999)", "f(a=b'x')", "f(a=1 +)", "f(a=x.y)", "1 + 2"):
        assert parse_call(bad) is None


# --- choosing the parser --------------------------------------------------------

LLAMA32_PYTHONIC = (
    '{{- "Environment: ipython\\n" }}\n'
    '{{- "You have access to the following functions. To call functions, please respond '
    'with a python list of the calls. " }}\n'
    "{{- 'Respond in the format [func_name1(params_name1=params_value1, "
    "params_name2=params_value2...), func_name2(params)] ' }}\n"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n[' -}}\n"
    "{{- ']<|eot_id|>' -}}"
)
LLAMA4_PYTHONIC = (
    "- Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]\\n"
    "{{- '<|header_start|>assistant<|header_end|>\\n\\n' -}}{{- \"]<|eot|>\" }}"
)
LFM2 = (
    "{%- if tools -%}{{- 'List of tools: <|tool_list_start|>[' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{%- endfor -%}"
    "{{- ']<|tool_list_end|>' -}}{%- endif -%}"
)
OLMO3 = (
    '{{- "\\n\\nYou have access to the following functions. To call functions, respond with '
    'a pythonic function call wrapped in <function_calls></function_calls> XML tags." }}'
    '{{- "<|im_start|>assistant\\n<function_calls>\\n" }}'
)


@pytest.mark.parametrize(
    ("template", "model_type", "vocab", "expected"),
    [
        (LLAMA32_PYTHONIC, "llama", {"<|python_tag|>"}, PythonicParser),
        (LLAMA4_PYTHONIC, "llama4", set(), PythonicParser),
        (LFM2, "lfm2", {"<|tool_call_start|>", "<|tool_call_end|>"}, PythonicParser),
        ("{{ messages }}", "lfm2", {"<|tool_call_start|>", "<|tool_call_end|>"}, PythonicParser),
        (OLMO3, "olmo3", set(), Olmo3Parser),
        ("<start_of_turn>user\n{{ content }}<end_of_turn>", "gemma3_text", set(), None),
    ],
)
def test_detect(template: str, model_type: str, vocab: set[str], expected: type | None) -> None:
    assert detect_tool_parser(template, model_type, vocab) is expected


def test_names() -> None:
    assert get_tool_parser("llama4_pythonic") is PythonicParser
    assert get_tool_parser("pythonic") is PythonicParser
    assert get_tool_parser("olmo3") is Olmo3Parser
    for name in ("gemma3", "gemma_pythonic", "gemma"):
        assert get_tool_parser(name) is Gemma3Parser
    assert "<|tool_call_start|>" in PythonicParser.special_tokens
