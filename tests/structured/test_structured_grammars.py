"""Structured output without a model: grammars from request fields, forced tool-call
formats per parser family, the compiler's errors and timeout, and the engine's masks.

Random walks over llguidance's masks stand in for a model: whatever token the mask
allows may come next, so a format's output must parse (with that family's own parser)
and validate (with `jsonschema`) however the walk goes.
"""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jsonschema
import numpy as np
import pytest
from llguidance import LLMatcher
from support import tiny_models

from pippin.chat.tool_parsers import get_tool_parser
from pippin.chat.tool_parsers.base import collect_calls
from pippin.engine.constraint import Constraint
from pippin.engine.grammar_masks import ANSWER, MAY_REASON, REASONING, GrammarMasks, GrammarState
from pippin.structured.compiler import GrammarCompiler
from pippin.structured.formats import guided_grammar, response_format_grammar
from pippin.structured.spec import GrammarSpec, StructuredOutputError
from pippin.structured.tool_calls import FORMATS, forced_tool_grammar

EOS = 2  # <|im_end|> of the tiny tokenizer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "unit": {"type": "string", "maxLength": 6},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME, "strict": True}},
    {"type": "function", "function": {"name": "ping"}},  # no parameters
]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters") for t in TOOLS}


@pytest.fixture(scope="module")
def compiler(tmp_path_factory: pytest.TempPathFactory) -> GrammarCompiler:
    from transformers import AutoTokenizer

    d: Path = tmp_path_factory.mktemp("tok")
    tiny_models.build_tokenizer(d)
    tok = AutoTokenizer.from_pretrained(d)
    return GrammarCompiler(tok, 768, [EOS])


def walk(compiler: GrammarCompiler, spec: GrammarSpec, seed: int, limit: int = 400) -> str:
    """Text of a random walk through the grammar until it ends (EOS)."""
    m = compiler.build(spec).deep_copy()
    rng = np.random.default_rng(seed)
    masks = GrammarMasks({EOS})
    ids: list[int] = []
    for _ in range(limit):
        bits = np.zeros((1, 24), dtype=np.int32)
        masks._fill([(m, 0)], bits)
        allowed = np.nonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))[0]
        assert len(allowed), m.get_error()
        # EOS is allowed exactly where the grammar accepts.
        assert (EOS in allowed) == m.is_accepting()
        if EOS in allowed and (len(allowed) == 1 or rng.random() < 0.5):
            return compiler.hf.decode(ids)
        tok = int(rng.choice([t for t in allowed if t != EOS]))
        assert m.consume_token(tok), m.get_error()
        ids.append(tok)
    raise AssertionError(f"no end after {limit} tokens: {compiler.hf.decode(ids)!r}")


# --- request fields -> grammars ------------------------------------------------


def test_response_format_kinds() -> None:
    assert response_format_grammar(None) is None
    assert response_format_grammar({"type": "text"}) is None
    assert response_format_grammar({"type": "json_object"}).param == "response_format"
    chat = {"type": "json_schema", "json_schema": {"name": "p", "schema": WEATHER}}
    assert response_format_grammar(chat).param == "response_format.json_schema.schema"
    # The Responses API's text.format: the same keys at the top level.
    flat = {"type": "json_schema", "name": "p", "schema": WEATHER, "strict": True}
    assert response_format_grammar(flat, "text.format").param == "text.format.schema"


@pytest.mark.parametrize(
    ("fmt", "param"),
    [
        (
            {"type": "json_schema", "json_schema": {"schema": {}}},
            "response_format.json_schema.name",
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}, "...schema"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}, "...schema"),
        ({"type": "yaml"}, "response_format.type"),
    ],
)
def test_response_format_errors(fmt: dict[str, Any], param: str) -> None:
    with pytest.raises(StructuredOutputError) as e:
        response_format_grammar(fmt)
    assert e.value.param.endswith(param.lstrip("."))


def test_guided_fields() -> None:
    assert guided_grammar({"json": None, "regex": None}) is None
    assert guided_grammar({"regex": "a+"}).param == "guided_regex"
    assert guided_grammar({"choice": ["a"]}, "", "structured_outputs").param == (
        "structured_outputs.choice"
    )
    with pytest.raises(StructuredOutputError, match="only one") as e:
        guided_grammar({"regex": "a", "choice": ["b"]})
    assert e.value.param == "guided_regex"
    with pytest.raises(StructuredOutputError) as e:
        guided_grammar({"choice": []})
    assert e.value.param == "guided_choice"
    with pytest.raises(StructuredOutputError) as e:
        guided_grammar({"structural_tag": "x"}, "", "structured_outputs")
    assert e.value.param == "structured_outputs.structural_tag"


