"""Streams every client can read: no character of any Unicode category breaks an event.

Clients split a stream into lines in two ways: the SSE way (\\n, \\r, \\r\\n: the `openai` and
`anthropic` SDKs' decoders) and the `str.splitlines` way (httpx's `aiter_lines`), which also
breaks at U+2028, U+2029, U+0085, \\x0b, \\x0c and \\x1c-\\x1e. Each event must survive both.
The end-to-end test at the bottom has a real server stream U+2028 over HTTP.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic._streaming as anthropic_sse
import httpx
import openai._streaming as openai_sse
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.server_utils import Server, run_server
from test_api_stream_framing import ScriptedEngine, chat_run, completion_run, out

from pippin.api.common import sse, typed_sse

CATEGORIES = sorted({unicodedata.category(chr(c)) for c in range(sys.maxunicode + 1)})
SPLITLINES_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"


@functools.cache
def by_category() -> dict[str, str]:
    """Every code point, surrogates and unassigned ones included, by general category."""
    cats: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for c in range(sys.maxunicode + 1):
        cats[unicodedata.category(chr(c))].append(chr(c))
    return {k: "".join(v) for k, v in cats.items()}


def wire(text: str) -> bytes:
    # As Starlette sends a str chunk; a lone surrogate that reached the wire would fail here.
    return text.encode("utf-8")


def as_json_reads(text: str) -> str:
    """`text` as a JSON reader gets it back: a surrogate pair, escaped, reads as the one
    character it encodes (surrogates are no characters, so no model text holds them)."""
    return json.loads(json.dumps(text))


def pieces(body: bytes, size: int = 7) -> Iterator[bytes]:
    """The body in small pieces, cut anywhere (inside UTF-8 sequences too)."""
    for i in range(0, len(body), size):
        yield body[i : i + size]


def splitlines_events(body: bytes) -> list[tuple[str | None, str]]:
    """(event, data) of each event, the lines split as httpx's aiter_lines splits them."""
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    for line in body.decode("utf-8").splitlines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, line[len("data: ") :]))
            name = None
        else:
            assert line == "", f"a line that is neither event, data nor blank: {line[:40]!r}"
    return events


def sdk_events(decoder: Any, body: bytes) -> list[tuple[str | None, str]]:
    return [(e.event, e.data) for e in decoder.iter_bytes(pieces(body))]


def every_reader(body: bytes) -> list[list[tuple[str | None, str]]]:
    """The events as each kind of client reads them; all must agree."""
    return [
        sdk_events(openai_sse.SSEDecoder(), body),
        sdk_events(anthropic_sse.SSEDecoder(), body),
        splitlines_events(body),
    ]


def test_no_line_break_of_any_kind_reaches_the_wire() -> None:
    payload = {"text": SPLITLINES_BREAKS + "\ud800\udfff"}
    for frame in (sse(payload), typed_sse({"type": "t", **payload})):
        data = frame.split("data: ", 1)[1][:-2]
        assert not any(c in data for c in SPLITLINES_BREAKS)
        assert json.loads(data)["text"] == as_json_reads(payload["text"])
        wire(frame)


@pytest.mark.parametrize("category", CATEGORIES)
def test_every_code_point_of_each_category_survives_every_reader(category: str) -> None:
    """Exhaustive: each code point of the category, in events of 4096 characters."""
    text = by_category()[category]
    chunks = [text[i : i + 4096] for i in range(0, len(text), 4096)]
    frames = []
    for chunk in chunks:
        frames.append(sse({"choices": [{"delta": {"content": chunk}}]}))
        frames.append(typed_sse({"type": "content_block_delta", "delta": {"text": chunk}}))
    frames.append(sse("[DONE]"))
    body = wire("".join(frames))
    for events in every_reader(body):
        assert len(events) == 2 * len(chunks) + 1
        got = []
        for name, data in events[:-1]:
            event = json.loads(data)
            if name is None:
                got.append(event["choices"][0]["delta"]["content"])
            else:
                assert name == "content_block_delta"
                got.append(event["delta"]["text"])
        assert got == [as_json_reads(c) for c in chunks for _ in (0, 1)]
        assert events[-1] == (None, "[DONE]")


def any_text(category: str) -> st.SearchStrategy[str]:
    return st.text(st.characters(categories=[category]), max_size=12)  # type: ignore[list-item]


