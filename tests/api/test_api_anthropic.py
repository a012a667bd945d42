"""The Anthropic Messages API against a real server on a tiny random Qwen3 model.

The tiny model's template here has Qwen3's thinking switch, so `thinking` and the
thinking budget are exercised too: a random model never closes its reasoning by itself,
so a reasoning section that ends, followed by text, shows the budget was enforced.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from support.errors import assert_api_error
from support.server_utils import Server, run_server
from support.tiny_models import CHAT_TEMPLATE

KEY = "sk-ant-tiny"
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' -}}",
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\\n' -}}"
    "{%- else -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}",
)
HELLO = [{"role": "user", "content": "Hello, how are you today?"}]
CONTEXT = 1024  # --max-model-len
CAP = 2000  # --max-tokens: the most output a request may ask for, here past the context


@pytest.fixture(scope="module")
def model_dir(tiny_models: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tiny_models("qwen3")
    dest = tmp_path_factory.mktemp("tiny-thinking") / "model"
    shutil.copytree(src, dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    return dest


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Server]:
    with run_server(
        str(model_dir),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        str(CONTEXT),
        "--max-tokens",
        str(CAP),
        "--max-request-body-mb",
        "1",
        api_key=KEY,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def create(client: anthropic.Anthropic, **kw: Any) -> Any:
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", HELLO)
    kw.setdefault("max_tokens", 8)
    # The SDK no longer has sampling arguments; the API (and pippin) still takes them.
    extra = {k: kw.pop(k) for k in ("temperature", "top_k", "top_p") if k in kw}
    extra |= kw.pop("extra_body", None) or {}
    return client.messages.create(**kw, extra_body=extra or None)


def test_create_shape_and_usage(client: anthropic.Anthropic) -> None:
    m = create(client, temperature=0.0)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny"
    assert m.id.startswith("msg_")
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in m.content] in (["text"], [])
    assert 0 < m.usage.output_tokens <= 8
    count = client.messages.count_tokens(model="tiny", messages=HELLO)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count.input_tokens


def test_max_tokens_is_a_stop_reason(client: anthropic.Anthropic) -> None:
    m = create(client, max_tokens=3, temperature=0.0)
    if m.stop_reason != "end_turn":  # a random model may still end early
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_max_tokens_past_the_cap_or_a_full_prompt_is_refused_as_the_hosted_api_does(
    client: anthropic.Anthropic,
) -> None:
    """In the hosted API's words: a max_tokens above the most output the model may give
    (the operator's --max-tokens here), and a prompt that leaves no room for any."""
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, model="claude-sonnet-test", max_tokens=32000)
    assert_api_error(
        info,
        400,
        type="invalid_request_error",
        message=f"max_tokens: 32000 > {CAP}, which is the maximum allowed number of "
        "output tokens for claude-sonnet-test",
    )
    long = [{"role": "user", "content": " ".join(["word"] * (CONTEXT + 10))}]
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages=long, max_tokens=1)
    assert_api_error(
        info, 400, type="invalid_request_error", message=f"tokens > {CONTEXT - 1} maximum"
    )


