"""The OpenAI front against a real `pippin serve` process on a tiny random model.

Talks to it with the official `openai` SDK (and raw httpx where the SDK would not send
the malformed thing) over real HTTP. Random weights make the text gibberish, so tests
check structure, counts and determinism rather than content; ``ignore_eos`` makes
lengths predictable.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from support.errors import assert_api_error
from support.server_utils import Server, run_server

KEY = "sk-tiny-test"
CONTEXT = 2048
CAP = 2000
MSG = [{"role": "user", "content": "Hello, how are you today?"}]


@pytest.fixture(scope="module")
def server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    model = tiny_models("llama")
    with run_server(
        str(model),
        "--served-model-name",
        "tiny",
        "tiny-alias",
        "--max-model-len",
        str(CONTEXT),
        "--max-tokens",
        str(CAP),
        "--max-request-body-mb",
        "4",
        api_key=KEY,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("model", "tiny")
    kw.setdefault("messages", MSG)
    return client.chat.completions.create(**kw)


def completion(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("model", "tiny")
    kw.setdefault("prompt", "The quick brown fox")
    return client.completions.create(**kw)


def fixed(n: int) -> dict[str, Any]:
    """Exactly n tokens per choice: EOS is ignored, so only max_tokens ends them."""
    return {"max_tokens": n, "extra_body": {"ignore_eos": True}}


# --- basics --------------------------------------------------------------------


def test_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny", "tiny-alias"]
    assert client.models.retrieve("tiny-alias").id == "tiny-alias"


def test_chat(client: openai.OpenAI) -> None:
    r = chat(client, **fixed(8))
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == "tiny" and r.system_fingerprint and r.system_fingerprint.startswith("fp_")
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length"
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.logprobs is None
    u = r.usage
    assert u.completion_tokens == 8 and u.prompt_tokens > 5
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens is not None


def test_alias_name(client: openai.OpenAI) -> None:
    assert chat(client, model="tiny-alias", **fixed(2)).model == "tiny-alias"


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = chat(client, stream=True, stream_options={"include_usage": True}, **fixed(10))
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert len({ch.id for ch in chunks}) == 1
    finals = [ch for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    # As OpenAI: the finish reason rides alone, with an empty delta, after the text.
    assert finals[0].choices[0].delta.content is None and finals[0] is chunks[-2]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 10
    assert all(ch.usage is None for ch in chunks[:-1])
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    again = chat(client, temperature=0, **fixed(10))
    greedy = chat(client, temperature=0, stream=True, **fixed(10))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in greedy if ch.choices)
    assert streamed == again.choices[0].message.content
    assert isinstance(text, str)


def test_stream_without_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(chat(client, stream=True, **fixed(4)))
    assert all(ch.choices for ch in chunks) and all(ch.usage is None for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_stream_ends_with_done(server: Server) -> None:
    body = {"model": "tiny", "messages": MSG, "stream": True, "max_tokens": 3}
    with server.http() as h, h.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"


def test_n2(client: openai.OpenAI) -> None:
    r = chat(client, n=2, temperature=1.0, **fixed(6))
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12
    chunks = list(
        chat(client, n=2, stream=True, stream_options={"include_usage": True}, **fixed(6))
    )
    finish = {c.index: c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason}
    assert finish == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 12


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    r = chat(client, logprobs=True, top_logprobs=3, **fixed(7))
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 7
    for t in content:
        assert t.logprob <= 0 and isinstance(t.token, str)
        assert t.bytes is not None and all(0 <= b < 256 for b in t.bytes)
        assert t.token == bytes(t.bytes).decode("utf-8", errors="replace")
        assert len(t.top_logprobs) == 3
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        # Greedy or not, the chosen token is at most as likely as the best one.
        assert t.logprob <= lps[0] + 1e-5
    # logprobs without top_logprobs: the chosen token only.
    r = chat(client, logprobs=True, **fixed(3))
    assert all(t.top_logprobs == [] for t in r.choices[0].logprobs.content)


def test_chat_logprobs_stream(client: openai.OpenAI) -> None:
    chunks = list(chat(client, logprobs=True, top_logprobs=2, stream=True, **fixed(5)))
    entries = [t for ch in chunks for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert len(entries) == 5 and all(len(t.top_logprobs) == 2 for t in entries)


def test_completion(client: openai.OpenAI) -> None:
    r = completion(client, **fixed(5))
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    (c,) = r.choices
    assert c.finish_reason == "length" and isinstance(c.text, str)
    assert r.usage.completion_tokens == 5


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    r = completion(client, logprobs=2, **fixed(6))
    lp = r.choices[0].logprobs
    assert (
        len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    )
    assert lp.text_offset == sorted(lp.text_offset)
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # Up to logprobs + 1 entries; fewer when alternatives render to the same text.
        assert val <= 0 and 1 <= len(top) <= 3 and top[tok] == pytest.approx(val)


def test_completion_batch_and_n(client: openai.OpenAI) -> None:
    r = completion(client, prompt=["Hello", "World", "Again"], n=2, **fixed(4))
    assert [c.index for c in r.choices] == list(range(6))
    assert r.usage.completion_tokens == 24
    r = completion(client, prompt=[[5, 6, 7], [8, 9]], **fixed(3))
    assert [c.index for c in r.choices] == [0, 1] and r.usage.prompt_tokens == 5
    chunks = list(completion(client, prompt=["Hello", "World"], n=2, stream=True, **fixed(3)))
    finish = {c.index: c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason}
    assert finish == {0: "length", 1: "length", 2: "length", 3: "length"}


def test_completion_echo(client: openai.OpenAI) -> None:
    r = completion(client, prompt="Once upon a time", echo=True, **fixed(4))
    assert r.choices[0].text.startswith("Once upon a time")
    chunks = list(completion(client, prompt="Once upon a time", echo=True, stream=True, **fixed(4)))
    assert chunks[0].choices[0].text == "Once upon a time"
    r = completion(client, prompt="Only the prompt", echo=True, max_tokens=0)
    assert r.choices[0].text == "Only the prompt" and r.usage.completion_tokens == 0


def test_completion_stream_usage(client: openai.OpenAI) -> None:
    chunks = list(
        completion(client, stream=True, stream_options={"include_usage": True}, **fixed(5))
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def _cut_point(text: str) -> str:
    # A stop string from the middle of the answer whose first match is there.
    for start in range(len(text) // 3, len(text) - 2):
        cand = text[start : start + 2]
        if cand.strip() and "\ufffd" not in cand and text.find(cand) == start:
            return cand
    pytest.skip("no usable stop string in this output")


def test_stop_strings(client: openai.OpenAI) -> None:
    full = chat(client, temperature=0, **fixed(40)).choices[0].message.content
    stop = _cut_point(full)
    expected = full[: full.find(stop)]
    r = chat(client, temperature=0, stop=[stop, "never-appears"], **fixed(40))
    assert r.choices[0].message.content == expected
    assert r.choices[0].finish_reason == "stop"
    chunks = list(chat(client, temperature=0, stop=stop, stream=True, **fixed(40)))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    full = completion(client, temperature=0, **fixed(40)).choices[0].text
    stop = _cut_point(full)
    r = completion(client, temperature=0, stop=stop, **fixed(40))
    assert r.choices[0].text == full[: full.find(stop)] and r.choices[0].finish_reason == "stop"


def test_seed_reproducible(client: openai.OpenAI) -> None:
    a = chat(client, temperature=1.0, seed=1234, **fixed(16)).choices[0].message.content
    b = chat(client, temperature=1.0, seed=1234, **fixed(16)).choices[0].message.content
    assert a == b
    a = completion(client, temperature=1.0, seed=99, **fixed(16)).choices[0].text
    b = completion(client, temperature=1.0, seed=99, stream=False, **fixed(16)).choices[0].text
    assert a == b


def test_logit_bias_is_honoured(client: openai.OpenAI) -> None:
    tok = 300
    r = chat(client, temperature=0, logit_bias={str(tok): 100}, logprobs=True, **fixed(5))
    content = r.choices[0].logprobs.content
    assert len({tuple(t.bytes) for t in content}) == 1  # one token, over and over


def test_developer_system_tools_messages(client: openai.OpenAI) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Call f"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = chat(client, messages=messages, tools=tools, tool_choice="auto", **fixed(3))
    assert r.choices[0].finish_reason == "length"


# --- errors ----------------------------------------------------------------------


def test_api_key(server: Server) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.status_code == 401
    assert info.value.body["code"] == "invalid_api_key"
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{server.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        assert "wrong" not in r.text
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{server.url}/version").status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200
    head = httpx.head(f"{server.url}/health")
    assert head.status_code == 200 and head.content == b""


def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        chat(client, model="gpt-4o", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_malformed_json(server: Server) -> None:
    with server.http() as h:
        r = h.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [}')
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"temperature": "warm"}, "temperature"),
        ({"n": 1.5}, "n"),
        ({"messages": [{"role": "user", "content": 42}]}, "messages[0].content"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
        ({"extra_body": {"top_k": "many"}}, "top_k"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"verbosity": "low"}, "verbosity"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"max_tokens": CAP + 1}, "max_tokens"),
    ],
)
def test_bad_requests_name_the_field(client: openai.OpenAI, kw: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kw)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body
    assert info.value.body["type"] == "invalid_request_error"


def test_a_length_past_the_context_names_the_field_sent(server: Server) -> None:
    """Each API's own length field, as the request spelled it; the prompt fits."""
    words = " ".join(["word"] * 200)
    long = [{"role": "user", "content": words}]
    client = server.client()
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as info:
            chat(client, messages=long, **{field: CAP})
        assert_api_error(info, 400, param=field, code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="tiny", input=words, max_output_tokens=CAP)
    assert_api_error(info, 400, param="max_output_tokens", code="context_length_exceeded")
    body = {"model": "tiny", "messages": long, "stream": False, "options": {"num_predict": CAP}}
    r = httpx.post(f"{server.url}/api/chat", json=body, headers=server.headers())
    assert_api_error(r, 400, message="'options.num_predict'")


