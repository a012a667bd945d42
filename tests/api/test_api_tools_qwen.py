"""Tool calling end to end with the real Qwen2.5-Coder-0.5B-Instruct (hermes format).

The model is asked about the weather, calls `get_weather` through the `openai` SDK, gets
the result back as a `tool` message and answers with it; streamed and not. The Responses
API's function-call loop and its stream adding up to the response run here too (one server
of the real model rather than one more in test_api_responses.py).

Requests that do not depend on each other are sent together: the server batches them, and
on a CPU a batch's decode step costs about one request's. So every test's requests
(`@BATCH.first`) go out at once before the tests run, each test's next turns
(`@BATCH.then`) as soon as its first answers are in (support/asked.py); each test then
checks its own (`mine("part")` raises what that request raised).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest
from support.asked import Asks, Batch, Got
from support.server_utils import Server, run_server

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

BATCH = Batch()


@pytest.fixture(scope="module")
def server(qwen_gguf: Path) -> Iterator[Server]:
    with run_server(str(qwen_gguf), "--max-model-len", "2048", startup_timeout=900) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def answers(request: pytest.FixtureRequest, server: Server) -> dict[str, Any]:
    return BATCH.ask(request, server)


@pytest.fixture
def mine(request: pytest.FixtureRequest, answers: dict[str, Any]) -> Got:
    """This test's answers by part name; raises what the request raised."""
    return BATCH.mine(answers, request)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _anthropic(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def _weather_chat(client: openai.OpenAI, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=_model(client), messages=QUESTION, tools=TOOLS, temperature=0, **kw
    )


@BATCH.first("test_tool_call_round_trip")
def _(server: Server) -> Asks:
    return {"first": lambda: _weather_chat(server.client(), max_tokens=100)}


def _round_trip_messages(first: Any) -> list[Any]:
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    return [
        *QUESTION,
        choice.message.model_dump(exclude_none=True),
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"city": "Paris", "temperature_c": 31, "sky": "sunny"}),
        },
    ]


@BATCH.then("test_tool_call_round_trip")
def _(server: Server, got: Got) -> Asks:
    messages = _round_trip_messages(got("first"))
    client = server.client()
    # With the tools still shown, this 0.5B model repeats its call before answering;
    # tool_choice "none" asks for the answer (the tools are then not shown at all).
    return {
        "answer": lambda: client.chat.completions.create(
            model=_model(client),
            messages=messages,
            tools=TOOLS,
            tool_choice="none",
            temperature=0,
            max_tokens=60,
        )
    }


def test_tool_call_round_trip(mine: Got) -> None:
    r = mine("first")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    assert "paris" in json.loads(call.function.arguments)["city"].lower()
    assert not choice.message.content  # no part of the <tool_call> markup leaks

    answer = mine("answer")
    final = answer.choices[0]
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert "31" in final.message.content  # the tool's result reached the model


@BATCH.first("test_tool_call_streamed")
def _(server: Server) -> Asks:
    client = server.client()
    return {
        "chunks": lambda: list(_weather_chat(client, max_tokens=100, stream=True)),
        "whole": lambda: _weather_chat(client, max_tokens=100),
    }


def test_tool_call_streamed(mine: Got) -> None:
    chunks, r = mine("chunks"), mine("whole")
    content = ""
    calls: dict[int, dict[str, str]] = {}
    arg_deltas = 0
    finish = None
    for chunk in chunks:
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
    assert r.choices[0].message.tool_calls[0].function.arguments == calls[0]["args"]


@BATCH.first("test_tool_choice_none_gives_text")
def _(server: Server) -> Asks:
    return {"r": lambda: _weather_chat(server.client(), tool_choice="none", max_tokens=30)}


def test_tool_choice_none_gives_text(mine: Got) -> None:
    r = mine("r")
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
ANTHROPIC_KW: dict[str, Any] = {
    "model": "claude-local",
    "max_tokens": 100,
    "tools": ANTHROPIC_TOOLS,
}


@BATCH.first("test_anthropic_tool_loop")
def _(server: Server) -> Asks:
    client = _anthropic(server)
    kw = ANTHROPIC_KW

    def stream() -> tuple[list[Any], Any]:
        with client.messages.stream(messages=QUESTION, extra_body={"temperature": 0}, **kw) as s:
            return [e for e in s if e.type == "content_block_delta"], s.get_final_message()

    return {
        "first": lambda: client.messages.create(
            messages=QUESTION, extra_body={"temperature": 0}, **kw
        ),
        "streamed": stream,
    }


