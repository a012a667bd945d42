"""The OpenAI Responses API (/v1/responses) against real `pippin serve` processes.

Tiny random-weight qwen3 models check the protocol (items in and out, stored
conversations, streaming events, refusals, reasoning). The real Qwen2.5-Coder-0.5B's
function-call loop and a stream adding up to the non-streamed response are in
test_api_tools_qwen.py, on that file's server (one server of the real model, not two).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from support.errors import assert_api_error
from support.server_utils import Server, run_server
from support.tiny_models import CHAT_TEMPLATE

CONTEXT = 2048
# Long enough that the first turn fills whole KV blocks (16 tokens) for the prefix cache.
INSTRUCTIONS = "You are a helpful assistant. Answer briefly and politely. " * 4
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- message['content'] -}}",
    "{%- if message.get('reasoning_content') -%}"
    "{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' -}}"
    "{%- endif -%}{{- message['content'] -}}",
).replace(
    "{{- '<|im_start|>assistant\\n' -}}{%- endif -%}",
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- else -%}{{- '<think>\\n' -}}{%- endif -%}"
    "{%- endif -%}",
)
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "The city name"}},
        "required": ["city"],
    },
}
QUESTION = "What is the weather like in Paris right now?"


@pytest.fixture(scope="module")
def tiny(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    args = ("--served-model-name", "tiny", "--max-model-len", str(CONTEXT))
    with run_server(str(tiny_models("qwen3")), *args) as s:
        yield s


@pytest.fixture(scope="module")
def client(tiny: Server) -> openai.OpenAI:
    return tiny.client()


def create(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("model", "tiny")
    kw.setdefault("max_output_tokens", 8)
    # Greedy unless a test says otherwise: sampled, the random model can pick its end token
    # (about 1 in 768 a token), and the tests count output tokens.
    kw.setdefault("temperature", 0)
    return client.responses.create(**kw)


def text_of(response: Any) -> str:
    return "".join(
        part.text for item in response.output if item.type == "message" for part in item.content
    )


# --- requests and response objects ---------------------------------------------------


def test_string_input(client: openai.OpenAI) -> None:
    r = create(client, input="Hello, how are you today?", metadata={"k": "v"}, user="u1")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "tiny"
    # Greedy, these random weights do not stop on their own: the answer is cut at
    # max_output_tokens.
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    (msg,) = r.output
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert msg.status == "incomplete"
    (part,) = msg.content
    assert part.type == "output_text" and part.text and part.annotations == []
    u = r.usage
    assert u.output_tokens == 8 and u.total_tokens == u.input_tokens + 8
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens >= 0
    assert (r.max_output_tokens, r.store, r.tool_choice, r.tools) == (8, True, "auto", [])
    assert (r.truncation, r.metadata, r.user, r.parallel_tool_calls) == (
        "disabled",
        {"k": "v"},
        "u1",
        True,
    )
    assert r.previous_response_id is None and r.instructions is None
    assert r.text.format.type == "text"


def test_items_input_and_instructions(client: openai.OpenAI) -> None:
    plain = create(client, input="Hi there")
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "Hi there"}]}]
    as_items = create(client, input=parts)
    assert as_items.usage.input_tokens == plain.usage.input_tokens
    with_instructions = create(client, input="Hi there", instructions=INSTRUCTIONS)
    assert with_instructions.instructions == INSTRUCTIONS
    assert with_instructions.usage.input_tokens > plain.usage.input_tokens + 20
    # developer is system for the template; assistant turns may be text or output_text parts.
    convo = [
        {"role": "developer", "content": "Be short."},
        {"type": "message", "role": "user", "content": "Hi there"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "How are you?"},
    ]
    r = create(client, input=convo)
    assert r.status == "incomplete" and r.usage.input_tokens > plain.usage.input_tokens + 10


def test_previous_response_chain_uses_the_prefix_cache(client: openai.OpenAI) -> None:
    first = create(client, input="Tell me about the sea.", instructions=INSTRUCTIONS)
    second = create(
        client,
        input="And about the sky?",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
    )
    assert second.previous_response_id == first.id
    # The second turn's prompt holds the first turn: the same as sending it back by hand.
    by_hand = create(
        client,
        input=[
            {"role": "user", "content": "Tell me about the sea."},
            first.output[0].model_dump(),
            {"role": "user", "content": "And about the sky?"},
        ],
        instructions=INSTRUCTIONS,
        store=False,
    )
    assert second.usage.input_tokens == by_hand.usage.input_tokens
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    # The first turn's prompt blocks were reused.
    assert second.usage.input_tokens_details.cached_tokens >= 16
    # A third turn chains through both (instructions are not carried over, as OpenAI).
    third = create(client, input="Thanks.", previous_response_id=second.id)
    third_by_hand = create(
        client,
        input=[
            {"role": "user", "content": "Tell me about the sea."},
            first.output[0].model_dump(),
            {"role": "user", "content": "And about the sky?"},
            second.output[0].model_dump(),
            {"role": "user", "content": "Thanks."},
        ],
        store=False,
    )
    assert third.usage.input_tokens == third_by_hand.usage.input_tokens


def test_get_and_delete(client: openai.OpenAI) -> None:
    r = create(client, input="Hello")
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.retrieve(r.id)
    assert info.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    with pytest.raises(openai.BadRequestError) as bad:
        create(client, input="Hi", previous_response_id=r.id)
    assert bad.value.body["param"] == "previous_response_id"


def test_get_checks_include(client: openai.OpenAI, tiny: Server) -> None:
    """GET's `include` query takes what POST's takes; anything else is refused by name."""
    r = create(client, input="Hi")
    got = client.responses.retrieve(r.id, include=["reasoning.encrypted_content"])
    assert got.id == r.id
    with tiny.http() as h:
        bad = h.get(f"/v1/responses/{r.id}", params={"include": "message.output_text.logprobs"})
    assert_api_error(bad, 400, param="include[0]", code="unsupported_value")


def test_store_false(client: openai.OpenAI) -> None:
    r = create(client, input="Hello", store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input="Hi", previous_response_id=r.id)
    assert info.value.body["code"] == "previous_response_not_found"


def test_item_reference(client: openai.OpenAI) -> None:
    first = create(client, input="Tell me about the sea.")
    msg_id = first.output[0].id
    by_ref = create(
        client,
        input=[
            {"role": "user", "content": "Tell me about the sea."},
            {"type": "item_reference", "id": msg_id},
            {"role": "user", "content": "More."},
        ],
    )
    chained = create(client, input="More.", previous_response_id=first.id)
    assert by_ref.usage.input_tokens == chained.usage.input_tokens


# --- streaming -----------------------------------------------------------------------


def test_stream_events_in_order(client: openai.OpenAI) -> None:
    kw = {"model": "tiny", "input": "Hello there", "max_output_tokens": 6, "temperature": 0}
    with client.responses.stream(**kw) as stream:
        events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = types[4:-4]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert deltas and set(deltas) == {"response.output_text.delta"}
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    created, added, final = events[0].response, events[2], events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    item_id = added.item.id
    for e in events[3:-3]:
        assert (e.output_index, e.item_id, e.content_index) == (0, item_id, 0)
    text = "".join(e.delta for e in events[4:-4])
    assert events[-4].text == text and events[-2].item.content[0].text == text
    assert text_of(final) == text and final.usage.output_tokens == 6
    # The stored response is the streamed one; greedy, the non-streamed text is the same.
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    whole = client.responses.create(**kw)
    assert text_of(whole) == text and whole.status == final.status == "incomplete"


def test_stream_wire_format(tiny: Server) -> None:
    body = {"model": "tiny", "input": "Hi", "max_output_tokens": 3, "stream": True}
    with tiny.http() as h, h.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f.strip()]
    for frame in frames:
        event, data = frame.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == event[7:]
    assert "[DONE]" not in raw


# --- reasoning -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking(tiny_models: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny qwen3 whose template reads `enable_thinking` and opens a <think> section."""
    folder = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_models("qwen3"), folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = THINKING_TEMPLATE
    config_path.write_text(json.dumps(config))
    args = ("--served-model-name", "tiny", "--max-model-len", str(CONTEXT))
    with run_server(str(folder), *args) as s:
        yield s.client()


