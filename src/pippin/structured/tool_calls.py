"""Forced tool calls: a grammar of the model family's own tool-call format.

`tool_choice: "required"` (OpenAI), `any` (Anthropic) or a named function make the model
write one or more calls, in exactly the format its tool-call parser reads, with a name
from the request's tools and arguments that follow that tool's `parameters` schema. So
the output always parses into valid calls. Families without a builder here are refused
(`StructuredOutputError` on `tool_choice`) rather than forced loosely.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from llguidance import LLMatcher

from pippin.chat.tool_parsers.base import ToolParser, tool_functions
from pippin.chat.tool_parsers.xml_params import schema_types
from pippin.structured.formats import strict_schema
from pippin.structured.spec import JSON_OPTIONS, GrammarSpec, StructuredOutputError


class Vocab(Protocol):
    """What a format needs to know of the vocabulary."""

    def marker(self, text: str) -> str:
        """Lark for a fixed piece: its token when it is an added token, else the text."""
        ...

    def has_token(self, text: str) -> bool:
        """Whether `text` is one token of the vocabulary."""
        ...


class PlainVocab:
    """Every marker as text: for a vocabulary where none is a special token."""

    def marker(self, text: str) -> str:
        return json.dumps(text)

    def has_token(self, text: str) -> bool:
        return False


def params_schema(fn: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema, with pippin's JSON layout; none: no arguments."""
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}, "additionalProperties": False}
    if not isinstance(params, dict):
        raise StructuredOutputError("tools", f"The parameters of {fn['name']!r} must be an object.")
    if fn.get("strict"):
        params = strict_schema(params)
    return {**params, "x-guidance": {**JSON_OPTIONS, **(params.get("x-guidance") or {})}}


class _Lark:
    """Rules of one grammar, named as they are added."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab
        self.rules: list[str] = []

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def text(self, *pieces: str) -> str:
        """Fixed pieces in order; each may be a special token."""
        return " ".join(self.vocab.marker(p) for p in pieces if p)

    def json(self, name: str, schema: dict[str, Any]) -> str:
        return self.rule(name, "%json " + json.dumps(schema))

    def repeat(self, item: str, sep: str, many: bool) -> str:
        return f"{item} ({self.text(sep)} {item})*" if many else item

    def source(self, start: str) -> str:
        return "\n".join([f"start: {start}", *self.rules])


Functions = list[dict[str, Any]]


def _json_calls(g: _Lark, fns: Functions, args_key: str = "arguments") -> str:
    """`{"name": "NAME", "<args_key>": {...}}` for any of the functions."""
    alts = []
    for i, fn in enumerate(fns):
        args = g.json(f"args_{i}", params_schema(fn))
        head = json.dumps({"name": fn["name"], args_key: 0})[: -len("0}")]
        alts.append(g.rule(f"call_{i}", f"{json.dumps(head)} {args} {json.dumps('}')}"))
    return g.rule("call", " | ".join(alts))


def _hermes(g: _Lark, fns: Functions, many: bool) -> str:
    call = _json_calls(g, fns)
    block = g.rule("block", f'{g.text("<tool_call>")} "\\n" {call} "\\n" {g.text("</tool_call>")}')
    return g.repeat(block, "\n", many)


def _json_list(prefix: str, suffix: str = "") -> Callable[[_Lark, Functions, bool], str]:
    def build(g: _Lark, fns: Functions, many: bool) -> str:
        calls = g.repeat(_json_calls(g, fns), ", ", many)
        return f'{g.text(prefix)} "[" {calls} "]" {g.text(suffix)}'.strip()

    return build


def _llama3(g: _Lark, fns: Functions, many: bool) -> str:
    return g.repeat(_json_calls(g, fns, "parameters"), "; ", many)


def _mistral(g: _Lark, fns: Functions, many: bool) -> str:
    if not g.vocab.has_token("[ARGS]"):  # before tokenizer v11: a JSON list of calls
        return _json_list("[TOOL_CALLS]")(g, fns, many)
    alts = []
    for i, fn in enumerate(fns):
        args = g.json(f"args_{i}", params_schema(fn))
        alts.append(g.rule(f"call_{i}", f"{g.text('[TOOL_CALLS]', fn['name'], '[ARGS]')} {args}"))
    call = g.rule("call", " | ".join(alts))
    return f"{call}+" if many else call


def _regex_literal(pattern: str) -> str:
    return "/" + pattern.removeprefix("^").removesuffix("$").replace("/", "\\/") + "/"


def _xml_value(g: _Lark, name: str, schema: Any) -> str:
    """A parameter's value as these formats write it: strings raw, the rest as JSON."""
    types = schema_types(schema)
    if not (types and types <= {"string"}):
        sub = schema if isinstance(schema, dict) else {}
        return g.json(name, {**sub, "x-guidance": JSON_OPTIONS})
    if isinstance(schema.get("enum"), list):
        return g.rule(name, " | ".join(json.dumps(str(v)) for v in schema["enum"]))
    if isinstance(schema.get("pattern"), str):
        return g.rule(name, _regex_literal(schema["pattern"]))
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    return g.rule(name, f"/[^<]{{{lo},{'' if hi is None else hi}}}/")