@BATCH.then("test_anthropic_tool_loop")
def _(server: Server, got: Got) -> Asks:
    first = got("first")
    (use,) = [b for b in first.content if b.type == "tool_use"]
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
    client = _anthropic(server)
    return {
        "answer": lambda: client.messages.create(
            messages=history,
            tool_choice={"type": "none"},
            extra_body={"temperature": 0},
            **ANTHROPIC_KW,
        )
    }


def test_anthropic_tool_loop(mine: Got) -> None:
    first, (deltas, streamed) = mine("first"), mine("streamed")
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id.startswith("toolu_")
    assert "paris" in use.input["city"].lower()

    # Streamed: the same call, its input built from input_json_delta events.
    assert any(e.delta.type == "input_json_delta" for e in deltas)
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]

    answer = mine("answer")
    assert answer.stop_reason == "end_turn"
    assert "31" in "".join(b.text for b in answer.content if b.type == "text")
    # The second turn starts with the first one's prompt: its KV is reused.
    assert answer.usage.cache_read_input_tokens > 0


# --- the Responses API: a function-call loop; a stream adds up to the response ------------

RESPONSES_TOOL: dict[str, Any] = {"type": "function", **TOOLS[0]["function"]}
QUESTION_TEXT = QUESTION[0]["content"]
WEATHER_RESULT = json.dumps({"city": "Paris", "temperature_c": 31, "sky": "sunny"})


def text_of(response: Any) -> str:
    return "".join(
        part.text for item in response.output if item.type == "message" for part in item.content
    )


def _loop_kw(client: openai.OpenAI) -> dict[str, Any]:
    return {"model": _model(client), "tools": [RESPONSES_TOOL], "temperature": 0}


@BATCH.first("test_responses_function_call_loop")
def _(server: Server) -> Asks:
    client = server.client()
    return {
        "first": lambda: client.responses.create(
            input=QUESTION_TEXT, max_output_tokens=100, **_loop_kw(client)
        )
    }


@BATCH.then("test_responses_function_call_loop")
def _(server: Server, got: Got) -> Asks:
    client = server.client()
    first = got("first")
    (call,) = [i for i in first.output if i.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT}
    return {
        "second": lambda: client.responses.create(
            input=[output], previous_response_id=first.id, max_output_tokens=60, **_loop_kw(client)
        ),
        # The call's result as chat completions renders it.
        "chat": lambda: client.chat.completions.create(
            model=_model(client),
            messages=[
                {"role": "user", "content": QUESTION_TEXT},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call.call_id,
                            "type": "function",
                            "function": {"name": call.name, "arguments": call.arguments},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call.call_id, "content": WEATHER_RESULT},
            ],
            tools=TOOLS,  # RESPONSES_TOOL in chat's shape
            max_tokens=1,
        ),
        # Stateless, the items sent back by hand.
        "by_hand": lambda: client.responses.create(
            input=[
                {"role": "user", "content": QUESTION_TEXT},
                call.model_dump(by_alias=True),
                output,
            ],
            store=False,
            max_output_tokens=1,
            **_loop_kw(client),
        ),
    }


def test_responses_function_call_loop(mine: Got) -> None:
    first = mine("first")
    assert first.status == "completed"
    calls = [i for i in first.output if i.type == "function_call"]
    assert [i.type for i in first.output] == ["function_call"]  # no empty message beside it
    (call,) = calls
    assert call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert "paris" in json.loads(call.arguments)["city"].lower()
    assert first.tools[0].name == "get_weather"

    second = mine("second")
    assert second.status in ("completed", "incomplete") and second.output
    for item in second.output:
        assert item.type in ("message", "function_call")
    # The call's result reached the prompt exactly as chat completions renders it.
    assert second.usage.input_tokens == mine("chat").usage.prompt_tokens
    # Stateless, the items sent back by hand give the same prompt.
    assert mine("by_hand").usage.input_tokens == second.usage.input_tokens