def test_max_tokens_past_the_context_is_served_to_the_contexts_end(
    client: anthropic.Anthropic, server: Server
) -> None:
    """As the hosted API (Claude Sonnet 4.5 and later) serves it: a max_tokens larger than
    the rest of the context (Claude Code asks for 32,000 and more) is accepted, and the
    answer that fills the context stops with "model_context_window_exceeded"; one that
    reaches its max_tokens first stops with "max_tokens". The prompt leaves a little room,
    which the random model fills (it does not end its turn this soon)."""

    def said(words: int) -> list[dict[str, Any]]:
        return [{"role": "user", "content": " ".join(["word"] * words)}]

    def count(words: int) -> int:
        return client.messages.count_tokens(model="tiny", messages=said(words)).input_tokens

    per_word = (count(200) - count(100)) // 100
    messages = said(100 + (CONTEXT - 20 - count(100)) // per_word)
    prompt = client.messages.count_tokens(model="tiny", messages=messages).input_tokens
    room = CONTEXT - prompt
    assert 0 < room < 64, room
    for asked in (CAP, room + 1):
        m = create(client, messages=messages, max_tokens=asked, temperature=0.0)
        assert m.stop_reason == "model_context_window_exceeded", m
        assert m.usage.output_tokens == room
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == prompt
    with client.messages.stream(
        model="tiny", messages=messages, max_tokens=CAP, extra_body={"temperature": 0.0}
    ) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "model_context_window_exceeded"
    assert streamed.usage.output_tokens == room
    # The raw message_delta carries it too.
    body = {
        "model": "tiny",
        "max_tokens": CAP,
        "temperature": 0.0,
        "stream": True,
        "messages": messages,
    }
    delta = [d for name, d in _events(server, body) if name == "message_delta"]
    assert [d["delta"]["stop_reason"] for d in delta] == ["model_context_window_exceeded"]
    # A max_tokens the context holds, ending there or before, is the stop reason.
    for asked in (room, room - 5):
        m = create(client, messages=messages, max_tokens=asked, temperature=0.0)
        assert m.stop_reason == "max_tokens" and m.usage.output_tokens == asked, m


def test_claude_model_names_are_served(client: anthropic.Anthropic) -> None:
    m = create(client, model="claude-local-test")
    assert m.model == "claude-local-test"


def test_stop_sequences(client: anthropic.Anthropic) -> None:
    free = create(client, max_tokens=40, temperature=0.0)
    text = free.content[0].text
    assert len(text) > 12
    stop = text[6:10]  # somewhere in the middle of what greedy decoding writes
    m = create(client, max_tokens=40, temperature=0.0, stop_sequences=[stop, "never-there"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[: text.index(stop)]


def test_stream_accumulates_to_the_same_message(client: anthropic.Anthropic) -> None:
    full = create(client, max_tokens=20, temperature=0.0)
    with client.messages.stream(
        model="tiny", messages=HELLO, max_tokens=20, extra_body={"temperature": 0.0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text == final.content[0].text
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens


def _events(server: Server, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/messages",
        json=body,
        headers={"x-api-key": KEY, "anthropic-version": "2023-06-01"},
        timeout=120,
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name  # the event line names the data's type
                out.append((name, data))
    return out


def test_stream_grammar_event_by_event(server: Server) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 24,
        "temperature": 0.0,
        "stream": True,
        "thinking": {"type": "enabled", "budget_tokens": 6},
        "messages": HELLO,
    }
    events = _events(server, body)
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"] > 0
    # Blocks open, get deltas of their own kind, and close, in index order.
    open_block: dict[str, Any] | None = None
    next_index = 0
    kinds = []
    for name, data in events[1:-2]:
        if name == "ping":
            continue
        if name == "content_block_start":
            assert open_block is None and data["index"] == next_index
            open_block = data["content_block"]
            kinds.append(open_block["type"])
        elif name == "content_block_delta":
            assert open_block is not None and data["index"] == next_index
            want = {"thinking": ("thinking_delta", "signature_delta"), "text": ("text_delta",)}
            assert data["delta"]["type"] in want[open_block["type"]]
        elif name == "content_block_stop":
            assert open_block is not None and data["index"] == next_index
            open_block = None
            next_index += 1
        else:
            raise AssertionError(f"unexpected event {name}")
    assert open_block is None
    # The budget closed the reasoning after 6 tokens; the answer followed.
    assert kinds == ["thinking", "text"], events
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == 24


def test_thinking_budget_and_signature(client: anthropic.Anthropic) -> None:
    m = create(
        client, max_tokens=30, temperature=0.0, thinking={"type": "enabled", "budget_tokens": 5}
    )
    assert [b.type for b in m.content] == ["thinking", "text"], m
    assert m.content[0].thinking and m.content[0].signature
    # Thinking blocks come back in the history of the next turn.
    again = create(
        client,
        max_tokens=5,
        messages=[
            *HELLO,
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": "And then?"},
        ],
    )
    assert again.stop_reason in ("end_turn", "max_tokens")
    off = create(client, max_tokens=6, temperature=0.0, thinking={"type": "disabled"})
    assert all(b.type == "text" for b in off.content)


def test_second_turn_reuses_the_first_turns_kv(client: anthropic.Anthropic) -> None:
    system = "You are a careful assistant. " * 20  # a few blocks of shared prefix
    first = create(client, system=system, max_tokens=6, temperature=0.0)
    history = [
        *HELLO,
        {"role": "assistant", "content": first.content[0].text if first.content else "ok"},
        {"role": "user", "content": "Tell me more."},
    ]
    second = create(client, system=system, messages=history, max_tokens=6)
    assert second.usage.cache_read_input_tokens >= 64


def test_message_start_reports_the_cached_prompt_tokens(client: anthropic.Anthropic) -> None:
    """A streamed repeat of a prompt: message_start already has the cached tokens that
    message_delta reports (the engine tells them when it schedules the request, before
    the prefill), as the hosted API's message_start does."""
    system = "You read every word of the prompt before you answer. " * 24
    body = {"model": "tiny", "system": system, "messages": HELLO, "max_tokens": 4}
    client.messages.create(**body)
    stream = client.messages.create(**body, stream=True)
    events = list(stream)
    start = events[0]
    assert start.type == "message_start"
    delta = next(e for e in events if e.type == "message_delta")
    cached = delta.usage.cache_read_input_tokens
    assert cached and cached >= 128
    assert start.message.usage.cache_read_input_tokens == cached
    assert start.message.usage.input_tokens == delta.usage.input_tokens


def test_errors_in_anthropic_format(server: Server, client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as nf:
        create(client, model="gpt-4o")
    assert nf.value.body["type"] == "error"
    assert nf.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        create(client, top_k="x")
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "top_k" in bad.value.body["error"]["message"] or "top_k" in str(bad.value)
    with pytest.raises(anthropic.BadRequestError):
        create(client, tools=[{"type": "web_search_20250305", "name": "web_search"}])
    with pytest.raises(anthropic.BadRequestError):
        create(client, max_tokens=10, thinking={"type": "enabled", "budget_tokens": 10})
    bad_key = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as auth:
        bad_key.messages.create(model="tiny", messages=HELLO, max_tokens=4)
    assert auth.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(
        f"{server.url}/v1/messages",
        content=b"{" + b" " * (2 * 1024 * 1024) + b"}",
        headers={"x-api-key": KEY, "content-type": "application/json"},
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": "tiny", "max_tokens": 4, "messages": HELLO, "bogus": 1},
        headers={"authorization": f"Bearer {KEY}"},
    )
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "bogus" in r.json()["error"]["message"]


def test_images_are_refused_by_name(client: anthropic.Anthropic) -> None:
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, messages=[{"role": "user", "content": [image]}])
    assert "image" in str(e.value).lower()


def test_openai_chat_reasoning_and_budget(server: Server) -> None:
    # The same thinking model through chat completions: reasoning_content, then content.
    client = server.client(api_key=KEY)
    body = {"chat_template_kwargs": {"enable_thinking": True}, "thinking_token_budget": 5}
    r = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=20, temperature=0, extra_body=body
    )
    msg = r.choices[0].message.model_dump()
    assert msg["reasoning_content"] and msg["reasoning"] == msg["reasoning_content"]
    assert msg["content"] and r.choices[0].finish_reason == "length", (msg, r.choices[0])
    stream = client.chat.completions.create(
        model="tiny", messages=HELLO, max_tokens=20, temperature=0, extra_body=body, stream=True
    )
    reasoning = content = ""
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta.model_dump()
            if d.get("reasoning_content"):
                assert not content  # all reasoning comes before the answer
                reasoning += d["reasoning_content"]
            content += d.get("content") or ""
    assert (reasoning, content) == (msg["reasoning_content"], msg["content"])
    # Thinking switched off by the template: no reasoning at all.
    off = client.chat.completions.create(
        model="tiny",
        messages=HELLO,
        max_tokens=8,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.choices[0].message.model_dump()["reasoning_content"] is None


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}


def test_forced_tool_use_and_output_format(client: anthropic.Anthropic) -> None:
    import jsonschema

    tools = [{"name": "get_weather", "input_schema": CITY_SCHEMA}]
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        m = create(client, tools=tools, tool_choice=choice, max_tokens=200)
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and uses, m.content
        for u in uses:
            assert u.name == "get_weather"
            jsonschema.validate(u.input, CITY_SCHEMA)
    fmt = {"type": "json_schema", "schema": CITY_SCHEMA}
    m = create(client, max_tokens=200, output_config={"format": fmt})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), CITY_SCHEMA)
    # A key the format does not define is refused by name.
    with pytest.raises(anthropic.BadRequestError, match="output_config.format.strict"):
        create(client, max_tokens=20, output_config={"format": {**fmt, "strict": True}})


READ_TOOL = [{"name": "read", "input_schema": {"type": "object"}}]


def read_history(result: str) -> list[dict[str, Any]]:
    """A conversation in which the model read a file (`READ_TOOL`) and got `result`."""
    return [
        {"role": "user", "content": "Read the file."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "read", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": result},
                {"type": "text", "text": "Summarise it."},
            ],
        },
    ]


def test_context_management_clears_old_tool_results(client: anthropic.Anthropic) -> None:
    tools = READ_TOOL
    history = read_history("data " * 200)
    full = client.messages.count_tokens(model="tiny", messages=history, tools=tools)
    edit = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "input_tokens", "value": 10},
        "keep": {"type": "tool_uses", "value": 0},
    }
    cleared = client.messages.count_tokens(
        model="tiny",
        messages=history,
        tools=tools,
        extra_body={"context_management": {"edits": [edit]}},
    )
    assert cleared.input_tokens < full.input_tokens - 150
    extra = cleared.model_dump()
    assert extra["context_management"] == {"original_input_tokens": full.input_tokens}
    # The answer says what was cleared (a trigger on tool uses this time).
    by_uses = {**edit, "trigger": {"type": "tool_uses", "value": 0}}
    m = create(
        client,
        messages=history,
        tools=tools,
        max_tokens=4,
        extra_body={"context_management": {"edits": [by_uses]}},
    )
    (applied,) = m.model_dump()["context_management"]["applied_edits"]
    assert applied["type"] == "clear_tool_uses_20250919" and applied["cleared_tool_uses"] == 1
    assert applied["cleared_input_tokens"] > 150
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == cleared.input_tokens
    # Below the trigger nothing changes.
    edit["trigger"] = {"type": "input_tokens", "value": 100_000}
    same = client.messages.count_tokens(
        model="tiny",
        messages=history,
        tools=tools,
        extra_body={"context_management": {"edits": [edit]}},
    )
    assert same.input_tokens == full.input_tokens


