"""Where a constraint starts: after the model's reasoning section, if it has one."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from pippin.engine.constraint import Constraint

if TYPE_CHECKING:
    from pippin.chat.output import ParserChoice


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
