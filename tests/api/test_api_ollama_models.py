"""The Ollama API over the registry of chat models, through the official `ollama` client:
`/api/tags` lists every model (loaded or not), `/api/ps` the loaded ones with their memory
and `expires_at`, `keep_alive` per request (durations, seconds, negative, 0), and the empty
request with `keep_alive: 0` that unloads a model. A real server with two tiny models."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
import yaml
from support.server_utils import Server, run_server
from support.waiting import wait_for

ollama = pytest.importorskip("ollama")

MESSAGES = [{"role": "user", "content": "Say something about the sea."}]
SHORT = {"temperature": 0, "num_predict": 4}


@pytest.fixture(scope="module")
def server(
    tiny_models: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    spec = tmp_path_factory.mktemp("models") / "models.yaml"
    models = [
        {"model": str(tiny_models("llama", seed=1)), "name": "alpha", "pinned": True},
        {"model": str(tiny_models("llama", seed=2)), "name": "beta"},
    ]
    spec.write_text(yaml.safe_dump({"models": models}))
    with run_server("--models", str(spec), "--max-model-len", "1024") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=300)


def running(client: ollama.Client) -> dict[str, ollama.ProcessResponse.Model]:
    return {m.model or "": m for m in client.ps().models}


def wait_gone(client: ollama.Client, name: str) -> None:
    wait_for(lambda: name not in running(client), f"{name} unloaded")


def seconds_left(m: ollama.ProcessResponse.Model) -> float:
    assert m.expires_at is not None
    return (m.expires_at - datetime.now(timezone.utc)).total_seconds()


def test_tags_list_every_model_and_ps_the_loaded_ones(client: ollama.Client) -> None:
    tags = {m.model: m for m in client.list().models}
    assert set(tags) == {"alpha", "beta"}
    assert all((m.size or 0) > 0 for m in tags.values())  # weight files on disk
    assert tags["beta"].details is not None and tags["beta"].details.family == "llama"
    loaded = running(client)
    assert "alpha" in loaded and "beta" not in loaded  # beta loads on demand
    alpha = loaded["alpha"]
    assert alpha.expires_at is not None and alpha.expires_at.year > 2100  # pinned
    # Its memory: weights and KV pool, more than the weight files alone.
    assert (alpha.size or 0) > (tags["alpha"].size or 0) and alpha.size_vram == alpha.size
    assert alpha.context_length == 1024


def test_keep_alive_per_request(client: ollama.Client) -> None:
    r = client.chat(model="beta", messages=MESSAGES, options=SHORT, keep_alive="5m")
    assert r.model == "beta" and r.done and r.eval_count == 4
    beta = running(client)["beta"]
    assert 280 < seconds_left(beta) <= 300 and (beta.size or 0) > 0
    client.generate(model="beta:latest", prompt="Hello", options=SHORT, keep_alive=120)
    assert 100 < seconds_left(running(client)["beta"]) <= 120
    client.chat(model="beta", messages=MESSAGES, options=SHORT, keep_alive=-1)
    beta = running(client)["beta"]
    assert beta.expires_at is not None and beta.expires_at.year > 2100
    # Without keep_alive the model keeps the last one it was given.
    client.chat(model="beta", messages=MESSAGES, options=SHORT)
    assert seconds_left(running(client)["beta"]) > 10**6
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="beta", messages=MESSAGES, options=SHORT, keep_alive="soon")
    assert info.value.status_code == 400 and "invalid duration" in info.value.error


def test_keep_alive_zero_unloads(client: ollama.Client) -> None:
    # An empty request loads the model (Ollama's preload)...
    r = client.generate(model="beta", keep_alive="10m")
    assert r.done and r.done_reason == "load" and r.response == ""
    assert "beta" in running(client)
    # ... and with keep_alive 0 unloads it.
    r = client.chat(model="beta", messages=[], keep_alive=0)
    assert r.done and r.done_reason == "unload"
    wait_gone(client, "beta")
    assert "beta" in {m.model for m in client.list().models}  # still served
    # A request with keep_alive 0 is answered, then the model unloads once idle.
    r = client.chat(model="beta", messages=MESSAGES, options=SHORT, keep_alive=0)
    assert r.done_reason == "length" and r.eval_count == 4
    wait_gone(client, "beta")


def test_keep_alive_zero_for_a_pinned_model_is_refused(client: ollama.Client) -> None:
    """A model pinned in --models is never unloaded: keep_alive 0 is answered with a 400
    that says so (not an "unload" answer while it stays loaded)."""
    for ask in (
        lambda: client.generate(model="alpha", keep_alive=0),
        lambda: client.chat(model="alpha", messages=[], keep_alive=0),
        lambda: client.chat(model="alpha:latest", messages=MESSAGES, options=SHORT, keep_alive=0),
    ):
        with pytest.raises(ollama.ResponseError) as info:
            ask()
        assert info.value.status_code == 400 and "pinned" in info.value.error
    assert "alpha" in running(client)
    # Any other keep_alive is taken: the model stays loaded at least that long.
    r = client.chat(model="alpha", messages=MESSAGES, options=SHORT, keep_alive="1m")
    assert r.eval_count == 4 and running(client)["alpha"].expires_at.year > 2100


def test_keep_alive_zero_unloads_the_one_model(tiny_models: Callable[..., Path]) -> None:
    """The model given on the command line (`pippin serve MODEL`, loaded at start-up)
    unloads like any other, Ollama's way to free its memory, and the next request loads it
    again; /health stays ok meanwhile."""
    model = str(tiny_models("llama", seed=3))
    with run_server(model, "--served-model-name", "solo", "--max-model-len", "1024") as server:
        _unloads_and_loads_again(server, ollama.Client(host=server.url, timeout=300))


def _unloads_and_loads_again(server: Server, solo: ollama.Client) -> None:
    assert "solo" in running(solo)
    r = solo.generate(model="solo", keep_alive=0)
    assert r.done and r.done_reason == "unload" and r.response == ""
    wait_gone(solo, "solo")
    with server.http() as h:
        assert h.get("/health").status_code == 200
        assert h.get("/v1/models").json()["data"][0]["state"] == "unloaded"
    # Loaded again on demand, and kept (keep_alive 0 held only until it unloaded).
    assert solo.chat(model="solo", messages=MESSAGES, options=SHORT).eval_count == 4
    assert running(solo)["solo"].expires_at.year > 2100
    # A request with keep_alive 0 is answered, then the model unloads once idle ...
    r = solo.chat(model="solo", messages=MESSAGES, options=SHORT, keep_alive=0)
    assert r.done_reason == "length" and r.eval_count == 4
    wait_gone(solo, "solo")
    # ... and an empty prompt loads it; an empty prompt with keep_alive 0 unloads it.
    assert solo.generate(model="solo", prompt="").done_reason == "load"
    assert "solo" in running(solo)
    r = solo.generate(model="solo:latest", prompt="", keep_alive=0)
    assert r.done_reason == "unload"
    wait_gone(solo, "solo")
    # Unloading what is not loaded leaves nothing behind: the next load stays.
    assert solo.chat(model="solo", messages=[], keep_alive=0).done_reason == "unload"
    assert solo.chat(model="solo", messages=[]).done_reason == "load"
    assert running(solo)["solo"].expires_at.year > 2100


def test_show_loads_a_model_on_demand(client: ollama.Client) -> None:
    client.chat(model="beta", messages=[], keep_alive=0)
    wait_gone(client, "beta")
    shown = client.show("beta")
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.template and shown.modelinfo is not None
    assert shown.modelinfo["llama.context_length"] == 1024
    assert "beta" in running(client)
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="gamma", messages=MESSAGES)
    assert info.value.status_code == 404
