"""The output side of a chat: reasoning, answer text and tool calls, as they stream.

`ParserChoice` is decided once per model (from its template and vocabulary, or the
`--tool-call-parser` / `--reasoning-parser` flags); each request gets an
`OutputParser`, which sends the text through the reasoning parser first and the
answer part of it through the tool-call parser.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pippin.chat.reasoning import REASONING_PARSERS, ReasoningParser, detect_reasoning_parser
from pippin.chat.tool_parsers import detect_tool_parser, get_tool_parser
from pippin.chat.tool_parsers.base import ParsedDelta, ToolParser, random_call_id
from pippin.engine.types import ThinkingBudget


@dataclass(frozen=True)
class ParserChoice:
    tool: type[ToolParser] | None
    reasoning: type[ReasoningParser] | None
    # Special tokens the parsers must see in the text (the engine skips the others).
    keep_token_ids: frozenset[int] = frozenset()
    # The reasoning section's markers as tokens, for a thinking budget.
    think_start_id: int | None = None
    think_end_ids: tuple[int, ...] = ()

    @classmethod
    def for_model(
        cls,
        tokenizer: Any,
        model_type: str,
        template_source: str,
        tool_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> ParserChoice:
        """`None` or "auto" detects; "none" turns a parser off; else a name."""
        vocab: dict[str, int] = tokenizer.get_vocab()
        tool: type[ToolParser] | None
        if tool_parser in (None, "auto"):
            tool = detect_tool_parser(template_source, model_type, vocab)
        elif tool_parser == "none":
            tool = None
        else:
            tool = get_tool_parser(tool_parser)
        reasoning: type[ReasoningParser] | None = None
        if tool is not None and tool.handles_reasoning:
            reasoning = None
        elif reasoning_parser in (None, "auto"):
            name = detect_reasoning_parser(template_source, vocab)
            reasoning = REASONING_PARSERS[name] if name else None
        elif reasoning_parser != "none":
            if reasoning_parser not in REASONING_PARSERS:
                raise ValueError(
                    f"Unknown reasoning parser {reasoning_parser!r}; choose one of "
                    f"{', '.join(sorted(REASONING_PARSERS))}."
                )
            reasoning = REASONING_PARSERS[reasoning_parser]
        markers: set[str] = set()
        if tool is not None:
            markers.update(tool.special_tokens)
        if reasoning is not None:
            markers.update(reasoning.special_tokens)
        keep = frozenset(vocab[m] for m in markers if m in vocab)
        start_id, end_ids = None, ()
        if reasoning is not None:
            start = tokenizer.encode(reasoning.start, add_special_tokens=False)
            # Only a marker that is one token can be told apart as the output's first
            # token ("<" or "Here" would also start ordinary answers).
            start_id = start[0] if len(start) == 1 else None
            end_ids = tuple(tokenizer.encode(reasoning.end, add_special_tokens=False))
        return cls(tool, reasoning, keep, start_id, end_ids)

    def thinking_budget(self, budget: int, prompt_text: str) -> ThinkingBudget | None:
        """The engine's budget for this model's reasoning section; None if it has none."""
        if self.reasoning is None or not self.think_end_ids:
            return None
        return ThinkingBudget(
            budget,
            self.think_end_ids,
            self.think_start_id,
            self.reasoning.open_in_prompt(prompt_text),
        )

    def make(
        self,
        tools: Sequence[dict[str, Any]] | None,
        prompt_text: str,
        new_id: Callable[[], str] = random_call_id,
        whole: bool = False,
        one_call: bool = False,
    ) -> OutputParser:
        """A parser for one output; tool calls are parsed only when the request has tools.
        `whole`: the output is answered whole, not streamed (see `ToolParser.drop_call`).
        `one_call`: only the first call the model writes is returned (OpenAI's
        `parallel_tool_calls: false`, Anthropic's `disable_parallel_tool_use`)."""
        reasoning = None
        if self.reasoning is not None:
            reasoning = self.reasoning(self.reasoning.open_in_prompt(prompt_text))
        tool = None
        if self.tool is not None and (tools or self.tool.handles_reasoning):
            tool = self.tool(tools, new_id, whole=whole)
        return OutputParser(reasoning, tool, one_call)


class OutputParser:
    def __init__(
        self, reasoning: ReasoningParser | None, tool: ToolParser | None, one_call: bool = False
    ) -> None:
        self.reasoning = reasoning
        self.tool = tool
        self.one_call = one_call
        self._first_call: int | None = None  # the index of the first call, with one_call

    @property
    def called(self) -> bool:
        return self.tool is not None and self.tool.called

    @property
    def in_reasoning(self) -> bool:
        return self.reasoning is not None and self.reasoning.in_reasoning

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        if self.reasoning is None:
            return self._tools(text, token_ids)
        thought, answer = self.reasoning.feed(text)
        out = self._tools(answer, token_ids) if answer else ParsedDelta()
        out.reasoning = thought + out.reasoning
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.reasoning is not None:
            thought, answer = self.reasoning.finish()
            out.reasoning = thought
            if answer:
                out.merge(self._tools(answer, ()))
        if self.tool is not None:
            out.merge(self._only_first(self.tool.finish()))
        return out

    def _tools(self, text: str, token_ids: Sequence[int]) -> ParsedDelta:
        if self.tool is None:
            return ParsedDelta(content=text)
        return self._only_first(self.tool.feed(text, token_ids))

    def _only_first(self, out: ParsedDelta) -> ParsedDelta:
        """With `one_call`, the deltas of calls after the first are dropped (their tokens
        still count in the usage, as OpenAI's do)."""
        if self.one_call and out.calls:
            if self._first_call is None:
                self._first_call = out.calls[0].index
            out.calls = [c for c in out.calls if c.index == self._first_call]
        return out
