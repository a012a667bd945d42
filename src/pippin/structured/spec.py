"""What a constraint is before it meets a vocabulary: a grammar text and its origin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# JSON is written as `json.dumps` writes it: `", "` and `": "`, no other whitespace. Free
# whitespace lets a model pad forever (a known failure of JSON grammars) and a fixed
# layout is how models write JSON anyway.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class StructuredOutputError(ValueError):
    """A constraint the request asked for cannot be built; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


@dataclass(frozen=True)
class GrammarSpec:
    """An llguidance grammar (its JSON text) and the request field it came from."""

    grammar: str
    param: str
    what: str  # for messages: "the JSON schema 'person'", "the regex", ...
