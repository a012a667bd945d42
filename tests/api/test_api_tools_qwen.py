"""Tool calling end to end with the real Qwen2.5-Coder-0.5B-Instruct (hermes format).

The model is asked about the weather, calls `get_weather` through the `openai` SDK, gets
the result back as a `tool` message and answers with it; streamed and not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server_utils import Server, run_server

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "description": "The city name"}},
                "required": ["city"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(qwen_gguf: Path) -> Iterator[Server]:
    with run_server(str(qwen_gguf), "--max-model-len", "2048", startup_timeout=900) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_tool_call_round_trip(client: openai.OpenAI) -> None:
    model = _model(client)
    r = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=100
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    assert not choice.message.content  # no part of the <tool_call> markup leaks

    messages: list[Any] = [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"city": "Paris", "temperature_c": 31, "sky": "sunny"}),
        },
    ]
    # With the tools still shown, this 0.5B model repeats its call before answering;
    # tool_choice "none" asks for the answer (the tools are then not shown at all).
    answer = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=60,
    )
    final = answer.choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert "31" in final.message.content  # the tool's result reached the model


def test_tool_call_streamed(client: openai.OpenAI) -> None:
    model = _model(client)
    stream = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=100, stream=True
    )
    content = ""
    calls: dict[int, dict[str, str]] = {}
    arg_deltas = 0
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.id is not None:  # the first delta of a call: id and name
                    assert tc.index not in calls and tc.function.name == "get_weather"
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": ""}
                calls[tc.index]["args"] += tc.function.arguments or ""
                arg_deltas += 1
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert "<tool" not in content and not content.strip()
    assert list(calls) == [0]
    assert "paris" in json.loads(calls[0]["args"])["city"].lower()
    assert arg_deltas > 2  # the arguments came in pieces, as they were generated

    # The same call as the non-streamed request (greedy), with its own id.
    r = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=100
    )
    assert r.choices[0].message.tool_calls[0].function.arguments == calls[0]["args"]


def test_tool_choice_none_gives_text(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=_model(client),
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="none",
        temperature=0,
        max_tokens=30,
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert not r.choices[0].message.tool_calls


ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]


def test_anthropic_tool_loop(server: Server) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    kw: dict[str, Any] = {"model": "claude-local", "max_tokens": 100, "tools": ANTHROPIC_TOOLS}
    first = client.messages.create(messages=QUESTION, extra_body={"temperature": 0}, **kw)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert "paris" in use.input["city"].lower()

    # Streamed: the same call, its input built from input_json_delta events.
    with client.messages.stream(messages=QUESTION, extra_body={"temperature": 0}, **kw) as s:
        deltas = [e for e in s if e.type == "content_block_delta"]
        streamed = s.get_final_message()
    assert any(e.delta.type == "input_json_delta" for e in deltas)
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]

    history = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": use.id,
                    "content": json.dumps({"city": "Paris", "temperature_c": 31, "sky": "sunny"}),
                }
            ],
        },
    ]
    answer = client.messages.create(
        messages=history, tool_choice={"type": "none"}, extra_body={"temperature": 0}, **kw
    )
    assert answer.stop_reason == "end_turn"
    assert "31" in "".join(b.text for b in answer.content if b.type == "text")
    # The second turn starts with the first one's prompt: its KV is reused.
    assert answer.usage.cache_read_input_tokens > 0
