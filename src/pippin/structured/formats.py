"""Request fields that ask for structured text -> `GrammarSpec`s.

OpenAI's `response_format` (chat) and `text.format` (Responses), and the fields vLLM's
users send: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, or the same
inside `structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`).
Nothing here needs the model: grammars are plain text until `compiler` builds them.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from pippin.structured.spec import JSON_OPTIONS, GrammarSpec, StructuredOutputError


def strict_schema(schema: Any) -> Any:
    """OpenAI's strict mode: objects take no properties beyond the ones they list."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def json_schema_grammar(
    schema: Any, param: str, what: str = "the JSON schema", strict: bool = False
) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise StructuredOutputError(param, f"{what} is not valid JSON: {exc}") from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise StructuredOutputError(param, f"{what} must be a JSON object.")
    if strict:
        schema = strict_schema(schema)
    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as exc:
        raise StructuredOutputError(param, f"{what} cannot be used: {exc}") from None
    return GrammarSpec(grammar, param, what)


def json_object_grammar(param: str) -> GrammarSpec:
    return json_schema_grammar({"type": "object"}, param, "a JSON object")


def regex_grammar(regex: Any, param: str) -> GrammarSpec:
    if not isinstance(regex, str):
        raise StructuredOutputError(param, "The regex must be a string.")
    return GrammarSpec(LLMatcher.grammar_from_regex(regex), param, "the regex")


def choice_grammar(choices: Any, param: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise StructuredOutputError(param, "The choices must be a non-empty list of strings.")
    lark = "start: " + " | ".join(json.dumps(c) for c in choices)
    return GrammarSpec(LLMatcher.grammar_from_lark(lark), param, "the choice")


def lark_grammar(text: Any, param: str) -> GrammarSpec:
    """A Lark grammar (llguidance's dialect) or a GBNF / EBNF one, as vLLM accepts."""
    if not isinstance(text, str) or not text.strip():
        raise StructuredOutputError(param, "The grammar must be a non-empty string.")
    try:
        lark = any_to_lark(text)
    except Exception as exc:  # the converter raises plain exceptions on bad input
        raise StructuredOutputError(param, f"The grammar cannot be read: {exc}") from None
    return GrammarSpec(LLMatcher.grammar_from_lark(lark), param, "the grammar")


def response_format_grammar(
    fmt: Mapping[str, Any] | None, param: str = "response_format"
) -> GrammarSpec | None:
    """OpenAI's `response_format` (chat completions) or `text.format` (Responses).

    `{"type": "text"}` -> None; `{"type": "json_object"}` -> any JSON object;
    `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` (chat) or the
    same keys at the top level (Responses) -> that schema.
    """
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        _known_keys(fmt, {"type"}, param)
        return None
    if kind == "json_object":
        _known_keys(fmt, {"type"}, param)
        return json_object_grammar(param)
    if kind != "json_schema":
        raise StructuredOutputError(f"{param}.type", f"Unknown {param} type {kind!r}.")
    inner: Any = fmt.get("json_schema", fmt)
    where = f"{param}.json_schema" if "json_schema" in fmt else param
    if not isinstance(inner, Mapping):
        raise StructuredOutputError(where, f"'{where}' must be an object.")
    if inner is fmt:
        _known_keys(fmt, {"type", *_SCHEMA_KEYS}, param)
    else:
        _known_keys(fmt, {"type", "json_schema"}, param)
        _known_keys(inner, set(_SCHEMA_KEYS), where)
    name = inner.get("name")
    if not isinstance(name, str) or not name:
        raise StructuredOutputError(f"{where}.name", f"'{where}.name' is required.")
    if "schema" not in inner:
        # OpenAI: a json_schema format without a schema means any JSON value.
        schema: Any = {}
    else:
        schema = copy.deepcopy(inner["schema"])
    return json_schema_grammar(
        schema, f"{where}.schema", f"the JSON schema {name!r}", bool(inner.get("strict"))
    )


# A json_schema format's keys (nested under `json_schema` in chat, at the top in Responses).
_SCHEMA_KEYS = ("name", "description", "schema", "strict")


def _known_keys(obj: Mapping[str, Any], known: set[str], where: str) -> None:
    """Refuse a key the format does not define, naming it (nothing is silently ignored)."""
    unknown = sorted(set(obj) - known)
    if unknown:
        key = f"{where}.{unknown[0]}"
        raise StructuredOutputError(key, f"Unknown parameter: '{key}'.")


_GUIDED = ("json", "regex", "choice", "grammar", "json_object")


def guided_grammar(
    fields: Mapping[str, Any], prefix: str = "guided_", container: str | None = None
) -> GrammarSpec | None:
    """vLLM's fields: `guided_json` etc. (`prefix="guided_"`), or the keys of
    `structured_outputs` (`prefix=""`, `container="structured_outputs"`). At most one."""
    given = {k: v for k, v in fields.items() if k in _GUIDED and v not in (None, False)}
    unknown = sorted(set(fields) - set(_GUIDED))
    if unknown and container is not None:
        key = f"{container}.{unknown[0]}"
        raise StructuredOutputError(key, f"Unsupported key {key!r}.")

    def name(k: str) -> str:
        return f"{container}.{k}" if container else f"{prefix}{k}"

    if len(given) > 1:
        names = ", ".join(repr(name(k)) for k in given)
        raise StructuredOutputError(name(next(iter(given))), f"Set only one of {names}.")
    if not given:
        return None
    key, value = next(iter(given.items()))
    param = name(key)
    if key == "json":
        return json_schema_grammar(copy.deepcopy(value), param)
    if key == "json_object":
        return json_object_grammar(param)
    if key == "regex":
        return regex_grammar(value, param)
    if key == "choice":
        return choice_grammar(value, param)
    return lark_grammar(value, param)
