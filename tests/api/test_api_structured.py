"""Structured output through a real `pippin serve` on a tiny random-weight model.

Unconstrained, the model writes noise; under a schema, regex, choice or forced tool
call, whatever it writes must parse and validate. Requests run concurrently, mixed with
unconstrained ones, so constrained and free rows share batches.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from support.server_utils import Server, run_server

MSG = [{"role": "user", "content": "Describe something as JSON."}]


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 8}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
COLOR = {"enum": ["red", "green", "blue"]}

# 30 schemas: nested objects, arrays with bounds, enums, anyOf, patterns, refs, tuples.
SCHEMAS: list[dict[str, Any]] = [
    obj({"name": NAME, "age": SMALL}),
    COLOR,
    {"const": "fixed"},
    {"type": "boolean"},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    {"type": "array", "items": SMALL, "minItems": 1, "maxItems": 3},
    obj({"owner": obj({"name": NAME, "color": COLOR})}),
    obj({"a": obj({"b": obj({"c": SMALL})})}),
    {"type": "array", "items": obj({"id": SMALL, "ok": {"type": "boolean"}}), "maxItems": 2},
    {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "integer", "maximum": 9}]},
    {
        "anyOf": [
            obj({"kind": {"const": "circle"}, "r": SMALL}),
            obj({"kind": {"const": "square"}, "side": SMALL}),
        ]
    },
    obj({"label": {"type": ["string", "null"], "maxLength": 6}}),
    obj({"id": SMALL, "note": NAME, "tag": COLOR}, required=["id"]),
    obj({"level": {"enum": ["low", "high"]}, "score": SMALL}, required=["level"]),
    {
        "$defs": {"point": obj({"x": SMALL, "y": SMALL})},
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
        "additionalProperties": False,
    },
    {"type": "array", "prefixItems": [NAME, SMALL, {"type": "boolean"}], "items": False},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"enum": [1, "one", None, True]},
    obj({"code": {"type": "string", "pattern": "^[a-f0-9]{4}$"}, "n": SMALL}),
    {"type": "array", "items": {"type": "array", "items": SMALL, "maxItems": 2}, "maxItems": 2},
    obj({"price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10}}),
    obj({"colors": {"type": "array", "items": COLOR, "minItems": 1, "maxItems": 3}}),
    {"allOf": [obj({"a": SMALL}, required=["a"]), {"type": "object"}]},
    obj({"v": {"anyOf": [COLOR, {"type": "integer", "minimum": 0, "maximum": 3}]}}),
    obj({"user": obj({"email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}})}),
    obj({"matrix": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 2, "maxItems": 2}}),
    obj({"flag": {"type": "boolean"}, "count": SMALL, "name": NAME, "color": COLOR}),
    {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
]
assert len(SCHEMAS) == 30

WEATHER = obj(
    {"city": {"enum": ["Paris", "Rome", "Oslo"]}, "days": {"type": "integer", "minimum": 1}},
    required=["city"],
)
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "parameters": WEATHER, "strict": True},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": obj({"zone": COLOR})}},
]
TOOL_SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    with run_server(
        str(tiny_models("llama")), "--served-model-name", "tiny", "--max-model-len", "2048"
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def fmt(schema: dict[str, Any], strict: bool = False) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": strict}}


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", MSG)
    return client.chat.completions.create(**kw)


def test_schemas_in_mixed_batches(server: Server) -> None:
    """30 schemas and 10 free requests at once: every constrained answer validates, and
    the free ones are exactly what they are alone (same seeds)."""

    async def run() -> tuple[list[Any], list[str], list[str]]:
        client = server.async_client()
        free = [
            client.chat.completions.create(
                model="tiny", messages=MSG, max_tokens=40, seed=100 + i, temperature=1.0
            )
            for i in range(10)
        ]
        constrained = [
            client.chat.completions.create(
                model="tiny",
                messages=MSG,
                max_tokens=300,
                seed=i,
                temperature=1.0,
                response_format=fmt(schema, strict=i % 2 == 0),  # type: ignore[arg-type]
            )
            for i, schema in enumerate(SCHEMAS)
        ]
        results = await asyncio.gather(*constrained, *free)
        alone = []
        for i in range(3):
            r = await client.chat.completions.create(
                model="tiny", messages=MSG, max_tokens=40, seed=100 + i, temperature=1.0
            )
            alone.append(r.choices[0].message.content)
        await client.close()
        mixed = [r.choices[0].message.content for r in results[len(SCHEMAS) :]]
        return results[: len(SCHEMAS)], mixed, alone

    constrained, mixed, alone = asyncio.run(run())
    for schema, r in zip(SCHEMAS, constrained):
        ch = r.choices[0]
        assert ch.finish_reason == "stop", (schema, ch.message.content)
        value = json.loads(ch.message.content)
        jsonschema.validate(value, schema)
    assert mixed[:3] == alone
    # The free requests are noise, not JSON: the constraint did not leak into them.
    assert sum(_is_json(t) for t in mixed) < 3


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_json_object(client: openai.OpenAI) -> None:
    r = chat(client, response_format={"type": "json_object"}, max_tokens=600, seed=3, n=3)
    for ch in r.choices:
        if ch.finish_reason == "stop":
            assert isinstance(json.loads(ch.message.content), dict)
        else:  # cut off by max_tokens: a prefix of an object
            assert ch.finish_reason == "length" and ch.message.content.startswith("{")


def test_streamed_schema(client: openai.OpenAI) -> None:
    schema = SCHEMAS[12]
    stream = chat(client, response_format=fmt(schema), max_tokens=200, seed=1, stream=True)
    text, finish = "", None
    for chunk in stream:
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_max_tokens_cuts_the_answer(client: openai.OpenAI) -> None:
    r = chat(client, response_format=fmt(obj({"s": {"type": "string"}})), max_tokens=4, seed=0)
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.content.startswith('{"s"')  # a prefix of the object


def test_regex_choice_grammar_on_chat_and_completions(client: openai.OpenAI) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    r = chat(client, max_tokens=30, seed=2, n=4, extra_body={"guided_regex": pattern})
    for ch in r.choices:
        assert re.fullmatch(pattern, ch.message.content) and ch.finish_reason == "stop"
    choices = ["yes", "no", "maybe"]
    c = client.completions.create(
        model="tiny",
        prompt="Answer:",
        max_tokens=10,
        n=4,
        seed=5,
        extra_body={"guided_choice": choices},
    )
    assert all(ch.text in choices for ch in c.choices)
    c = client.completions.create(
        model="tiny",
        prompt="Sum:",
        max_tokens=40,
        seed=5,
        extra_body={"structured_outputs": {"grammar": 'start: NUM " + " NUM\nNUM: /[1-9][0-9]?/'}},
    )
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", c.choices[0].text)
    r = chat(client, max_tokens=200, seed=4, extra_body={"guided_json": SCHEMAS[0]})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS[0])
    c = client.completions.create(
        model="tiny", prompt="{", max_tokens=100, seed=1, extra_body={"guided_json": SCHEMAS[8]}
    )
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMAS[8])


def _check_calls(message: Any) -> list[Any]:
    calls = message.tool_calls or []
    for call in calls:
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, TOOL_SCHEMAS[call.function.name])
    return calls


@pytest.mark.parametrize("seed", range(3))
def test_forced_tool_calls(client: openai.OpenAI, seed: int) -> None:
    r = chat(
        client,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        seed=seed,
    )
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(_check_calls(ch.message)) == 1
    assert ch.message.content is None
    r = chat(
        client,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=200,
        seed=seed,
    )
    ch = r.choices[0]
    (call,) = _check_calls(ch.message)
    assert call.function.name == "get_time" and ch.finish_reason == "tool_calls"
    # Several calls may come with parallel_tool_calls; all of them valid.
    r = chat(client, tools=TOOLS, tool_choice="required", max_tokens=400, seed=seed, n=2)
    for ch in r.choices:
        calls = _check_calls(ch.message) if ch.finish_reason == "tool_calls" else []
        assert ch.finish_reason == "length" or calls


def test_forced_function_call_deprecated_form(client: openai.OpenAI) -> None:
    functions = [t["function"] for t in TOOLS]
    r = chat(
        client,
        functions=functions,
        function_call={"name": "get_weather"},
        max_tokens=200,
        seed=9,
    )
    (call,) = _check_calls(r.choices[0].message)
    assert call.function.name == "get_weather"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": fmt({"type": "nope"})}, "response_format.json_schema.schema"),
        (
            {"response_format": fmt({"type": "string", "pattern": "(open"})},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, None),
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"structured_outputs": {"whitespace": 1}}, "structured_outputs.whitespace"),
        # Keys a format does not define are refused by name, not ignored.
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "sch": {}}}},
            "response_format.json_schema.sch",
        ),
        (
            {"response_format": {**fmt({"type": "object"}), "strict": True}},
            "response_format.strict",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
    ],
)
def test_bad_constraints_are_400(server: Server, extra: dict[str, Any], param: str | None) -> None:
    body = {"model": "tiny", "messages": MSG, "max_tokens": 5, **extra}
    with server.http() as h:
        r = h.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    else:  # pydantic or our own check, either names a response_format field
        assert err["param"].startswith("response_format"), err


def test_bad_constraint_on_completions_is_400(server: Server) -> None:
    body = {"model": "tiny", "prompt": "x", "guided_json": {"type": 5}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_json"
