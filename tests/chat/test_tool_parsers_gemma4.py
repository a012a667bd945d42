"""Gemma 4's native tool calls and its thought channel.

Transcripts follow Gemma 4's chat template: calls are written back as
`<|tool_call>call:NAME{key:value,...}<tool_call|>` with strings between `<|"|>` tokens,
thinking as `<|channel>thought\\n...<channel|>` before the answer.
"""

from __future__ import annotations

import json
import random

import pytest
from support.parser_harness import check_split_invariance, random_pieces

from pippin.chat.reasoning import Gemma4ReasoningParser, detect_reasoning_parser
from pippin.chat.tool_parsers import detect_tool_parser, get_tool_parser
from pippin.chat.tool_parsers.gemma4 import Gemma4Parser

Q = '<|"|>'
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {}}}
    for n in ("get_current_weather", "book_table")
]
WEATHER = (
    "<|tool_call>call:get_current_weather"
    f"{{location:{Q}London, UK{Q},unit:{Q}celsius{Q}}}<tool_call|>"
)


def gemma4() -> Gemma4Parser:
    return Gemma4Parser(TOOLS)


def check(text: str, make=gemma4):  # type: ignore[no-untyped-def]
    r = check_split_invariance(make, text)
    for raw in r.raw_args:
        assert isinstance(json.loads(raw), dict)
    return r


def test_one_call() -> None:
    r = check(WEATHER)
    assert r.calls == [("get_current_weather", {"location": "London, UK", "unit": "celsius"})]
    assert r.content == ""


def test_several_calls_back_to_back_with_all_value_kinds() -> None:
    booking = (
        "<|tool_call>call:book_table{"
        f"date:{Q}2025-06-01{Q},guests:4,outdoor:false,budget:-12.5e1,notes:null,"
        f"prefs:{{seating:{Q}window{Q},quiet:true,floors:[1,2]}},"
        f"names:[{Q}Ana{Q},{Q}Bo{Q}],nested:[[1],{{a:{{}}}}],empty:[]"
        "}<tool_call|>"
    )
    r = check(WEATHER + booking)
    assert r.calls == [
        ("get_current_weather", {"location": "London, UK", "unit": "celsius"}),
        (
            "book_table",
            {
                "date": "2025-06-01",
                "guests": 4,
                "outdoor": False,
                "budget": -125.0,
                "notes": None,
                "prefs": {"seating": "window", "quiet": True, "floors": [1, 2]},
                "names": ["Ana", "Bo"],
                "nested": [[1], {"a": {}}],
                "empty": [],
            },
        ),
    ]
    assert r.content == ""


def test_strings_are_raw_text() -> None:
    # Quotes, braces, commas, backslashes and newlines inside <|"|> need no escaping.
    value = 'He said "hi", {x} [y]: C:\\dir\n<|tool <b>'
    r = check(f"<|tool_call>call:get_current_weather{{location:{Q}{value}{Q}}}<tool_call|>")
    assert r.calls == [("get_current_weather", {"location": value})]


def test_quoted_keys() -> None:
    r = check(f"<|tool_call>call:get_current_weather{{{Q}location{Q}:{Q}Paris{Q}}}<tool_call|>")
    assert r.calls == [("get_current_weather", {"location": "Paris"})]


def test_text_before_and_after() -> None:
    r = check(f"Let me look that up.\n{WEATHER}\nChecking now.")
    assert r.calls == [("get_current_weather", {"location": "London, UK", "unit": "celsius"})]
    assert r.content == "Let me look that up.\n\nChecking now."


@pytest.mark.parametrize(
    "text",
    [
        f"<|tool_call>get_current_weather{{location:{Q}Paris{Q}}}<tool_call|>",
        f"<|tool_call>call:get current weather{{location:{Q}Paris{Q}}}<tool_call|>",
        "<|tool_call>",
        "<|tool_call>call:get_current_weather",
    ],
)
def test_malformed_is_text(text: str) -> None:
    r = check(text)
    assert (r.content, r.calls) == (text, [])


def test_arguments_going_wrong_close_the_call() -> None:
    r = check(f"<|tool_call>call:get_current_weather{{unit:{Q}c{Q},days:3 location:x}}<tool_call|>")
    assert r.calls == [("get_current_weather", {"unit": "c", "days": 3})]
    assert r.content == "location:x}<tool_call|>"


def test_end_marker_closes_unfinished_arguments() -> None:
    r = check(f"<|tool_call>call:get_current_weather{{location:{Q}Paris{Q},days:3<tool_call|>ok")
    assert r.calls == [("get_current_weather", {"location": "Paris", "days": 3})]
    assert r.content == "ok"


def test_unknown_tool_is_text() -> None:
    text = f"<|tool_call>call:send_email{{to:{Q}bob@example.com{Q}}}<tool_call|>"
    r = check(text)
    assert (r.content, r.calls) == (text, [])
    r = check(WEATHER + text)
    assert len(r.calls) == 1
    assert r.content == text