def _plain(r: Any) -> dict[str, Any]:
    """A response as sent, without what the SDK's stream helper adds (`parsed...`)."""
    body = r.model_dump()
    for item in body["output"]:
        item.pop("parsed_arguments", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return body


def _comparable(r: Any) -> dict[str, Any]:
    """Without what differs between two runs: ids, times and prefix-cache hits."""
    body = _plain(r)
    for key in ("id", "created_at", "completed_at"):
        body.pop(key)
    body["usage"]["input_tokens_details"].pop("cached_tokens")
    for item in body["output"]:
        item.pop("id")
        item.pop("call_id", None)
    return body


def _adds_up_kw(client: openai.OpenAI, tools: bool) -> dict[str, Any]:
    kw: dict[str, Any] = {"model": _model(client), "temperature": 0, "max_output_tokens": 60}
    if tools:
        kw.update(input=QUESTION_TEXT, tools=[RESPONSES_TOOL])
    else:
        kw["input"] = "What is the capital of France? Answer in one sentence."
    return kw


@BATCH.first("test_responses_stream_adds_up")
def _(server: Server, tools: bool) -> Asks:
    client = server.client()

    def stream() -> tuple[list[Any], Any]:
        with client.responses.stream(**_adds_up_kw(client, tools)) as s:
            return list(s), s.get_final_response()

    return {
        "whole": lambda: client.responses.create(**_adds_up_kw(client, tools)),
        "stream": stream,
    }


@pytest.mark.parametrize("tools", [False, True])
def test_responses_stream_adds_up(client: openai.OpenAI, mine: Got, tools: bool) -> None:
    whole, (events, final) = mine("whole"), mine("stream")
    assert whole.status == "completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _comparable(final) == _comparable(whole)
    assert _plain(client.responses.retrieve(final.id)) == _plain(final)
    if tools:
        args = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        assert args == final.output[0].arguments
    else:
        assert "Paris" in text_of(final)


# --- forced calls: every forced form, on each API, streamed and not ---------

PROMPTS = ["What's the weather in Paris?", "hello"]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _sampling(temperature: int) -> dict[str, Any]:
    """Greedy, or sampled at temperature 1 with a seed (chat only has `seed`)."""
    return {"temperature": 0} if temperature == 0 else {"temperature": 1, "seed": 7}


def _check_city(name: str, args: dict[str, Any], prompt: str, greedy: bool) -> None:
    # The grammar makes any answer a valid call (sampled, even an empty city);
    # greedily, this one is the right one.
    assert name == "get_weather" and isinstance(args["city"], str)
    if greedy:
        assert args["city"].strip()
        if "Paris" in prompt:
            assert "paris" in args["city"].lower()


def _chat_stream(client: openai.OpenAI, **kw: Any) -> tuple[str, dict[int, list[str]], str]:
    """(content, {index: [name, arguments]}, finish_reason) of a streamed chat answer."""
    content, calls, finish = "", {}, ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                if tc.id is not None:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return content, calls, finish


@BATCH.first("test_forced_call_chat")
def _(server: Server, choice: Any, temperature: int) -> Asks:
    client = server.client()

    def kw() -> dict[str, Any]:
        return {
            "model": _model(client),
            "tools": TOOLS,
            "tool_choice": choice,
            "parallel_tool_calls": False,
            "max_tokens": 60,
            **_sampling(temperature),
        }

    asks: Asks = {
        str(i): lambda p=prompt: client.chat.completions.create(
            messages=[{"role": "user", "content": p}], **kw()
        )
        for i, prompt in enumerate(PROMPTS)
    }
    # Streamed: the same call as the first (greedy, or the same seed).
    messages = [{"role": "user", "content": PROMPTS[0]}]
    asks["streamed"] = lambda: _chat_stream(client, messages=messages, **kw())
    return asks


@pytest.mark.parametrize("temperature", [0, 1])
@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_call_chat(mine: Got, choice: Any, temperature: int) -> None:
    """Forced calls were `<tool_call><|im_end|>`: `content: "<tool_call>"`, no call."""
    calls = []
    for i, prompt in enumerate(PROMPTS):
        ch = mine(str(i)).choices[0]
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        (call,) = ch.message.tool_calls
        args = json.loads(call.function.arguments)
        _check_city(call.function.name, args, prompt, not temperature)
        calls.append([call.function.name, call.function.arguments])
    assert mine("streamed") == ("", {0: calls[0]}, "tool_calls")


ANTHROPIC_FORCED = [
    {"type": "any", "disable_parallel_tool_use": True},
    {"type": "tool", "name": "get_weather"},
]


@BATCH.first("test_forced_call_anthropic")
def _(server: Server, choice: dict[str, Any], temperature: int) -> Asks:
    client = _anthropic(server)
    # No seed in this API: sampled answers are only checked for what the grammar ensures.
    sampling = {"temperature": temperature, "top_p": 0.9} if temperature else {"temperature": 0}
    kw: dict[str, Any] = {
        "model": "claude-local",
        "max_tokens": 60,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": choice,
        "extra_body": sampling,
    }

    def stream() -> Any:
        with client.messages.stream(messages=[{"role": "user", "content": PROMPTS[0]}], **kw) as s:
            return s.get_final_message()

    asks: Asks = {
        str(i): lambda p=prompt: client.messages.create(
            messages=[{"role": "user", "content": p}], **kw
        )
        for i, prompt in enumerate(PROMPTS)
    }
    asks["streamed"] = stream
    return asks


@pytest.mark.parametrize("temperature", [0, 1])
@pytest.mark.parametrize("choice", ANTHROPIC_FORCED, ids=["any", "tool"])
def test_forced_call_anthropic(mine: Got, choice: dict[str, Any], temperature: int) -> None:
    inputs = []
    for i, prompt in enumerate(PROMPTS):
        m = mine(str(i))
        assert m.stop_reason == "tool_use"
        assert [b.type for b in m.content] == ["tool_use"]
        _check_city(m.content[0].name, m.content[0].input, prompt, not temperature)
        inputs.append(m.content[0].input)
    streamed = mine("streamed")
    assert streamed.stop_reason == "tool_use"
    assert [b.type for b in streamed.content] == ["tool_use"]
    _check_city(streamed.content[0].name, streamed.content[0].input, PROMPTS[0], not temperature)
    if not temperature:
        assert streamed.content[0].input == inputs[0]


@BATCH.first("test_forced_call_responses")
def _(server: Server, choice: Any, temperature: int) -> Asks:
    client = server.client()
    tools: Any = [{"type": "function", **TOOLS[0]["function"]}]
    # No seed in this API either.
    sampling = {"temperature": temperature, "top_p": 0.9} if temperature else {"temperature": 0}

    def kw() -> dict[str, Any]:
        return {
            "model": _model(client),
            "tools": tools,
            "tool_choice": choice,
            "parallel_tool_calls": False,
            "max_output_tokens": 60,
            "store": False,
            **sampling,
        }

    asks: Asks = {
        str(i): lambda p=prompt: client.responses.create(input=p, **kw())
        for i, prompt in enumerate(PROMPTS)
    }
    asks["events"] = lambda: list(client.responses.create(input=PROMPTS[0], stream=True, **kw()))
    return asks


@pytest.mark.parametrize("temperature", [0, 1])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"]
)
def test_forced_call_responses(mine: Got, choice: Any, temperature: int) -> None:
    arguments = []
    for i, prompt in enumerate(PROMPTS):
        r = mine(str(i))
        assert r.status == "completed"
        assert [o.type for o in r.output] == ["function_call"]
        call = r.output[0]
        _check_city(call.name, json.loads(call.arguments), prompt, not temperature)
        arguments.append(call.arguments)
    done = mine("events")[-1]
    assert done.type == "response.completed"
    assert [o.type for o in done.response.output] == ["function_call"]
    streamed = done.response.output[0]
    _check_city(streamed.name, json.loads(streamed.arguments), PROMPTS[0], not temperature)
    if not temperature:
        assert streamed.arguments == arguments[0]


