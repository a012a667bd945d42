"""Sleep mode over HTTP (vLLM's POST /sleep, POST /wake_up, GET /is_sleeping) against a
real `pippin serve`, in process and with --engine-process: 503 with Retry-After while
asleep, the KV pool's bytes gone, the same greedy answer after waking. Also the
`priority` field's 400 under the default first-come-first-served policy."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import openai
import pytest
from support.server_utils import Server, run_server

MESSAGES = [{"role": "user", "content": "Tell me about the tides."}]


@pytest.fixture(scope="module", params=["inproc", "process"])
def server(request: pytest.FixtureRequest, tiny_models: Callable[..., Path]) -> Iterator[Server]:
    engine = ["--engine-process"] if request.param == "process" else ["--no-engine-process"]
    with run_server(str(tiny_models("llama")), "--served-model-name", "tiny", *engine) as s:
        yield s


def _answer(server: Server) -> str:
    r = server.client().chat.completions.create(
        model="tiny",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return r.choices[0].message.content or ""


def _stats(server: Server) -> dict[str, int]:
    with server.http() as h:
        return h.get("/v1/engine/stats", params={"model": "tiny"}).json()


def _sleeping(server: Server) -> bool:
    with server.http() as h:
        return h.get("/is_sleeping").json()["is_sleeping"]


def _refused_while_asleep(server: Server) -> None:
    with server.http() as h:
        r = h.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES})
        assert r.status_code == 503 and r.headers["retry-after"]
        assert r.json()["error"]["code"] == "model_sleeping"
        health = h.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "sleeping"}
        assert [m["id"] for m in h.get("/v1/models").json()["data"]] == ["tiny"]
    with pytest.raises(anthropic.APIStatusError) as err:
        anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0).messages.create(
            model="tiny",
            max_tokens=4,
            messages=MESSAGES,  # type: ignore[arg-type]
        )
    assert err.value.status_code == 529 and err.value.body["type"] == "error"  # type: ignore[index]


def test_sleep_and_wake_at_both_levels(server: Server) -> None:
    before = _answer(server)
    awake = _stats(server)
    assert awake["kv_bytes"] > 0 and awake["sleeping"] == 0 and not _sleeping(server)

    with server.http() as h:
        assert h.post("/sleep", params={"level": "1"}).status_code == 200
    assert _sleeping(server)
    asleep = _stats(server)
    assert asleep["sleeping"] == 1 and asleep["kv_bytes"] == 0
    # On the CPU the weights stay where they are (host memory); the pool is gone.
    assert asleep["mlx_active_bytes"] <= awake["mlx_active_bytes"] - awake["kv_bytes"] + 4096
    _refused_while_asleep(server)
    with server.http() as h:
        assert h.post("/wake_up").status_code == 200
    assert not _sleeping(server)
    assert _stats(server)["kv_bytes"] == awake["kv_bytes"]
    assert _answer(server) == before
    assert _stats(server)["prefix_hits"] == awake["prefix_hits"]  # its cache went too

    # Level 2 unloads the model; its weights come back first, then its KV pool.
    with server.http() as h:
        assert h.post("/sleep", params={"level": "2", "mode": "wait"}).status_code == 200
        assert h.get("/v1/engine/stats", params={"model": "tiny"}).json() == {}
        _refused_while_asleep(server)
        assert h.post("/wake_up", params={"tags": "weights"}).status_code == 200
        assert _sleeping(server) and _stats(server)["kv_bytes"] == 0
        assert h.post("/wake_up", params={"tags": "kv_cache"}).status_code == 200
    assert not _sleeping(server)
    assert _answer(server) == before
    assert _stats(server)["prefix_hits"] == 0  # the reloaded engine's cache starts empty


def test_bad_sleep_arguments_and_priority_under_fcfs(server: Server) -> None:
    with server.http() as h:
        for params in ({"level": "3"}, {"mode": "keep"}):
            r = h.post("/sleep", params=params)
            assert r.status_code == 400, params
        r = h.post("/wake_up", params={"tags": "everything"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tags"
    assert not _sleeping(server)

    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=2,
            extra_body={"priority": 1},
        )
    assert err.value.body["param"] == "priority"  # type: ignore[index]
    with server.http() as h:
        r = h.post("/v1/responses", json={"model": "tiny", "input": "Hi", "priority": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    r = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=2, extra_body={"priority": 0}
    )
    assert r.usage is not None and r.usage.completion_tokens == 2


def test_management_off_refuses_sleep(tiny_models: Callable[..., Path]) -> None:
    with (
        run_server(
            str(tiny_models("llama")), "--served-model-name", "tiny", "--disable-model-management"
        ) as s,
        s.http() as h,
    ):
        r = h.post("/sleep")
        assert r.status_code == 403 and r.json()["error"]["code"] == "model_management_disabled"
        assert h.post("/wake_up").status_code == 403
        assert h.get("/is_sleeping").json() == {"is_sleeping": False}


def test_sleep_refused_where_it_is_not_offered(tiny_models: Callable[..., Path]) -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 2}'
    model = str(tiny_models("llama"))
    with run_server(model, "--served-model-name", "tiny", "--speculative-config", spec) as s:
        with s.http() as h:
            r = h.post("/sleep")
            assert r.status_code == 500 and r.json()["error"]["code"] == "sleep_unavailable"
            assert h.get("/is_sleeping").json() == {"is_sleeping": False}
        assert _answer(s)  # still awake and serving