def test_deferred_tools_are_hidden_until_a_tool_reference_loads_them(
    client: anthropic.Anthropic,
) -> None:
    """`defer_loading` tools stay out of the prompt (Claude Code sends a placeholder so
    that the model never calls it) until a tool result's `tool_reference` block, a
    client-side tool search's answer, loads them; then they are shown like the others."""
    search = {"name": "search_tools", "input_schema": {"type": "object"}}
    big = {
        "name": "deploy",
        "description": "Deploys the service to the named region. " * 8,
        "input_schema": CITY_SCHEMA,
    }
    deferred = {**big, "defer_loading": True}

    def count(messages: list[Any], tools: list[Any], **kw: Any) -> int:
        return client.messages.count_tokens(
            model="tiny", messages=messages, tools=tools, **kw
        ).input_tokens

    assert count(HELLO, [search, deferred]) == count(HELLO, [search])
    assert count(HELLO, [search, big]) > count(HELLO, [search]) + 50
    found = [
        {"role": "user", "content": "Deploy it."},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "search_tools", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "tool_reference", "tool_name": "deploy"}],
                }
            ],
        },
    ]
    assert count(found, [search, deferred]) == count(found, [search, big])
    m = create(client, messages=found, tools=[search, deferred], max_tokens=4)
    assert m.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # A reference to a tool the request does not have, and a forced call of a deferred
    # tool nothing has loaded, are refused.
    unknown = json.loads(json.dumps(found))
    unknown[2]["content"][0]["content"][0]["tool_name"] = "nope"
    with pytest.raises(anthropic.BadRequestError, match="nope") as err:
        count(unknown, [search, deferred])
    assert "messages[2].content[0].content[0].tool_name" in str(err.value)
    with pytest.raises(anthropic.BadRequestError, match="deploy"):
        create(client, tools=[search, deferred], tool_choice={"type": "tool", "name": "deploy"})