@BATCH.first("test_forced_calls_in_one_batch")
def _(server: Server) -> Asks:
    async def run() -> list[Any]:
        client = server.async_client()
        model = (await client.models.list()).data[0].id
        jobs = []
        for i, prompt in enumerate(PROMPTS * 3):
            choice = ["required", NAMED, "auto"][i % 3]
            jobs.append(
                client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    tools=TOOLS,
                    tool_choice=choice,
                    parallel_tool_calls=False,
                    max_tokens=60,
                    temperature=1,
                    seed=i,
                )
            )
        return list(await asyncio.gather(*jobs))

    return {"all": lambda: asyncio.run(run())}


def test_forced_calls_in_one_batch(mine: Got) -> None:
    """Forced and free requests at once: each forced row's mask is for its own next token
    whatever else runs in the step (masks are computed while the device runs it)."""
    for i, r in enumerate(mine("all")):
        if i % 3 == 2:
            continue  # "auto": whatever the model likes
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch.message.content
        (call,) = ch.message.tool_calls
        _check_city(call.function.name, json.loads(call.function.arguments), "", False)


# --- a call cut off by max_tokens: no invented arguments -------------------

# 16 tokens of a forced call end inside its arguments: `... "arguments": {"city": "`.
CUT_TOKENS = 16
CALL_HEAD = '<tool_call>\n{"name": "get_weather", "arguments": {'