def test_prompt_past_the_context(client: openai.OpenAI) -> None:
    long = " ".join(["word"] * (CONTEXT + 100))
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, messages=[{"role": "user", "content": long}], max_tokens=5)
    body = info.value.body
    assert body["code"] == "context_length_exceeded" and str(CONTEXT) in body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        completion(client, prompt=[1] * CONTEXT)
    assert info.value.body["code"] == "context_length_exceeded"
    assert f"{CONTEXT} tokens" in info.value.body["message"]


def test_prompt_plus_max_tokens_past_the_context(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        completion(client, prompt=[1] * 100, max_tokens=CAP)
    msg = info.value.body["message"]
    assert info.value.body["code"] == "context_length_exceeded"
    # The prompt fits: the field that asked for too much is named, not the prompt.
    assert info.value.body["param"] == "max_tokens"
    assert str(CONTEXT) in msg and "100" in msg and str(100 + CAP) in msg
    # Without max_tokens the rest of the context is the default: no error.
    r = completion(
        client, prompt=[1] * 100, **{"extra_body": {"ignore_eos": True}}, max_tokens=None
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16  # the legacy endpoint's documented default


def test_huge_body_is_refused_without_buffering(server: Server) -> None:
    before = server.peak_rss_kib()
    big = b'{"model": "tiny", "prompt": "' + b"x" * (50 * 1024 * 1024) + b'"}'
    with server.http() as h:
        r = h.post("/v1/completions", content=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks() -> Iterator[bytes]:
            for _ in range(50):
                yield b"x" * (1024 * 1024)

        r = h.post("/v1/completions", content=chunks())
        assert r.status_code == 413
    grown_mib = (server.peak_rss_kib() - before) / 1024
    assert grown_mib < 25, f"server peak memory grew by {grown_mib:.0f} MiB"


# --- load -------------------------------------------------------------------------


async def _one(client: openai.AsyncOpenAI, i: int) -> str:
    """A streaming request with parameters varied by i; some are abandoned midway."""
    cancel = i % 5 == 0
    n = 2 if i % 6 == 1 else 1
    max_tokens = 6 + (i % 7) * 5
    stop = ["e"] if i % 8 == 3 and not cancel else None  # a stop could end it before the cancel
    common: dict[str, Any] = {
        "model": "tiny",
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "n": n,
        "temperature": [0.0, 0.7, 1.0][i % 3],
        "seed": i if i % 4 == 0 else None,
        "stop": stop,
        "extra_body": {"ignore_eos": True, "top_k": 20 if i % 2 else 0},
    }
    if i % 2 == 0:
        stream = await client.chat.completions.create(
            messages=[{"role": "user", "content": f"Request number {i}: " + "tell me " * (i % 9)}],
            logprobs=i % 3 == 0,
            top_logprobs=2 if i % 3 == 0 else None,
            **common,
        )
    else:
        stream = await client.completions.create(
            prompt=f"Prompt {i} " + "lorem ipsum " * (i % 11),
            logprobs=1 if i % 3 == 0 else None,
            **common,
        )
    finish: dict[int, str] = {}
    usage = None
    seen = 0
    async for chunk in stream:
        seen += 1
        if cancel and seen == 3:
            await stream.close()
            return "cancelled"
        for c in chunk.choices:
            if c.finish_reason:
                assert c.index not in finish
                finish[c.index] = c.finish_reason
        if chunk.usage is not None:
            usage = chunk.usage
    assert set(finish) == set(range(n)), (i, finish)
    assert usage is not None, i
    if stop is None:
        assert set(finish.values()) == {"length"}, (i, finish)
        assert usage.completion_tokens == n * max_tokens, (i, usage)
    else:
        assert set(finish.values()) <= {"stop", "length"}
        assert usage.completion_tokens <= n * max_tokens
    return "done"


def test_concurrent_streams_and_cancellation(server: Server) -> None:
    async def main() -> list[str]:
        client = server.async_client()
        try:
            return await asyncio.gather(*(_one(client, i) for i in range(64)))
        finally:
            await client.close()

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert results.count("cancelled") == 13 and results.count("done") == 51
    assert time.monotonic() - t0 < 300

    # Every KV block comes back once the cancelled requests are cleaned up.
    deadline = time.monotonic() + 20
    with server.http() as h:
        while True:
            stats = h.get("/v1/engine/stats").json()
            idle = stats["running"] == 0 and stats["waiting"] == 0
            if idle and stats["blocks_free"] == stats["blocks_total"]:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)


def _wait_idle(h: httpx.Client, timeout: float = 20) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while True:
        stats = h.get("/v1/engine/stats").json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_closing_a_stream_aborts_the_request(server: Server, client: openai.OpenAI) -> None:
    with server.http() as h:
        _wait_idle(h)
        stream = chat(client, stream=True, **fixed(CAP))
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        at_close = h.get("/v1/engine/stats").json()["steps"]
        stats = _wait_idle(h)
        # Finishing would have taken ~2000 more decode steps; an abort takes a few.
        assert stats["steps"] - at_close < CAP // 2, (at_close, stats)
        assert stats["blocks_free"] == stats["blocks_total"]


def test_disconnect_aborts_a_non_streaming_request(server: Server) -> None:
    body = {"model": "tiny", "messages": MSG, "max_tokens": CAP, "ignore_eos": True}
    with server.http() as h:
        _wait_idle(h)
        before = h.get("/v1/engine/stats").json()["steps"]
        with pytest.raises(httpx.TimeoutException):
            h.post("/v1/chat/completions", json=body, timeout=0.3)
        stats = _wait_idle(h)
        assert stats["steps"] - before < CAP // 2, (before, stats)
        assert stats["blocks_free"] == stats["blocks_total"]


def test_stats_need_the_key(server: Server) -> None:
    assert httpx.get(f"{server.url}/v1/engine/stats").status_code == 401


def test_zz_still_serving_after_all_that(client: openai.OpenAI, server: Server) -> None:
    r = chat(client, **fixed(4))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    assert server.proc.poll() is None
    log = server.log()
    # Logs at INFO carry neither the key nor prompts nor file paths.
    assert KEY not in log and "Hello, how are you" not in log
    assert "pytest-of" not in log and "tiny_models0" not in log  # no file paths either
    assert "Traceback" not in log, log[-3000:]
    json.dumps(r.model_dump())


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_stream_obfuscation_on_every_chunk(client: openai.OpenAI, kind: str) -> None:
    """`stream_options.include_obfuscation`: each delta chunk carries random padding (the
    last chunk, of usage only, is not a delta); off unless asked for."""
    make = chat if kind == "chat" else completion
    for asked in (True, False):
        chunks = list(
            make(
                client,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True, "include_obfuscation": asked},
            )
        )
        pads = [c.to_dict().get("obfuscation") for c in chunks if c.choices]
        # Tokens the engine made while the stream was behind come as one chunk, so how many
        # delta chunks there are depends on the machine's speed: at least one, then usage.
        assert pads and chunks[-1].usage is not None and not chunks[-1].choices
        if asked:
            assert all(isinstance(p, str) and p for p in pads), pads
        else:
            assert not any(pads), pads
