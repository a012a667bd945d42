"""A constraint as the engine takes it: a compiled grammar and where it starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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
