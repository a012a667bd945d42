"""A constraint as the engine takes it: a compiled grammar and where it starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pippin.chat.output import ParserChoice


@dataclass(frozen=True)
class Constraint:
    """Goes into `SamplingParams.constraint`; shared by the request's sequences."""

    # A compiled llguidance LLMatcher in its initial state. Never advanced: each sequence
    # works on a copy of it.
    matcher: Any
    what: str
    n_vocab: int  # the matcher's token ids: masks are this wide
    # With a reasoning model the constraint starts once the reasoning section is over:
    # the section's markers as tokens, and whether the prompt already opened it.
    think_start_id: int | None = None
    think_end_ids: tuple[int, ...] = ()
    think_open: bool = False
    # The grammar's JSON text: what an engine process compiles the matcher from again
    # (a compiled matcher does not cross processes).
    grammar: str = ""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        fields = (self.what, self.n_vocab, self.think_start_id, self.think_end_ids)
        return (_rebuild, (self.grammar, *fields, self.think_open))


# In an engine process: compiles a grammar's JSON text into a matcher (set at start).
MATCHER_BUILDER: Callable[[str], Any] | None = None


def _rebuild(
    grammar: str,
    what: str,
    n_vocab: int,
    think_start_id: int | None,
    think_end_ids: tuple[int, ...],
    think_open: bool,
) -> Constraint:
    if MATCHER_BUILDER is None:
        raise RuntimeError("no grammar compiler in this process to rebuild a constraint")
    matcher = MATCHER_BUILDER(grammar)
    return Constraint(matcher, what, n_vocab, think_start_id, think_end_ids, think_open, grammar)


def after_reasoning(c: Constraint, choice: ParserChoice | None, prompt_text: str) -> Constraint:
    """`c`, starting after the model's reasoning section (if it has one).

    The section may already be open (the template opened it): the constraint waits for
    its end marker. Otherwise the first token may open it; anything else starts the
    constrained answer at once.
    """
    if choice is None or choice.reasoning is None or not choice.think_end_ids:
        return c
    return replace(
        c,
        think_start_id=choice.think_start_id,
        think_end_ids=choice.think_end_ids,
        think_open=choice.reasoning.open_in_prompt(prompt_text),
    )
