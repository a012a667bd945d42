"""Feeding parser transcripts whole and in random pieces, for the parser tests."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pippin.chat.tool_parsers.base import ParsedDelta, ToolParser, collect_calls


@dataclass
class Result:
    content: str
    reasoning: str
    calls: list[tuple[str, Any]]  # (name, decoded arguments) of the calls that ended
    raw_args: list[str]
    # Streamed: the name and the arguments sent of a call the output ended inside.
    cut: tuple[str, str] | None = None
    # The same output answered whole (`check_split_invariance` fills it in).
    whole: Result | None = field(default=None, compare=False)


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run(make: Callable[[], ToolParser], pieces: list[str], whole: bool = False) -> Result:
    p = make()
    p.whole = whole  # before anything is fed
    total = ParsedDelta()
    for piece in pieces:
        d = p.feed(piece)
        # Every argument fragment belongs to a call already opened.
        total.merge(d)
    total.merge(p.finish())
    calls = collect_calls(total.calls)
    cut = None
    if p.cut and not whole:  # the last call was sent in part, and never ended
        last = calls.pop()
        cut = (last.name, last.arguments)
    if whole:
        assert len(calls) == p.n_calls  # a call cut off never shows
    return Result(
        total.content,
        total.reasoning,
        [(c.name, json.loads(c.arguments)) for c in calls],
        [c.arguments for c in calls],
        cut,
    )


def run_reasoning(make: Callable[[], Any], pieces: list[str]) -> tuple[str, str]:
    """(reasoning, content) of a reasoning parser fed `pieces`."""
    p = make()
    reasoning = content = ""
    for piece in pieces:
        r, c = p.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = p.finish()
    return reasoning + r, content + c


def random_pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 40))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def check_split_invariance(make: Callable[[], ToolParser], text: str, trials: int = 30) -> Result:
    """The whole text at once, char by char and random splits all give the same result,
    streamed and answered whole; the streamed result, with the whole one in `whole`.

    Both agree, but on a call the output ended inside: streamed, what was sent of it
    stays (`cut`); answered whole, its text follows the content."""
    one = run(make, [text])
    assert run(make, list(text)) == one
    rng = random.Random(1234)
    for _ in range(trials):
        if len(text) > 1:
            assert run(make, random_pieces(text, rng)) == one
    whole = run(make, [text], whole=True)
    assert run(make, list(text), whole=True) == whole
    if len(text) > 1:
        assert run(make, random_pieces(text, rng), whole=True) == whole
    assert whole.cut is None
    if one.cut is None:
        assert whole == one
    else:
        assert (whole.calls, whole.reasoning) == (one.calls, one.reasoning)
        assert whole.content.startswith(one.content) and len(whole.content) > len(one.content)
    one.whole = whole
    return one