@BATCH.first("test_cut_call_chat")
def _(server: Server) -> Asks:
    client = server.client()

    def kw() -> dict[str, Any]:
        return {
            "model": _model(client),
            "messages": QUESTION,
            "tools": TOOLS,
            "tool_choice": NAMED,
            "temperature": 0,
            "max_tokens": CUT_TOKENS,
        }

    # Several calls (parallel): those that ended are calls, the one cut off is text.
    def several() -> dict[str, Any]:
        return kw() | {"tool_choice": "required", "max_tokens": 35}

    return {
        "r": lambda: client.chat.completions.create(**kw()),
        "streamed": lambda: _chat_stream(client, **kw()),
        "r2": lambda: client.chat.completions.create(**several()),
        "streamed2": lambda: _chat_stream(client, **several()),
    }


def test_cut_call_chat(mine: Got) -> None:
    r, (content, calls, finish), r2 = mine("r"), mine("streamed"), mine("r2")
    ch = r.choices[0]
    # As OpenAI: cut off, the content is what was generated; no call that did not end.
    assert ch.finish_reason == "length" and not ch.message.tool_calls
    assert ch.message.content.startswith(CALL_HEAD)
    written = ch.message.content.split('"arguments": ', 1)[1]
    # Streamed, the call's start and arguments were sent as they came: they stay, and
    # nothing is invented to close them.
    assert (content, finish) == ("", "length")
    ((name, args),) = calls.values()
    assert name == "get_weather" and written.startswith(args)
    with pytest.raises(ValueError):
        json.loads(args)

    ch = r2.choices[0]
    assert ch.finish_reason == "length"
    ended = [(c.function.name, c.function.arguments) for c in ch.message.tool_calls]
    assert ended and all(json.loads(a) for _, a in ended)
    assert "paris" in json.loads(ended[0][1])["city"].lower()
    assert "<tool_call>" in ch.message.content
    content, calls, finish = mine("streamed2")
    assert finish == "length" and len(calls) == len(ended) + 1
    assert [calls[i] for i in range(len(ended))] == [list(c) for c in ended]
    name, args = calls[len(ended)]
    assert ch.message.content.split('"arguments": ')[-1].startswith(args)
    with pytest.raises(ValueError):
        json.loads(args)


@BATCH.first("test_cut_call_anthropic")
def _(server: Server) -> Asks:
    client = _anthropic(server)
    kw: dict[str, Any] = {
        "model": "claude-local",
        "max_tokens": CUT_TOKENS,
        "messages": QUESTION,
        "tools": ANTHROPIC_TOOLS,
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "extra_body": {"temperature": 0},
    }

    def stream() -> tuple[list[Any], Any]:
        with client.messages.stream(**kw) as s:
            return list(s), s.get_final_message()

    return {"m": lambda: client.messages.create(**kw), "stream": stream}


def test_cut_call_anthropic(mine: Got) -> None:
    m, (events, streamed) = mine("m"), mine("stream")
    assert m.stop_reason == "max_tokens"
    assert [b.type for b in m.content] == ["text"]
    assert m.content[0].text.startswith(CALL_HEAD)
    # Streamed: the tool_use block as far as it went, its input never completed.
    assert not [e for e in events if e.type == "error"]
    assert streamed.stop_reason == "max_tokens"
    assert [(b.type, b.name) for b in streamed.content] == [("tool_use", "get_weather")]
    sent = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert m.content[0].text.split('"arguments": ', 1)[1].startswith(sent)