@pytest.mark.parametrize(
    ("cut", "sent"),
    [
        (f"location:{Q}Lond", '{"location":"Lond'),
        (f"location:{Q}London{Q}", '{"location":"London"'),
        ("location:", '{"location":'),
        ("days:3", '{"days":'),  # a number cut short may be missing digits: not sent
        ("loc", "{"),
        ("prefs:{floors:[1,2", '{"prefs":{"floors":['),
        (f"prefs:{{seating:{Q}win", '{"prefs":{"seating":"win'),
        (f"location:{Q}Paris{Q}<tool_ca", '{"location":"Paris"'),  # in the end marker
    ],
)
def test_truncated_arguments(cut: str, sent: str) -> None:
    # A call the output ends inside is no call: streamed, what was sent of it stays
    # (nothing closes it); answered whole, it is text.
    text = "<|tool_call>call:get_current_weather{" + cut
    r = check(text)
    assert (r.calls, r.content, r.cut) == ([], "", ("get_current_weather", sent))
    assert (r.whole.calls, r.whole.content) == ([], text)
    r = check(WEATHER + "Then " + text)
    assert r.whole.content == "Then " + text and len(r.whole.calls) == 1


def test_arguments_stream_per_value() -> None:
    p = gemma4()
    d = p.feed(f"<|tool_call>call:get_current_weather{{location:{Q}Lon")
    assert [(c.name, c.arguments) for c in d.calls] == [("get_current_weather", '{"location":"Lon')]
    d = p.feed(f"don{Q},unit:")
    assert [c.arguments for c in d.calls] == ['don","unit":']


def test_any_name_without_tools() -> None:
    r = check(f"<|tool_call>call:send_email{{to:{Q}a@b.c{Q}}}<tool_call|>", make=Gemma4Parser)
    assert r.calls == [("send_email", {"to": "a@b.c"})]


# --- thinking: the thought channel, then the answer or calls --------------------

THOUGHT = (
    "<|channel>thought\n"
    "The user wants the weather in London. I have get_current_weather, which takes a "
    "location and a unit. I'll call it with celsius.\n"
    "<channel|>"
)


def split_reasoning(pieces: list[str], open_in_prompt: bool = False) -> tuple[str, str]:
    p = Gemma4ReasoningParser(open_in_prompt)
    reasoning = content = ""
    for piece in pieces:
        r, c = p.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = p.finish()
    return reasoning + r, content + c


def check_reasoning(text: str) -> tuple[str, str]:
    whole = split_reasoning([text])
    assert split_reasoning(list(text)) == whole
    rng = random.Random(1234)
    for _ in range(30):
        assert split_reasoning(random_pieces(text, rng)) == whole
    return whole


def test_reasoning_then_call() -> None:
    reasoning, content = check_reasoning(THOUGHT + WEATHER)
    assert reasoning.startswith("The user wants the weather in London.")
    assert reasoning.endswith("with celsius.\n")
    assert content == WEATHER
    r = check(content)
    assert r.calls == [("get_current_weather", {"location": "London, UK", "unit": "celsius"})]


def test_reasoning_then_answer() -> None:
    text = "<|channel>thought\nSimple greeting; answer briefly.<channel|>Hello! How can I help?"
    assert check_reasoning(text) == ("Simple greeting; answer briefly.", "Hello! How can I help?")


def test_thinking_off() -> None:
    # With thinking off the template closes an empty channel in the prompt itself.
    prompt = "<|turn>model\n<|channel>thought\n<channel|>"
    assert not Gemma4ReasoningParser.open_in_prompt(prompt)
    assert check_reasoning("The weather is mild.") == ("", "The weather is mild.")


# --- choosing the parser --------------------------------------------------------

GEMMA4 = (
    "{%- for tool in tools %}{{- '<|tool>' -}}{{- format_function_declaration(tool) | trim -}}"
    "{{- '<tool|>' -}}{%- endfor %}\n"
    "{{- '<|tool_call>call:' + function['name'] + '{' -}}\n"
    "{{- key -}}:{{- format_argument(value, escape_keys=False) -}}\n"
    "{{- '}<tool_call|>' -}}\n"
    "{{- '<|tool_response>' -}}\n"
    "{{- '<|\"|>' + argument + '<|\"|>' -}}\n"
    "{{- '<|turn>model\\n' -}}{{- '<|channel>thought\\n<channel|>' -}}"
)


def test_detect() -> None:
    vocab = {"<|tool_call>", "<tool_call|>", '<|"|>', "<|channel>", "<channel|>"}
    assert detect_tool_parser(GEMMA4, "gemma4", vocab) is Gemma4Parser
    assert detect_reasoning_parser(GEMMA4, vocab) == "gemma4"


def test_names() -> None:
    assert get_tool_parser("gemma4") is Gemma4Parser
    assert set(Gemma4Parser.special_tokens) == {"<|tool_call>", "<tool_call|>", Q}