def test_assistant_prefill_is_continued(client: anthropic.Anthropic, model_dir: Path) -> None:
    """A conversation ending in an assistant turn of text is continued from it: the prompt
    ends inside that turn (no end of turn, no new assistant header), as the template renders
    it with `continue_final_message`."""
    from transformers import AutoTokenizer

    prefill = [*HELLO, {"role": "assistant", "content": "The answer is"}]
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    want = tok.apply_chat_template(prefill, continue_final_message=True, tokenize=True)
    ids = want["input_ids"] if hasattr(want, "keys") else want
    count = client.messages.count_tokens(model="tiny", messages=prefill)
    assert count.input_tokens == len(ids)
    m = create(client, messages=prefill, temperature=0.0)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    # Anthropic refuses a prefill that ends in whitespace.
    with pytest.raises(anthropic.BadRequestError, match="trailing whitespace"):
        create(client, messages=[*HELLO, {"role": "assistant", "content": "The answer is "}])


def test_thinking_display_omitted(client: anthropic.Anthropic, server: Server) -> None:
    """`thinking.display: "omitted"`: the thinking block comes, signed, with its text empty
    (no thinking deltas when streamed); the answer is the same."""
    thinking = {"type": "enabled", "budget_tokens": 5}
    shown = create(client, max_tokens=30, temperature=0.0, thinking=thinking)
    omitted = create(
        client, max_tokens=30, temperature=0.0, thinking={**thinking, "display": "omitted"}
    )
    assert [b.type for b in omitted.content] == [b.type for b in shown.content]
    assert omitted.content[0].thinking == "" and shown.content[0].thinking
    assert omitted.content[0].signature == shown.content[0].signature
    assert omitted.content[1:] == shown.content[1:]
    body = {
        "model": "tiny",
        "max_tokens": 30,
        "temperature": 0.0,
        "stream": True,
        "thinking": {**thinking, "display": "omitted"},
        "messages": HELLO,
    }
    events = _events(server, body)
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert "thinking_delta" not in deltas and "signature_delta" in deltas


