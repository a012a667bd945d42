"""Stored responses and background runs of the Responses API against a real `pippin serve`:
`background: true` polled with GET and read again as a stream, `cancel` of a background
run and of a stream in flight, `input_items`, through the official `openai` client.

A tiny random-weight qwen3 model: greedy, it writes until `max_output_tokens`, so a run
with a long limit is still going when the client acts on the first sign of it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from support.errors import assert_api_error
from support.server_utils import Server, run_server

CONTEXT = 2048
LONG = 1800  # far more than any test waits for


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
    kw.setdefault("temperature", 0)
    kw.setdefault("input", "Hello")
    return client.responses.create(**kw)


def poll(client: openai.OpenAI, response_id: str, until: Callable[[Any], bool]) -> Any:
    """GET until `until` holds of the response (each GET one round trip, no sleeping)."""
    for _ in range(100_000):
        got = client.responses.retrieve(response_id)
        if until(got):
            return got
    raise AssertionError(f"{response_id} never got there: {got.status}")


def text_of(response: Any) -> str:
    return "".join(
        part.text for item in response.output if item.type == "message" for part in item.content
    )


def engine_idle(tiny: Server) -> None:
    """The engine runs nothing (polled: an abort takes effect at the engine's next step)."""
    with tiny.http() as h:
        for _ in range(100_000):
            stats = h.get("/v1/engine/stats").json()
            if stats["running"] == 0 and stats["waiting"] == 0:
                return
    raise AssertionError("the engine never went idle")


# --- background ----------------------------------------------------------------------


def test_background_runs_on_and_is_polled(client: openai.OpenAI) -> None:
    r = create(client, background=True)
    assert r.background is True and r.status == "queued" and r.output == []
    done = poll(client, r.id, lambda g: g.status not in ("queued", "in_progress"))
    # The same answer as the request not in the background (greedy).
    whole = create(client)
    assert done.status == whole.status == "incomplete" and done.background is True
    assert text_of(done) == text_of(whole) and done.usage.output_tokens == 8
    assert client.responses.retrieve(r.id).model_dump() == done.model_dump()


def test_background_needs_store(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        create(client, background=True, store=False)
    assert info.value.body["param"] == "background"


def test_cancel_background(client: openai.OpenAI, tiny: Server) -> None:
    r = create(client, background=True, max_output_tokens=LONG)
    poll(client, r.id, lambda g: g.status == "in_progress")
    cancelled = client.responses.cancel(r.id)
    assert cancelled.id == r.id and cancelled.status == "cancelled"
    assert cancelled.usage is None or cancelled.usage.output_tokens < LONG
    engine_idle(tiny)  # the engine request was aborted
    assert client.responses.retrieve(r.id).status == "cancelled"
    # As OpenAI: cancelling again answers the cancelled response.
    assert client.responses.cancel(r.id).model_dump() == cancelled.model_dump()


def test_cancel_at_once(client: openai.OpenAI, tiny: Server) -> None:
    """Cancelled as soon as it is answered (queued, or just begun), it ends all the same."""
    r = create(client, background=True, max_output_tokens=LONG)
    assert client.responses.cancel(r.id).status == "cancelled"
    engine_idle(tiny)
    assert client.responses.retrieve(r.id).status == "cancelled"


def test_cancel_finished(client: openai.OpenAI) -> None:
    r = create(client)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(r.id)
    assert info.value.body["message"] == "Cannot cancel a synchronous response."
    bg = create(client, background=True)
    poll(client, bg.id, lambda g: g.status == "incomplete")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.cancel(bg.id)
    assert "already incomplete" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nope")


def test_background_stream_and_resume(client: openai.OpenAI) -> None:
    stream = create(client, background=True, stream=True)
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.queued", "response.in_progress"]
    assert types[-1] == "response.incomplete"
    assert events[0].response.status == "queued" and events[0].response.background is True
    rid = events[0].response.id
    # Read again from the fourth event on.
    again = list(client.responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[4:]]
    assert client.responses.retrieve(rid).model_dump() == events[-1].response.model_dump()


def test_cancel_stream_in_flight(client: openai.OpenAI, tiny: Server) -> None:
    """A stream (not in the background) stops too, with its terminal event."""
    stream = create(client, stream=True, max_output_tokens=LONG)
    seen: list[Any] = []
    cancelled: Any = None
    for event in stream:
        seen.append(event)
        if event.type == "response.output_text.delta" and cancelled is None:
            cancelled = client.responses.cancel(seen[0].response.id)
    assert cancelled is not None and cancelled.status == "cancelled"
    last = seen[-1]
    assert last.type == "response.incomplete" and last.response.status == "cancelled"
    assert [e.type for e in seen[-4:-1]] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert seen[-2].item.status == "incomplete"
    engine_idle(tiny)
    assert client.responses.retrieve(last.response.id).status == "cancelled"


def test_stream_replay_only_in_background(client: openai.OpenAI, tiny: Server) -> None:
    r = create(client)
    with tiny.http() as h:
        bad = h.get(f"/v1/responses/{r.id}", params={"stream": "true"})
    assert_api_error(bad, 400, param="stream", code="unsupported_parameter")


def test_delete_background(client: openai.OpenAI, tiny: Server) -> None:
    r = create(client, background=True, max_output_tokens=LONG)
    poll(client, r.id, lambda g: g.status == "in_progress")
    client.responses.delete(r.id)
    engine_idle(tiny)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


# --- input items -----------------------------------------------------------------------


def test_input_items(client: openai.OpenAI) -> None:
    first = create(client, input="Tell me about the sea.", instructions="Be brief.")
    second = create(
        client,
        previous_response_id=first.id,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "More."}]},
            {"role": "user", "content": "And the sky?"},
        ],
    )
    items = client.responses.input_items.list(second.id)
    # Newest first: this request's input, then the earlier conversation (its output and
    # input; not its instructions).
    data = items.data
    assert [d.type for d in data] == ["message"] * 4
    assert [d.role for d in data] == ["user", "user", "assistant", "user"]
    assert data[0].content[0].text == "And the sky?" and data[1].content[0].text == "More."
    assert data[2].id == first.output[0].id
    assert data[3].content[0].type == "input_text"
    assert data[3].content[0].text == "Tell me about the sea."
    assert all(d.id for d in data) and items.has_more is False
    assert (items.first_id, items.last_id) == (data[0].id, data[-1].id)
    # The ids are the same every time, and pages follow `after`.
    asc = client.responses.input_items.list(second.id, order="asc")
    assert [d.id for d in asc.data] == [d.id for d in reversed(data)]
    page = client.responses.input_items.list(second.id, limit=2)
    assert [d.id for d in page.data] == [d.id for d in data[:2]] and page.has_more is True
    rest = client.responses.input_items.list(second.id, limit=2, after=page.last_id)
    assert [d.id for d in rest.data] == [d.id for d in data[2:]] and rest.has_more is False
    # The SDK's auto-pagination walks the same list.
    assert [d.id for d in client.responses.input_items.list(second.id, limit=1)] == [
        d.id for d in data
    ]
    # An input item's id is a reference, as an output item's is.
    by_ref = create(client, input=[{"type": "item_reference", "id": data[3].id}])
    assert (
        by_ref.usage.input_tokens
        == create(client, input="Tell me about the sea.").usage.input_tokens
    )


def test_input_items_refusals(client: openai.OpenAI, tiny: Server) -> None:
    r = create(client)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")
    with tiny.http() as h:
        over = h.get(f"/v1/responses/{r.id}/input_items", params={"limit": 101})
        assert_api_error(over, 400, param="limit")
        after = h.get(f"/v1/responses/{r.id}/input_items", params={"after": "msg_nope"})
        assert_api_error(after, 400, param="after")
        inc = h.get(
            f"/v1/responses/{r.id}/input_items", params={"include": "message.output_text.logprobs"}
        )
        assert_api_error(inc, 400, param="include[0]", code="unsupported_value")
    ok = client.responses.input_items.list(r.id, include=["message.input_image.image_url"])
    assert len(ok.data) == 1