@BATCH.first("test_cut_call_responses")
def _(server: Server) -> Asks:
    client = server.client()

    def kw() -> dict[str, Any]:
        return {
            "model": _model(client),
            "input": QUESTION[0]["content"],
            "tools": [{"type": "function", **TOOLS[0]["function"]}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": CUT_TOKENS,
            "temperature": 0,
            "store": False,
        }

    return {
        "r": lambda: client.responses.create(**kw()),
        "events": lambda: list(client.responses.create(stream=True, **kw())),
    }


def test_cut_call_responses(mine: Got) -> None:
    r, events = mine("r"), mine("events")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"]
    text = r.output[0].content[0].text
    assert text.startswith(CALL_HEAD)
    # Streamed: the function_call item as far as it went, marked incomplete.
    done = events[-1]
    assert done.type == "response.incomplete"
    (item,) = done.response.output
    assert (item.type, item.name, item.status) == ("function_call", "get_weather", "incomplete")
    assert text.split('"arguments": ', 1)[1].startswith(item.arguments)


OLLAMA_OPTIONS = {"temperature": 0, "num_predict": 100}


def _ollama(server: Server) -> tuple[Any, str]:
    """Ollama's own client and the model it lists."""
    ollama = pytest.importorskip("ollama")
    client = ollama.Client(host=server.url, timeout=300)
    return client, client.list().models[0].model


@BATCH.first("test_ollama_tool_call_round_trip")
def _(server: Server) -> Asks:
    if importlib.util.find_spec("ollama") is None:
        return {}  # the test skips

    def chat(**kw: Any) -> Any:
        client, model = _ollama(server)
        return client.chat(
            model=model, messages=QUESTION, tools=TOOLS, options=OLLAMA_OPTIONS, **kw
        )

    return {"r": chat, "streamed": lambda: list(chat(stream=True))}


@BATCH.then("test_ollama_tool_call_round_trip")
def _(server: Server, got: Got) -> Asks:
    messages: list[Any] = [
        *QUESTION,
        got("r").message,
        {
            "role": "tool",
            "tool_name": "get_weather",
            "content": '{"temperature_c": 31, "sky": "sunny"}',
        },
    ]

    def answer() -> Any:
        client, model = _ollama(server)
        return client.chat(model=model, messages=messages, options=OLLAMA_OPTIONS)

    return {"answer": answer}


def test_ollama_tool_call_round_trip(mine: Got) -> None:
    """The same through Ollama's /api/chat and its `ollama` client: arguments as an
    object, the result back as a `tool` message with `tool_name`."""
    pytest.importorskip("ollama")
    r, streamed = mine("r"), mine("streamed")
    (call,) = r.message.tool_calls
    assert (
        call.function.name == "get_weather" and "paris" in call.function.arguments["city"].lower()
    )
    assert not r.message.content and r.done_reason == "stop"
    calls = [c for p in streamed for c in p.message.tool_calls or []]
    assert [c.function.model_dump() for c in calls] == [call.function.model_dump()]
    assert streamed[-1].done
    assert "31" in mine("answer").message.content


# --- Claude Code's request: the prompt it renders is chat completions' ---------------------

SCHEMA = "https://json-schema.org/draft/2020-12/schema"
CC_TOOLS: list[dict[str, Any]] = [
    {
        "name": name,
        "description": description,
        "input_schema": {
            "$schema": SCHEMA,
            "type": "object",
            "properties": {arg: {"description": f"The {arg}", "type": "string"}},
            "required": [arg],
            "additionalProperties": False,
        },
    }
    for name, description, arg in (
        ("Read", "Reads a file from the local filesystem.", "file_path"),
        ("Bash", "Executes a bash command and returns its output.", "command"),
        ("Glob", "Finds files by name with a glob pattern.", "pattern"),
    )
]
CC_AGENT = "You are a Claude agent, built on Anthropic's Claude Agent SDK."
CC_SYSTEM = "You are a concise assistant."
CC_ENV = "# Environment\nYou have been invoked in the following environment:\n - Platform: linux"
EPHEMERAL = {"type": "ephemeral"}


def claude_code_request(fingerprint: str) -> dict[str, Any]:
    """A request shaped as Claude Code sends it (`claude -p "Say hello." --system-prompt
    ... --tools ...`): its attribution block first in `system`, blocks with cache_control,
    JSON Schema 2020-12 tool schemas, no tool_choice, thinking off, and its environment as
    a system message after the question."""
    header = f"x-anthropic-billing-header: cc_version=2.1.332.{fingerprint}; cc_entrypoint=cli;"
    return {
        "model": "claude-local",
        "max_tokens": 24,
        "system": [
            {"type": "text", "text": header},
            {"type": "text", "text": CC_AGENT, "cache_control": EPHEMERAL},
            {"type": "text", "text": CC_SYSTEM, "cache_control": EPHEMERAL},
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Say hello.", "cache_control": EPHEMERAL}],
            },
            {"role": "system", "content": [{"type": "text", "text": CC_ENV}]},
        ],
        "tools": CC_TOOLS,
        "thinking": {"type": "disabled"},
    }