def test_strict_tools_reach_the_forced_call_grammar() -> None:
    """A tool's `strict: true` goes to the forced-call grammar as chat's does (closed
    objects); tools without it stay open."""
    from pippin.api.anthropic.messages_input import template_tools
    from pippin.api.anthropic.protocol import MessagesRequest
    from pippin.structured.tool_calls import params_schema

    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    req = MessagesRequest.model_validate(
        {
            "model": "tiny",
            "max_tokens": 5,
            "messages": HELLO,
            "tools": [
                {"name": "a", "input_schema": schema, "strict": True},
                {"name": "b", "input_schema": schema},
            ],
        }
    )
    tools = template_tools(req)
    assert tools is not None
    closed, open_ = (params_schema(t["function"]) for t in tools)
    assert closed.get("additionalProperties") is False
    assert "additionalProperties" not in open_


def test_stop_sequence_wins_over_a_started_tool_call() -> None:
    """A stop sequence that ends the turn, even inside a tool call, is the stop reason."""
    from pippin.api.anthropic.messages_output import stop_fields
    from pippin.chat.tool_parsers.base import ParsedDelta
    from pippin.engine.types import CompletionOutput
    from pippin.serving.pipeline import ParsedStep

    def step(finish: str, stop: str | int | None) -> ParsedStep:
        out = CompletionOutput(0, [], "", None, finish)
        return ParsedStep(ParsedDelta(), out, 5, 0, 3, finish, stop)

    assert stop_fields(step("tool_calls", "END"), True) == ("stop_sequence", "END")
    assert stop_fields(step("tool_calls", None), True) == ("tool_use", None)
    assert stop_fields(step("stop", 2), False) == ("end_turn", None)  # an end-of-turn token
    assert stop_fields(step("length", None), True) == ("max_tokens", None)