@pytest.mark.parametrize(
    ("spec", "param"),
    [
        (lambda: guided_grammar({"json": {"type": "foo"}}), "guided_json"),
        (lambda: guided_grammar({"regex": "(unclosed"}), "guided_regex"),
        (lambda: guided_grammar({"grammar": "start: missing_rule"}), "guided_grammar"),
        (
            lambda: response_format_grammar(
                {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/no"}}}
            ),
            "response_format.json_schema.schema",
        ),
    ],
)
def test_compile_errors_name_the_field(compiler: GrammarCompiler, spec: Any, param: str) -> None:
    with pytest.raises(StructuredOutputError) as e:
        asyncio.run(compiler.constraint(spec()))
    assert e.value.param == param
    assert "cannot be compiled" in e.value.message


def test_compile_timeout(compiler: GrammarCompiler) -> None:
    slow = GrammarCompiler(compiler.hf, 768, [EOS], timeout=1e-9)
    slow._lltok = compiler.tokenizer()
    # Many distinct bounded repetitions: enough work that it cannot finish in a nanosecond.
    schema = {
        "type": "object",
        "properties": {
            f"k{i}": {"type": "string", "pattern": f"^[a-z]{{{i},{i * 7}}}$"} for i in range(1, 60)
        },
    }
    with pytest.raises(StructuredOutputError, match="longer than") as e:
        asyncio.run(slow.constraint(guided_grammar({"json": schema})))
    assert e.value.param == "guided_json"


def test_compiled_grammars_are_cached(compiler: GrammarCompiler) -> None:
    spec = guided_grammar({"json": WEATHER})
    assert compiler.build(spec) is compiler.build(spec)


def test_json_layout_is_fixed(compiler: GrammarCompiler) -> None:
    spec = guided_grammar({"json": WEATHER})
    m = compiler.build(spec).deep_copy()
    ok = json.dumps({"city": "Oslo", "days": 3})
    assert m.try_consume_tokens(compiler.hf.encode(ok)) == len(compiler.hf.encode(ok))
    assert m.is_accepting()
    padded = compiler.build(spec).deep_copy()
    text = '{ "city": "Oslo", "days": 3}'
    assert padded.try_consume_tokens(compiler.hf.encode(text)) < len(compiler.hf.encode(text))


@pytest.mark.parametrize("seed", range(4))
def test_regex_and_choice_walks(compiler: GrammarCompiler, seed: int) -> None:
    import re

    text = walk(compiler, guided_grammar({"regex": r"[0-9]{3}-[a-z]{2,4}"}), seed)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text)
    assert walk(compiler, guided_grammar({"choice": ["yes", "no", "maybe"]}), seed) in (
        "yes",
        "no",
        "maybe",
    )
    lark = 'start: "(" num (" + " num)* ")"\nnum: /[1-9][0-9]?/'
    assert re.fullmatch(
        r"\(\d+( \+ \d+)*\)", walk(compiler, guided_grammar({"grammar": lark}), seed)
    )


# --- forced tool calls, per family -------------------------------------------------


class _NewMistral:
    """A vocabulary with Mistral v11's `[ARGS]` token (as text here)."""

    def marker(self, text: str) -> str:
        return json.dumps(text)

    def has_token(self, text: str) -> bool:
        return text == "[ARGS]"


def _calls(family: str, text: str) -> list[Any]:
    parser = get_tool_parser(family)(TOOLS)
    parsed = parser.feed(text)
    parsed.merge(parser.finish())
    assert not parsed.content.strip(), (family, text, parsed.content)
    return collect_calls(parsed.calls)


@pytest.mark.parametrize("family", sorted(FORMATS))
@pytest.mark.parametrize("seed", range(3))
def test_forced_calls_parse_and_validate(compiler: GrammarCompiler, family: str, seed: int) -> None:
    parser = get_tool_parser(family)
    for name, many in ((None, True), ("get_weather", False), ("ping", False)):
        spec = forced_tool_grammar(parser, TOOLS, name, parallel=many, vocab=compiler)
        text = walk(compiler, spec, seed)
        calls = _calls(family, text)
        assert calls, (family, text)
        if not many:
            assert len(calls) == 1 and calls[0].name == name, (family, text)
        for call in calls:
            schema = SCHEMAS[call.name] or {"type": "object", "properties": {}}
            jsonschema.validate(json.loads(call.arguments), schema)