def _xml(
    head: tuple[str, str, str], param: tuple[str, str, str], tail: str, sep: str
) -> Callable[[_Lark, Functions, bool], str]:
    """(before name, after name) ... per parameter (before key, after key, after value)."""

    def build(g: _Lark, fns: Functions, many: bool) -> str:
        alts = []
        for i, fn in enumerate(fns):
            schema = params_schema(fn)
            required = set(schema.get("required") or ())
            parts = [g.text(head[0], head[1], fn["name"], head[2])]
            for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
                value = _xml_value(g, f"value_{i}_{j}", sub)
                item = f"{g.text(param[0], key, param[1])} {value} {g.text(param[2])}"
                parts.append(item if key in required else f"({item})?")
            parts.append(g.text(tail))
            alts.append(g.rule(f"call_{i}", " ".join(parts)))
        return g.repeat(g.rule("call", " | ".join(alts)), sep, many)

    return build


Builder = Callable[[_Lark, Functions, bool], str]

# By the parser's canonical name; every format is its parser's documented layout.
FORMATS: dict[str, Builder] = {
    "hermes": _hermes,
    "qwen": _hermes,  # reads hermes JSON and Qwen3-Coder XML; a forced call is JSON
    "granite": _json_list("<|tool_call|>"),
    "phi4_mini": _json_list("functools"),
    "nemotron": _json_list("<TOOLCALL>", "</TOOLCALL>"),
    "xlam": _json_list(""),
    "llama3_json": _llama3,
    "mistral": _mistral,
    "qwen3_coder": _xml(
        ("<tool_call>", "\n<function=", ">\n"),
        ("<parameter=", ">\n", "\n</parameter>\n"),
        "</function>\n</tool_call>",
        "\n",
    ),
    "glm45": _xml(
        ("<tool_call>", "", "\n"),
        ("<arg_key>", "</arg_key>\n<arg_value>", "</arg_value>\n"),
        "</tool_call>",
        "\n",
    ),
    "minimax_m2": _xml(
        ("<minimax:tool_call>", '\n<invoke name="', '">\n'),
        ('<parameter name="', '">', "</parameter>\n"),
        "</invoke>\n</minimax:tool_call>",
        "\n",
    ),
}


def forced_tool_grammar(
    parser: type[ToolParser] | None,
    tools: Sequence[dict[str, Any]],
    name: str | None = None,
    *,
    parallel: bool = True,
    vocab: Vocab | None = None,
    param: str = "tool_choice",
) -> GrammarSpec:
    """The grammar of a forced call: any of `tools` (or only the one named `name`),
    one call, or one or more when `parallel`. `tools` are OpenAI tool dicts
    (`{"type": "function", "function": {...}}`) or plain function dicts."""
    if parser is None:
        raise StructuredOutputError(
            param, "This model has no known tool-call format, so a tool call cannot be forced."
        )
    build = FORMATS.get(parser.name)
    if build is None:
        raise StructuredOutputError(
            param,
            f"Forcing a tool call is not supported for the '{parser.name}' tool-call format; "
            "use tool_choice 'auto'.",
        )
    functions = tool_functions(tools)
    if name is not None:
        if name not in functions:
            raise StructuredOutputError(param, f"No tool named {name!r} is in 'tools'.")
        fns = [functions[name]]
    else:
        fns = list(functions.values())
    if not fns:
        raise StructuredOutputError(param, "A tool call can only be forced with 'tools'.")
    g = _Lark(vocab or PlainVocab())
    start = build(g, fns, parallel and name is None)
    what = f"a call of {name!r}" if name else "a tool call"
    return GrammarSpec(LLMatcher.grammar_from_lark(g.source(start)), param, what)
