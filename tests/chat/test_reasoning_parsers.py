"""Reasoning parsers (think tags, Magistral, Granite, Gemma 4) and the output parser.

Transcripts are what each family writes: Qwen3 / QwQ / DeepSeek-R1 `<think>...</think>`
(where the template may already have opened the section: DeepSeek-R1 and Qwen3
thinking templates end the prompt with `<think>\\n`), Magistral `[THINK]...[/THINK]`,
Granite 3.2 "Here is my thought process: ... Here is my response:", Gemma 4's thought
channel `<|channel>thought ... <channel|>`.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from support.parser_harness import run_reasoning

from pippin.chat.output import OutputParser, ParserChoice
from pippin.chat.reasoning import (
    REASONING_PARSERS,
    DeepSeekR1ReasoningParser,
    Gemma4ReasoningParser,
    GlmReasoningParser,
    GraniteReasoningParser,
    MistralReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ThinkParser,
    detect_reasoning_parser,
)
from pippin.chat.tool_parsers.base import ParsedDelta, collect_calls
from pippin.chat.tool_parsers.tagged_json import HermesParser

THINK_PARSERS = [ThinkParser, Qwen3ReasoningParser, DeepSeekR1ReasoningParser, GlmReasoningParser]
ALL_PARSERS = [
    *THINK_PARSERS,
    MistralReasoningParser,
    GraniteReasoningParser,
    Gemma4ReasoningParser,
]


def check(
    cls: type[ReasoningParser], text: str, open_in_prompt: bool = False, leaks: bool = True
) -> tuple[str, str]:
    """(reasoning, content); whole, char by char and random splits agree."""
    make = lambda: cls(open_in_prompt)  # noqa: E731
    whole = run_reasoning(make, [text])
    assert run_reasoning(make, list(text)) == whole
    rng = random.Random(4321)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 25))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert run_reasoning(make, pieces) == whole
    if leaks:
        for part in whole:
            assert cls.start not in part and cls.end not in part
    return whole


def think(cls: type[ReasoningParser], reasoning: str, answer: str) -> str:
    """How each family writes a reasoning section and then its answer."""
    if cls is GraniteReasoningParser:
        return f"{cls.start}\n{reasoning}\n{cls.end}\n{answer}"
    if cls is Gemma4ReasoningParser:
        return f"{cls.start}\n{reasoning}{cls.end}{answer}"
    if cls is MistralReasoningParser:
        return f"{cls.start}{reasoning}{cls.end}{answer}"
    return f"{cls.start}\n{reasoning}\n{cls.end}\n\n{answer}"


REASONING = "The user asks for 17 * 23. 17 * 20 = 340, 17 * 3 = 51, so 391."
ANSWER = "17 × 23 = **391**."


@pytest.mark.parametrize("cls", ALL_PARSERS)
def test_reasoning_then_answer(cls: type[ReasoningParser]) -> None:
    reasoning, content = check(cls, think(cls, REASONING, ANSWER))
    assert reasoning.strip() == REASONING
    assert content == ANSWER


@pytest.mark.parametrize("cls", ALL_PARSERS)
def test_no_reasoning_at_all(cls: type[ReasoningParser]) -> None:
    assert check(cls, ANSWER) == ("", ANSWER)
    assert check(cls, "\n\n" + ANSWER) == ("", ANSWER)


@pytest.mark.parametrize("cls", ALL_PARSERS)
def test_truncated_inside_reasoning(cls: type[ReasoningParser]) -> None:
    text = think(cls, REASONING, ANSWER)
    cut = text[: text.index(cls.end)]  # max_tokens hit before the section closed
    reasoning, content = check(cls, cut)
    assert reasoning.strip() == REASONING and content == ""
    # Cut inside the start marker itself: nothing became reasoning.
    assert check(cls, cls.start[:5], leaks=False) == ("", cls.start[:5])


@pytest.mark.parametrize("cls", ALL_PARSERS)
def test_start_marker_later_in_the_answer_is_content(cls: type[ReasoningParser]) -> None:
    text = f"Tags like {cls.start} and {cls.end} mark reasoning."
    assert check(cls, text, leaks=False) == ("", text)
    # ...also after a reasoning section.
    reasoning, content = check(cls, think(cls, REASONING, text), leaks=False)
    assert reasoning.strip() == REASONING and content == text


@pytest.mark.parametrize("cls", THINK_PARSERS)
def test_section_opened_by_the_template(cls: type[ReasoningParser]) -> None:
    # DeepSeek-R1, QwQ and the Qwen3 thinking models: the prompt ends in `<think>\n`.
    prompt = "<｜User｜>What is 17 * 23?<｜Assistant｜><think>\n"
    assert cls.open_in_prompt(prompt)
    assert cls.open_in_prompt("<|im_start|>assistant\n<think>\n")
    text = f"{REASONING}\n</think>\n\n{ANSWER}"
    assert check(cls, text, open_in_prompt=True) == (REASONING + "\n", ANSWER)
    # Cut short while still thinking: all of it is reasoning.
    assert check(cls, REASONING, open_in_prompt=True) == (REASONING, "")


@pytest.mark.parametrize("cls", THINK_PARSERS)
def test_start_marker_repeated_after_the_template_opened_it(cls: type[ReasoningParser]) -> None:
    # vLLM's deepseek_r1 parser drops it: R1 distills sometimes write it again.
    text = f"<think>\n{REASONING}\n</think>\n\n{ANSWER}"
    assert check(cls, text, open_in_prompt=True) == (REASONING + "\n", ANSWER)


def test_qwen3_thinking_disabled() -> None:
    # enable_thinking=False: the template writes an empty, closed section.
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert not Qwen3ReasoningParser.open_in_prompt(prompt)
    assert check(Qwen3ReasoningParser, "Hello! How can I help?") == ("", "Hello! How can I help?")
    # An earlier turn's reasoning in the history does not open this one.
    history = "<|im_start|>assistant\n<think>\nx\n</think>\n\nA<|im_end|>\n<|im_start|>assistant\n"
    assert not Qwen3ReasoningParser.open_in_prompt(history)


def test_empty_reasoning_section() -> None:
    # Qwen3 with the /no_think soft switch writes an empty section itself.
    assert check(Qwen3ReasoningParser, "<think>\n\n</think>\n\nHello.") == ("", "Hello.")


def test_in_reasoning_flag() -> None:
    p = ThinkParser()
    assert not p.in_reasoning
    p.feed("<think>\nHmm")
    assert p.in_reasoning
    p.feed("</think>Done")
    assert not p.in_reasoning


def test_registry_and_detection() -> None:
    assert REASONING_PARSERS["deepseek_r1"] is DeepSeekR1ReasoningParser
    assert REASONING_PARSERS["qwen3"] is Qwen3ReasoningParser
    assert REASONING_PARSERS["glm45"] is GlmReasoningParser
    assert detect_reasoning_parser("{{ '<think>\\n' }}", {}) == "think"
    assert detect_reasoning_parser("", {"[THINK]": 34, "[/THINK]": 35}) == "mistral"
    granite = "Respond to every user query... Here is my thought process: ... Here is my response:"
    assert detect_reasoning_parser(granite, {}) == "granite"
    assert detect_reasoning_parser("", {"<|channel>": 100, "<channel|>": 101}) == "gemma4"
    assert detect_reasoning_parser("{{ messages }}", {}) is None


# --- OutputParser: reasoning, then hermes tool calls -------------------------

QWEN3_TEMPLATE = (
    '{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name '
    'and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}'
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
VOCAB = {"<tool_call>": 151657, "</tool_call>": 151658, "<think>": 151667, "</think>": 151668}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
QWEN3_OUTPUT = (
    "<think>\nThe user wants the weather in Paris. I'll call get_weather.\n</think>\n\n"
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>"
)


class _Tokenizer:
    def get_vocab(self) -> dict[str, int]:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [VOCAB[text]] if text in VOCAB else [ord(c) for c in text]


def _feed(out: OutputParser, pieces: list[str]) -> tuple[str, str, list[tuple[str, dict]]]:
    total = ParsedDelta()
    for piece in pieces:
        total.merge(out.feed(piece))
    total.merge(out.finish())
    calls = [(c.name, json.loads(c.arguments)) for c in collect_calls(total.calls)]
    return total.reasoning, total.content, calls


def check_output(choice: ParserChoice, tools: list | None, prompt: str, text: str, **make: Any):  # type: ignore[no-untyped-def]
    """The parsed output of `text`, the same however it is split; `make`: more arguments
    of `ParserChoice.make`."""
    whole = _feed(choice.make(tools, prompt, **make), [text])
    assert _feed(choice.make(tools, prompt, **make), list(text)) == whole
    rng = random.Random(2024)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, 30)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _feed(choice.make(tools, prompt, **make), pieces) == whole
    return whole


def test_choice_for_qwen3() -> None:
    choice = ParserChoice.for_model(_Tokenizer(), "qwen3", QWEN3_TEMPLATE)
    assert choice.tool is HermesParser and choice.reasoning is ThinkParser
    assert choice.keep_token_ids == frozenset(VOCAB.values())
    off = ParserChoice.for_model(_Tokenizer(), "qwen3", QWEN3_TEMPLATE, "none", "none")
    assert off.tool is None and off.reasoning is None


def test_reasoning_then_hermes_call() -> None:
    choice = ParserChoice.for_model(_Tokenizer(), "qwen3", QWEN3_TEMPLATE)
    reasoning, content, calls = check_output(choice, TOOLS, "<|im_start|>assistant\n", QWEN3_OUTPUT)
    assert reasoning == "The user wants the weather in Paris. I'll call get_weather.\n"
    assert content == "Let me check.\n"
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_reasoning_opened_by_the_template_then_call() -> None:
    choice = ParserChoice.for_model(_Tokenizer(), "qwen3", QWEN3_TEMPLATE)
    prompt = "<|im_start|>assistant\n<think>\n"
    text = QWEN3_OUTPUT[len("<think>\n") :]
    reasoning, content, calls = check_output(choice, TOOLS, prompt, text)
    assert reasoning == "The user wants the weather in Paris. I'll call get_weather.\n"
    assert content == "Let me check.\n"
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_tool_call_inside_reasoning_is_reasoning() -> None:
    choice = ParserChoice.for_model(_Tokenizer(), "qwen3", QWEN3_TEMPLATE)
    text = '<think>\nMaybe <tool_call>{"name": "get_weather"}</tool_call>?\n</think>\n\nNo call.'
    reasoning, content, calls = check_output(choice, TOOLS, "", text)
    assert reasoning.startswith("Maybe <tool_call>") and content == "No call." and calls == []


def test_without_tools_calls_stay_text() -> None:
    choice = ParserChoice.for_model(_Tokenizer(), "qwen3", QWEN3_TEMPLATE)
    reasoning, content, calls = check_output(choice, None, "", QWEN3_OUTPUT)
    assert calls == [] and content.startswith("Let me check.\n<tool_call>")
    assert reasoning == "The user wants the weather in Paris. I'll call get_weather.\n"


def test_output_parser_state() -> None:
    choice = ParserChoice.for_model(_Tokenizer(), "qwen3", QWEN3_TEMPLATE)
    out = choice.make(TOOLS, "")
    out.feed("<think>\nhmm")
    assert out.in_reasoning and not out.called
    out.feed("</think>\n\n" + QWEN3_OUTPUT.split("</think>\n\n")[1])
    out.finish()
    assert not out.in_reasoning and out.called


def test_one_call_keeps_the_first_call_only() -> None:
    """`parallel_tool_calls: false` under `auto`: the model may still write two calls; only
    the first is returned, streamed or whole, split anywhere."""
    choice = ParserChoice.for_model(_Tokenizer(), "qwen3", QWEN3_TEMPLATE)
    two = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    both = check_output(choice, TOOLS, "", two)[2]
    assert [args["city"] for _, args in both] == ["Paris", "Rome"]
    for whole in (False, True):
        first = check_output(choice, TOOLS, "", two, whole=whole, one_call=True)
        assert first[2] == [("get_weather", {"city": "Paris"})]
