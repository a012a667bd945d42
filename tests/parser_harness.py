"""Feeding parser transcripts whole and in random pieces, for the parser tests."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pippin.chat.tool_parsers.base import ParsedDelta, ToolParser, collect_calls


@dataclass
class Result:
    content: str
    reasoning: str
    calls: list[tuple[str, Any]]  # (name, decoded arguments)
    raw_args: list[str]


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run(make: Callable[[], ToolParser], pieces: list[str]) -> Result:
    p = make()
    total = ParsedDelta()
    for piece in pieces:
        d = p.feed(piece)
        # Every argument fragment belongs to a call already opened.
        total.merge(d)
    total.merge(p.finish())
    calls = collect_calls(total.calls)
    return Result(
        total.content,
        total.reasoning,
        [(c.name, json.loads(c.arguments)) for c in calls],
        [c.arguments for c in calls],
    )


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def check_split_invariance(make: Callable[[], ToolParser], text: str, trials: int = 30) -> Result:
    """The whole text at once, char by char and random splits all give the same result."""
    whole = run(make, [text])
    assert run(make, list(text)) == whole
    rng = random.Random(1234)
    for _ in range(trials):
        if len(text) > 1:
            assert run(make, random_pieces(text, rng)) == whole
    return whole