def test_tool_fields_honoured_or_refused(client: anthropic.Anthropic) -> None:
    """`input_examples` are shown with the tool; a tool only code execution may call, a
    document asking for citations and a per-message output format are refused by name."""
    plain: dict[str, Any] = {"name": "read", "input_schema": {"type": "object"}}
    base = client.messages.count_tokens(model="tiny", messages=HELLO, tools=[plain])
    shown = client.messages.count_tokens(
        model="tiny",
        messages=HELLO,
        tools=[{**plain, "input_examples": [{"path": "/etc/hosts"}]}],  # type: ignore[list-item]
    )
    assert shown.input_tokens > base.input_tokens
    create(client, tools=[{**plain, "allowed_callers": ["direct"]}])
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    cited = [{**doc, "citations": {"enabled": True}}, {"type": "text", "text": "Summarise it."}]
    formatted = {"format": {"type": "json_schema", "schema": {}}}
    refused: list[tuple[dict[str, Any], str]] = [
        ({"tools": [{**plain, "allowed_callers": ["code_execution_20250825"]}]}, "tools[0]"),
        (
            {"messages": [{"role": "user", "content": cited}]},
            "messages[0].content[0].citations.enabled",
        ),
        (
            {"messages": [{"role": "user", "content": "Hi", "output_config": formatted}]},
            "messages[0].output_config.format",
        ),
    ]
    for kw, param in refused:
        with pytest.raises(anthropic.BadRequestError) as exc:
            create(client, **kw)
        assert_api_error(exc, 400, type="invalid_request_error", message=param)


def test_a_messages_effort_holds_for_the_turns_after_it(client: anthropic.Anthropic) -> None:
    """A message's `output_config.effort` acts as the top-level one: here it turns the
    template's thinking switch on."""
    top = client.messages.count_tokens(
        model="tiny", messages=HELLO, extra_body={"output_config": {"effort": "high"}}
    )
    plain = client.messages.count_tokens(model="tiny", messages=HELLO)
    per_message = client.messages.count_tokens(
        model="tiny",
        messages=[{**HELLO[0], "output_config": {"effort": "high"}}],  # type: ignore[list-item]
    )
    assert top.input_tokens != plain.input_tokens
    assert per_message.input_tokens == top.input_tokens


def test_clear_at_least(client: anthropic.Anthropic) -> None:
    """An edit that would clear fewer input tokens than `clear_at_least` is not made."""
    tools = READ_TOOL
    history = read_history("data " * 50)
    edit: dict[str, Any] = {
        "type": "clear_tool_uses_20250919",
        "trigger": {"type": "input_tokens", "value": 10},
        "keep": {"type": "tool_uses", "value": 0},
    }

    def count(e: dict[str, Any]) -> int:
        return client.messages.count_tokens(
            model="tiny",
            messages=history,  # type: ignore[arg-type]
            tools=tools,  # type: ignore[arg-type]
            extra_body={"context_management": {"edits": [e]}},
        ).input_tokens

    full = client.messages.count_tokens(model="tiny", messages=history, tools=tools).input_tokens  # type: ignore[arg-type]
    cleared = count(edit)
    assert cleared < full - 30
    at_least = {"type": "input_tokens", "value": full - cleared}
    assert count({**edit, "clear_at_least": at_least}) == cleared
    too_much = {"type": "input_tokens", "value": full - cleared + 1}
    assert count({**edit, "clear_at_least": too_much}) == full


def test_disabled_thinking_shows_no_thinking_blocks() -> None:
    """A model that reasons with thinking disabled (no switch in its template): its
    reasoning is dropped from the answer, as the hosted API shows none."""
    from pippin.api.anthropic.messages_output import BlockBuilder
    from pippin.chat.tool_parsers.base import ParsedDelta

    shown, dropped = BlockBuilder(), BlockBuilder(drop_thinking=True)
    for b in (shown, dropped):
        b.feed(ParsedDelta(reasoning="Let me see."))
        b.feed(ParsedDelta(content="Hello."))
        b.close()
    assert [x["type"] for x in shown.blocks] == ["thinking", "text"]
    assert [x["type"] for x in dropped.blocks] == ["text"]
    assert dropped.blocks[0]["text"] == "Hello."