def streamed(gen: Any) -> bytes:
    async def drain() -> list[str]:
        return [x async for x in gen]

    return wire("".join(asyncio.run(drain())))


def deltas(body: bytes, key: Callable[[dict[str, Any]], str | None]) -> list[str]:
    """The text deltas of a stream, checking that every reader sees the same events."""
    readers = every_reader(body)
    assert readers[0] == readers[1] == readers[2]
    assert readers[0][-1] == (None, "[DONE]")
    found = [key(json.loads(data)) for _, data in readers[0][:-1]]
    return [t for t in found if t]


@settings(max_examples=40, deadline=None)
@given(st.data())
@pytest.mark.parametrize("category", CATEGORIES)
def test_chat_stream_of_any_text(category: str, data: st.DataObject) -> None:
    texts = data.draw(st.lists(any_text(category), min_size=1, max_size=4))
    script = [out(t) for t in texts[:-1]] + [out(texts[-1], "stop")]
    body = streamed(chat_run(ScriptedEngine(*script), include_usage=True).stream())

    def content(e: dict[str, Any]) -> str | None:
        return e["choices"][0]["delta"].get("content") if e["choices"] else None

    assert "".join(deltas(body, content)) == "".join(as_json_reads(t) for t in texts)


@settings(max_examples=40, deadline=None)
@given(st.data())
@pytest.mark.parametrize("category", ["Zl", "Zp", "Cc", "Cs", "Lo", "So", "Cn"])
def test_completion_stream_of_any_text(category: str, data: st.DataObject) -> None:
    texts = data.draw(st.lists(any_text(category), min_size=1, max_size=4))
    script = [out(t) for t in texts[:-1]] + [out(texts[-1], "stop")]
    body = streamed(completion_run(ScriptedEngine(*script)).stream())
    got = "".join(deltas(body, lambda e: e["choices"][0]["text"]))
    assert got == "".join(as_json_reads(t) for t in texts)


# --- end to end: a real server streams U+2028 ------------------------------------

LS = "\u2028"  # LINE SEPARATOR: str.splitlines breaks there, SSE does not
CHOICE = f"a{LS}b"


@pytest.fixture(scope="module")
def server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    with run_server(
        str(tiny_models("llama")), "--served-model-name", "tiny", "--max-model-len", "1024"
    ) as s:
        yield s


def aiter_lines_events(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The stream read as many Python clients read it: httpx's aiter_lines."""

    async def read() -> list[dict[str, Any]]:
        events = []
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async with client.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        events.append(json.loads(line[len("data: ") :]))  # whole events only
                    else:
                        assert line == "" or line.startswith("event: ") or line == "data: [DONE]"
        return events

    return asyncio.run(read())


def test_u2028_in_model_output_over_http(server: Server) -> None:
    """The model writes U+2028 (a grammar forces it); every stream reaches an
    aiter_lines client whole."""
    msgs = [{"role": "user", "content": "hi"}]
    chat = aiter_lines_events(
        server,
        "/v1/chat/completions",
        {"model": "tiny", "messages": msgs, "stream": True, "guided_choice": [CHOICE]},
    )
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chat if e["choices"])
    assert text == CHOICE
    comp = aiter_lines_events(
        server,
        "/v1/completions",
        {"model": "tiny", "prompt": "x", "stream": True, "guided_choice": [CHOICE]},
    )
    assert "".join(e["choices"][0]["text"] for e in comp if e["choices"]) == CHOICE
    # Responses and Messages: a JSON schema whose only value holds U+2028 (written raw or
    # escaped, the text has it either way once parsed).
    schema = {
        "type": "object",
        "properties": {"s": {"type": "string", "enum": [CHOICE]}},
        "required": ["s"],
        "additionalProperties": False,
    }
    resp = aiter_lines_events(
        server,
        "/v1/responses",
        {
            "model": "tiny",
            "input": "hi",
            "stream": True,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}},
        },
    )
    text = "".join(e["delta"] for e in resp if e["type"] == "response.output_text.delta")
    assert json.loads(text) == {"s": CHOICE}
    msg = aiter_lines_events(
        server,
        "/v1/messages",
        {
            "model": "tiny",
            "max_tokens": 64,
            "messages": msgs,
            "stream": True,
            "output_config": {"format": {"type": "json_schema", "schema": schema}},
        },
    )
    text = "".join(e["delta"].get("text", "") for e in msg if e["type"] == "content_block_delta")
    assert json.loads(text) == {"s": CHOICE}