def test_mistral_v11_form(compiler: GrammarCompiler) -> None:
    spec = forced_tool_grammar(
        get_tool_parser("mistral"), TOOLS, "get_weather", vocab=_NewMistral()
    )
    text = walk(compiler, spec, 0)
    assert text.startswith("[TOOL_CALLS]get_weather[ARGS]{")
    (call,) = _calls("mistral", text)
    jsonschema.validate(json.loads(call.arguments), WEATHER)


def test_forced_tool_errors() -> None:
    with pytest.raises(StructuredOutputError, match="not supported") as e:
        forced_tool_grammar(get_tool_parser("pythonic"), TOOLS)
    assert e.value.param == "tool_choice"
    with pytest.raises(StructuredOutputError, match="no known tool-call format"):
        forced_tool_grammar(None, TOOLS)
    with pytest.raises(StructuredOutputError, match="No tool named"):
        forced_tool_grammar(get_tool_parser("hermes"), TOOLS, "nope")


def test_special_markers_are_tokens(compiler: GrammarCompiler) -> None:
    assert compiler.marker("<|im_end|>") == f"<[{EOS}]>"
    assert compiler.marker("<tool_call>") == '"<tool_call>"'


def test_added_markers_that_are_not_special_are_tokens(compiler: GrammarCompiler) -> None:
    """Qwen2.5's `<tool_call>` is an added token its tokenizer does not mark special;
    llguidance reads it as a special token all the same, so a text literal for it
    rejected the very token the mask allowed, and a forced call ended right after it
    (`<tool_call><|im_end|>`)."""
    hf = copy.deepcopy(compiler.hf)
    hf.add_tokens(["<tool_call>", "</tool_call>"])  # special=False, as Qwen2.5's
    start, end = hf.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    qwen = GrammarCompiler(hf, len(hf), [EOS])
    assert qwen.marker("<tool_call>") == f"<[{start}]>"
    assert qwen.tokenizer().is_special_token(start)
    spec = forced_tool_grammar(get_tool_parser("hermes"), TOOLS, "ping", vocab=qwen)
    m = qwen.build(spec).deep_copy()
    assert m.consume_token(start), m.get_error()
    ids = hf.encode('\n{"name": "ping", "arguments": {}}\n', add_special_tokens=False)
    assert m.consume_tokens(ids), m.get_error()
    assert m.consume_token(end) and m.is_accepting()


# --- the engine side ----------------------------------------------------------------


def _seq(c: Constraint, out: list[int]) -> Any:
    return SimpleNamespace(
        params=SimpleNamespace(constraint=c), output_ids=out, finished=False, grammar=None
    )


def test_constraint_starts_after_reasoning(compiler: GrammarCompiler) -> None:
    spec = guided_grammar({"choice": ["yes"]})
    base = asyncio.run(compiler.constraint(spec))
    think, end = 5, (6, 7)
    # The template opened the section: free until its end marker, then the grammar.
    opened = Constraint(base.matcher, base.what, base.n_vocab, think, end, True)
    seq = _seq(opened, [11, 12, 6])
    masks = GrammarMasks({EOS})
    row = np.array(masks.allowed([seq], 768))[0]
    assert row.all() and seq.grammar.phase == REASONING
    seq.output_ids.append(7)
    row = np.array(masks.allowed([seq], 768))[0]
    assert seq.grammar.phase == ANSWER and not row[EOS] and row.sum() < 10
    # Not opened: the first token may open it, or start the answer.
    maybe = Constraint(base.matcher, base.what, base.n_vocab, think, end, False)
    seq = _seq(maybe, [])
    row = np.array(masks.allowed([seq], 768))[0]
    assert seq.grammar.phase == MAY_REASON and row[think] and not row[EOS]
    y = compiler.hf.encode("yes")
    seq.output_ids.extend(y)
    row = np.array(masks.allowed([seq], 768))[0]
    assert seq.grammar.phase == ANSWER and row[EOS] and row.sum() == 1


def test_state_after_error_allows_only_eos(compiler: GrammarCompiler) -> None:
    c = asyncio.run(compiler.constraint(guided_grammar({"choice": ["yes"]})))
    seq = _seq(c, compiler.hf.encode("no"))
    row = np.array(GrammarMasks({EOS}).allowed([seq], 770))[0]
    assert isinstance(seq.grammar, GrammarState) and seq.grammar.matcher.is_error()
    assert row[EOS] and row.sum() == 1 and row.shape == (770,)


def test_lark_with_json_is_valid(compiler: GrammarCompiler) -> None:
    spec = forced_tool_grammar(get_tool_parser("hermes"), TOOLS, vocab=compiler)
    assert LLMatcher.validate_grammar(spec.grammar, compiler.tokenizer()) == ""