def test_reasoning_effort_maps_to_enable_thinking(thinking: openai.OpenAI) -> None:
    on = create(thinking, input="Hello", reasoning={"effort": "high", "summary": "auto"})
    off = create(thinking, input="Hello", reasoning={"effort": "none"})
    # Off, the template writes an empty, closed section into the prompt.
    assert off.usage.input_tokens > on.usage.input_tokens
    assert on.reasoning.effort == "high" and on.reasoning.summary == "auto"
    # On, the prompt ends inside <think>: all the (random) output is reasoning.
    (item,) = on.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
    assert item.content[0].type == "reasoning_text" and item.content[0].text
    assert on.usage.output_tokens_details.reasoning_tokens == on.usage.output_tokens == 8
    assert [i.type for i in off.output] == ["message"]
    assert off.usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_streamed_and_sent_back(thinking: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": "tiny",
        "input": "Hello",
        "max_output_tokens": 5,
        "reasoning": {"effort": "low"},
        "temperature": 0,  # sampled, an end-of-thinking token could end the section
    }
    with thinking.responses.stream(**kw) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert "response.reasoning_text.delta" in types and "response.output_text.delta" not in types
    assert events[3].part.type == "reasoning_text"
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert final.output[0].content[0].text == deltas
    # A reasoning item reaches the template as the next assistant turn's reasoning_content.
    turn = [
        {"role": "user", "content": "Hello"},
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Hm."}],
        },
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "Bye"},
    ]
    with_reasoning = create(thinking, input=turn)
    without = create(thinking, input=[turn[0], *turn[2:]])
    assert with_reasoning.usage.input_tokens > without.usage.input_tokens
    # `reasoning.context`: every turn's reasoning (as by default), or only the current
    # turn's, since the last user message: the earlier turn's is left out.
    all_turns = create(thinking, input=turn, reasoning={"context": "all_turns"})
    current = create(thinking, input=turn, reasoning={"context": "current_turn"})
    assert all_turns.usage.input_tokens == with_reasoning.usage.input_tokens
    assert current.usage.input_tokens == without.usage.input_tokens


