"""A stream that fails after its 200 ends with its API's error event and is counted.

Every chat API's stream goes through one failure path (`pippin.serving.streams.guarded`):
the failure is noted on the request's record, so the errors metric and the request log
see it, whichever API the stream speaks. The failure here is `--request-timeout`: each
request asks for far more tokens than any machine generates before it (greedy or
`ignore_eos`, and this random model does not write its end token greedily), so the
timeout, not the machine's speed, decides how the stream ends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.server_utils import Server, run_server

from pippin.bench.scrape import Samples, parse_metrics, total

MSG = [{"role": "user", "content": "Tell me a long story."}]
LONG = 30000  # tokens asked for: the timeout always comes first


@pytest.fixture(scope="module")
def server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    with run_server(
        str(tiny_models("llama")),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "32768",
        "--request-timeout",
        "1",
    ) as s:
        yield s


def _errors(server: Server) -> float:
    r = httpx.get(f"{server.url}/metrics", timeout=30)
    assert r.status_code == 200
    samples: Samples = parse_metrics(r.text)
    return total(samples, "pippin_request_errors_total", kind="request_timeout") or 0.0


def _data(lines: list[str]) -> list[Any]:
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def _openai_end(lines: list[str]) -> None:
    assert lines[-1] == "data: [DONE]"
    last = _data(lines)[-1]
    assert last["error"]["code"] == "request_timeout", last
    # The failed stream has no finish reason.
    chunks = _data(lines)[:-1]
    assert all(c["choices"][0].get("finish_reason") is None for c in chunks if c["choices"])


def _anthropic_end(lines: list[str]) -> None:
    events = [x[7:] for x in lines if x.startswith("event: ")]
    assert events[0] == "message_start" and events[-1] == "error", events[-3:]
    assert "message_stop" not in events
    last = _data(lines)[-1]
    assert last["type"] == "error" and "timed out" in last["error"]["message"], last


def _responses_end(lines: list[str]) -> None:
    last = _data(lines)[-1]
    assert last["type"] == "response.failed", last
    assert last["response"]["status"] == "failed"
    assert "timed out" in last["response"]["error"]["message"]
    numbers = [e["sequence_number"] for e in _data(lines)]
    assert numbers == list(range(len(numbers)))


def _ollama_end(lines: list[str]) -> None:
    objs = [json.loads(x) for x in lines if x]
    assert "timed out" in objs[-1]["error"], objs[-1]
    assert not any(o.get("done") for o in objs)


GREEDY_OLLAMA = {"num_predict": LONG, "temperature": 0}
CASES: dict[str, tuple[dict[str, Any], Callable[[list[str]], None]]] = {
    "/v1/chat/completions": (
        {"messages": MSG, "max_tokens": LONG, "ignore_eos": True, "stream": True},
        _openai_end,
    ),
    "/v1/completions": (
        {"prompt": "Once", "max_tokens": LONG, "ignore_eos": True, "stream": True},
        _openai_end,
    ),
    "/v1/messages": (
        {"messages": MSG, "max_tokens": LONG, "temperature": 0, "stream": True},
        _anthropic_end,
    ),
    "/v1/responses": (
        {"input": "Tell me a long story.", "max_output_tokens": LONG, "temperature": 0},
        _responses_end,
    ),
    "/api/chat": ({"messages": MSG, "options": GREEDY_OLLAMA}, _ollama_end),
    "/api/generate": ({"prompt": "Once", "options": GREEDY_OLLAMA}, _ollama_end),
}


@pytest.mark.parametrize("path", list(CASES))
def test_a_failed_stream_ends_with_the_apis_error_and_is_counted(server: Server, path: str) -> None:
    body, check_end = CASES[path]
    body = {"model": "tiny", **body}
    if path == "/v1/responses":
        body["stream"] = True
    before = _errors(server)
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200  # the failure comes after the status was sent
        lines = [x for x in r.iter_lines() if x]
    check_end(lines)
    # The request's record is closed just after its last byte is sent: wait for it.
    for _ in range(600):
        if _errors(server) > before:
            break
        time.sleep(0.05)
    assert _errors(server) - before == 1
