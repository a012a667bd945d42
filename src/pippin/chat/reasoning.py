"""Reasoning parsers: split a model's thinking from its answer, incrementally.

A reasoning section may only open at the start of the output (after whitespace), or
be already open when the chat template ended the prompt inside it (DeepSeek-R1, Qwen3
thinking templates that add `<think>`). Markers never reach either side; partial
markers are held back. Work per piece is bounded by the marker length.
"""

from __future__ import annotations

from typing import ClassVar

from pippin.chat.tool_parsers.base import find_marker, partial_marker

_BEFORE, _IN, _AFTER = 0, 1, 2


class ReasoningParser:
    name: ClassVar[str] = ""
    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    special_tokens: ClassVar[tuple[str, ...]] = ()

    def __init__(self, open_in_prompt: bool = False) -> None:
        self.state = _IN if open_in_prompt else _BEFORE
        self.buf = ""
        self.strip = True  # leading whitespace of the next section is dropped
        # The template opened the section, but the model may write its start marker again.
        self.repeat = open_in_prompt

    @classmethod
    def open_in_prompt(cls, prompt_text: str) -> bool:
        """Whether the prompt ends inside a reasoning section the template opened."""
        i = prompt_text.rfind(cls.start)
        return i >= 0 and not prompt_text[i + len(cls.start) :].strip()

    @property
    def in_reasoning(self) -> bool:
        return self.state == _IN

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that became certain."""
        self.buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning = content = ""
        while True:
            if self.state == _BEFORE:
                head = self.buf.lstrip()
                if head.startswith(self.start):
                    self.buf = head[len(self.start) :]
                    self.state, self.strip = _IN, True
                    continue
                if not final and (not head or self.start.startswith(head)):
                    return reasoning, content
                self.state = _AFTER
            if self.strip:
                self.buf = self.buf.lstrip()
                if not self.buf and not final:
                    return reasoning, content
                self.strip = False
            if self.state == _IN and self.repeat:
                if (
                    not final
                    and len(self.buf) < len(self.start)
                    and self.start.startswith(self.buf)
                ):
                    return reasoning, content
                self.repeat = False
                if self.buf.startswith(self.start):
                    self.buf = self.buf[len(self.start) :]
                    self.strip = True
                    continue
            if self.state == _IN:
                hit = find_marker(self.buf, (self.end,))
                if hit is None:
                    keep = 0 if final else partial_marker(self.buf, (self.end,))
                    cut = len(self.buf) - keep
                    reasoning += self.buf[:cut]
                    self.buf = self.buf[cut:]
                    return reasoning, content
                reasoning += self.buf[: hit[0]]
                self.buf = self.buf[hit[0] + len(self.end) :]
                self.state, self.strip = _AFTER, True
                continue
            content += self.buf
            self.buf = ""
            return reasoning, content


class ThinkParser(ReasoningParser):
    """`<think>...</think>`: Qwen3, QwQ, DeepSeek-R1, GLM 4.5+, MiniMax, Kimi."""

    name = "think"
    special_tokens = ("<think>", "</think>")


class Qwen3ReasoningParser(ThinkParser):
    name = "qwen3"


class DeepSeekR1ReasoningParser(ThinkParser):
    name = "deepseek_r1"


class GlmReasoningParser(ThinkParser):
    name = "glm45"


class MistralReasoningParser(ReasoningParser):
    """Magistral: `[THINK]...[/THINK]` (special tokens in recent tokenizers)."""

    name = "mistral"
    start = "[THINK]"
    end = "[/THINK]"
    special_tokens = ("[THINK]", "[/THINK]")


class GraniteReasoningParser(ReasoningParser):
    """Granite 3.x thinking mode: plain-text headers around the two sections."""

    name = "granite"
    start = "Here is my thought process:"
    end = "Here is my response:"


class Gemma4ReasoningParser(ReasoningParser):
    """Gemma 4: the thought channel, `<|channel>thought ... <channel|>`."""

    name = "gemma4"
    start = "<|channel>thought"
    end = "<channel|>"
    special_tokens = ("<|channel>", "<channel|>")


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p
    for p in (
        ThinkParser,
        Qwen3ReasoningParser,
        DeepSeekR1ReasoningParser,
        GlmReasoningParser,
        MistralReasoningParser,
        GraniteReasoningParser,
        Gemma4ReasoningParser,
    )
}
# vLLM's names for the same formats.
REASONING_PARSERS.update(
    {"deepseek_v3": ThinkParser, "glm4_moe": GlmReasoningParser, "minimax_m2": ThinkParser}
)
# vllm-mlx's names for the same formats (its "gpt_oss" and "harmony": see HARMONY_NAMES).
REASONING_PARSERS.update(
    {"glm4": GlmReasoningParser, "minimax": ThinkParser, "vibethinker": DeepSeekR1ReasoningParser}
)
# Reasoning names whose format is gpt-oss's harmony, which its tool-call parser reads
# (reasoning and calls are one format there): they mean "detect from the model".
HARMONY_NAMES = frozenset({"gpt_oss", "harmony", "openai_gptoss"})


def detect_reasoning_parser(template_source: str, vocab: set[str] | dict[str, int]) -> str | None:
    """The reasoning format of a model, from its chat template and vocabulary."""
    if "<|channel>" in vocab and "<channel|>" in vocab:
        return "gemma4"
    if "[THINK]" in vocab or "[THINK]" in template_source:
        return "mistral"
    if "Here is my thought process:" in template_source:
        return "granite"
    if "<think>" in vocab or "<think>" in template_source:
        return "think"
    return None