# --- refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"tools": [WEATHER_TOOL, {"type": "code_interpreter", "container": "x"}]},
            "tools[1].type",
        ),
        ({"tools": [{"type": "custom", "name": "x"}]}, "tools[0].type"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools[0].type"),
        ({"tools": [{"type": "local_shell"}]}, "tools[0].type"),
        ({"tools": [{"type": "frobnicator"}]}, "tools[0].type"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        (
            {"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "x": 1}}},
            "text.format.x",
        ),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "custom", "name": "x"}}, "tool_choice"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
        ({"include": ["message.output_text.logprobs"]}, "include[0]"),
        ({"include": ["bogus"]}, "include[0]"),
        (
            {"extra_body": {"prompt_cache_options": {"prewarm": True}}},
            "prompt_cache_options.prewarm",
        ),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"background": True, "store": False}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"max_output_tokens": "5"}, "max_output_tokens"),
        ({"input": [{"role": "user", "content": "x", "bogus": 1}]}, "input[0].bogus"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        (
            {"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]},
            "input[0].type",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_nope"}]}, "input[0].id"),
        ({"input": [{"type": "wat"}]}, "input[0].type"),
    ],
)
def test_refusals_name_the_field(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    kw.setdefault("input", "Hi")
    with pytest.raises(openai.BadRequestError) as info:
        create(client, **kw)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    assert info.value.body["type"] == "invalid_request_error"


def test_accepted_no_op_fields(client: openai.OpenAI) -> None:
    r = create(
        client,
        input="Hi",
        include=["reasoning.encrypted_content", "file_search_call.results"],
        truncation="auto",
        parallel_tool_calls=False,
        prompt_cache_key="k",
        safety_identifier="s",
        service_tier="auto",
        max_tool_calls=3,
        text={"format": {"type": "text"}, "verbosity": "medium"},
        tool_choice="none",
        tools=[WEATHER_TOOL],
    )
    assert r.status == "incomplete" and r.truncation == "auto" and r.parallel_tool_calls is False
    assert r.tools[0].name == "get_weather" and r.tool_choice == "none"


def test_context_overflow(client: openai.OpenAI) -> None:
    long = " ".join(["word"] * (CONTEXT + 100))
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input=long)
    assert info.value.body["code"] == "context_length_exceeded"
    assert info.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input=long, truncation="auto")
    assert info.value.body["param"] == "truncation"


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_forced_function_call_and_json_schema(client: openai.OpenAI) -> None:
    import jsonschema

    tool = {"type": "function", "name": "get_weather", "parameters": CITY_SCHEMA}
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = create(
            client, input="Weather?", tools=[tool], tool_choice=choice, max_output_tokens=200
        )
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and all(c.name == "get_weather" for c in calls), r.output
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), CITY_SCHEMA)
    fmt = {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}
    r = create(client, input="A city?", text={"format": fmt}, max_output_tokens=200)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), CITY_SCHEMA)
