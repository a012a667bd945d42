"""The agent matrix's proxy judges a response by what it relayed: a stream of an API whose
last event says how it ends is whole when that event came, whether or not the client left
before the proxy read the upstream's end (Codex closes on `response.completed`)."""

from __future__ import annotations

import json

from support.recording_proxy import Exchange, stream_problem

SSE = "text/event-stream; charset=utf-8"


def _sse(*events: dict[str, object]) -> bytes:
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def _responses(*, last: bool) -> bytes:
    events: list[dict[str, object]] = [
        {"type": "response.created", "sequence_number": 0},
        {"type": "response.output_text.delta", "delta": "hi", "sequence_number": 1},
    ]
    if last:
        events.append({"type": "response.completed", "sequence_number": 2})
    return _sse(*events)


def _exchange(path: str, body: bytes, content_type: str, complete: bool) -> Exchange:
    return Exchange("codex", "POST", path, b"{}", 200, content_type, body, complete=complete)


def test_a_client_leaving_after_the_last_event_is_no_cut() -> None:
    ex = _exchange("/v1/responses", _responses(last=True), SSE, complete=False)
    assert stream_problem(ex) is None


def test_a_stream_cut_before_its_last_event_is_still_caught() -> None:
    for complete in (False, True):
        ex = _exchange("/v1/responses", _responses(last=False), SSE, complete)
        assert stream_problem(ex) == (
            "the stream ends with response.output_text.delta, not response.completed"
        )
    chat = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
    ex = _exchange("/v1/chat/completions", chat, SSE, complete=False)
    assert stream_problem(ex) == "the stream does not end with one [DONE]"


def test_a_body_with_no_last_event_is_cut_off_unless_relayed_whole() -> None:
    body = json.dumps({"id": "x", "object": "response"}).encode()
    for path, content_type in (("/v1/responses", "application/json"), ("/v1/other", SSE)):
        ex = _exchange(path, body if "json" in content_type else _responses(last=True),
                       content_type, complete=False)  # fmt: skip
        assert stream_problem(ex) == "the response was cut off"
        ex.complete = True
        assert stream_problem(ex) is None