def _answer_of_chat(r: Any) -> tuple[str, list[tuple[str, Any]]]:
    m = r.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
    return m.content or "", calls


def _answer_of_message(r: Any) -> tuple[str, list[tuple[str, Any]]]:
    text = "".join(b.text for b in r.content if b.type == "text")
    return text, [(b.name, b.input) for b in r.content if b.type == "tool_use"]


@BATCH.first("test_claude_codes_request_renders_as_chat_completions")
def _(server: Server) -> Asks:
    client = server.client()
    return {
        "chat": lambda: client.chat.completions.create(
            model="default",
            messages=[
                {"role": "system", "content": f"{CC_AGENT}\n\n{CC_SYSTEM}"},
                {"role": "user", "content": f"Say hello.\n\n{CC_ENV}"},
            ],
            tools=[
                {
                    "type": "function",
                    "function": {
                        "name": t["name"],
                        "description": t["description"],
                        "parameters": t["input_schema"],
                    },
                }
                for t in CC_TOOLS
            ],
            temperature=0,
            max_tokens=24,
        )
    }


@BATCH.then("test_claude_codes_request_renders_as_chat_completions")
def _(server: Server, got: Got) -> Asks:
    # After the chat request has ended: its KV blocks are in the cache.
    body = claude_code_request("1c9")
    return {
        "message": lambda: _anthropic(server).messages.create(**body, extra_body={"temperature": 0})
    }


def test_claude_codes_request_renders_as_chat_completions(mine: Got) -> None:
    """The same conversation through /v1/chat/completions (system prompt, question and
    tools in OpenAI's shape) and through /v1/messages as Claude Code sends it: the same
    prompt tokens (as many, and every full KV block of the second found in the cache the
    first left) and so the same greedy answer. The hosted API drops the attribution
    block; system blocks are joined with a blank line; a system message right after the
    question joins it."""
    chat, message = mine("chat"), mine("message")
    usage, prompt = message.usage, chat.usage.prompt_tokens
    assert usage.input_tokens + usage.cache_read_input_tokens == prompt
    block = 16  # the KV block size: all but the last, partial block come from the cache
    assert usage.cache_read_input_tokens >= prompt - block
    assert _answer_of_message(message) == _answer_of_chat(chat)


@BATCH.first("test_claude_codes_next_turn_extends_its_prompt")
def _(server: Server) -> Asks:
    body = claude_code_request("462")
    return {
        "first": lambda: _anthropic(server).messages.create(**body, extra_body={"temperature": 0})
    }


@BATCH.then("test_claude_codes_next_turn_extends_its_prompt")
def _(server: Server, got: Got) -> Asks:
    first = got("first")
    reply: list[dict[str, Any]] = [
        {"type": "tool_result", "tool_use_id": b.id, "content": "Error: no such file"}
        for b in first.content
        if b.type == "tool_use"
    ] or [{"type": "text", "text": "Thanks."}]
    second_body = claude_code_request("462")
    second_body["messages"] += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {"role": "user", "content": reply},
    ]
    other_body = claude_code_request("34c")
    messages = _anthropic(server).messages
    return {
        "second": lambda: messages.create(**second_body, extra_body={"temperature": 0}),
        # Another conversation (another fingerprint), after the first has ended.
        "other": lambda: messages.create(**other_body, extra_body={"temperature": 0}),
    }


def test_claude_codes_next_turn_extends_its_prompt(mine: Got) -> None:
    """Claude Code's second request (the first answer and its result appended) renders
    the first one's prompt unchanged at its start, so its KV is all reused: the
    environment stays where the first prompt had it, and a conversation with another
    attribution fingerprint shares the system prompt and tools."""
    first = mine("first")
    first_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert mine("second").usage.cache_read_input_tokens >= first_prompt - 16
    # Another conversation (another fingerprint) reads the same prompt from the cache.
    assert mine("other").usage.cache_read_input_tokens >= first_prompt - 16
