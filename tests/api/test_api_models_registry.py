"""Several chat models in one `pippin serve`: names, on-demand loading, idle unloading,
eviction under a memory budget, and one model's stream while another loads. Real server
processes, tiny random models, the openai SDK as the client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from support.server_utils import Server, run_server

from pippin.bench.scrape import parse_metrics, total
from pippin.serving.model_specs import ModelSpec, SpecError, load_specs, parse_alias, parse_size
from pippin.serving.registry import ModelRegistry
from pippin.serving.settings import ServerSettings

MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


def models_file(tmp_path: Path, models: list[dict[str, Any]]) -> str:
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"models": models}))
    return str(path)


def cards(server: Server) -> dict[str, dict[str, Any]]:
    with server.http() as h:
        return {c["id"]: c for c in h.get("/v1/models").json()["data"]}


def wait_state(server: Server, name: str, state: str, timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        card = cards(server)[name]
        if card["state"] == state:
            return card
        assert time.monotonic() < deadline, f"{name} never became {state}: {card}"
        time.sleep(0.1)


def answer(client: openai.OpenAI, model: str, n: int = 8) -> str:
    r = client.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=n,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.model == model and r.usage is not None and r.usage.completion_tokens == n
    return r.choices[0].message.content or ""


@pytest.fixture(scope="module")
def paths(tiny_models: Callable[..., Path]) -> dict[str, Path]:
    return {
        "alpha": tiny_models("llama", seed=1),
        "beta": tiny_models("llama", seed=2),
        # Bigger, so that its load takes a while (the stream test watches it load).
        "big": tiny_models(
            "llama", seed=3, hidden_size=512, intermediate_size=2048, num_hidden_layers=6
        ),
    }


@pytest.fixture(scope="module")
def server(paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    spec = models_file(
        tmp_path_factory.mktemp("models"),
        [
            {"model": str(paths["alpha"]), "name": "alpha", "aliases": ["a1"], "pinned": True},
            {"model": str(paths["beta"]), "name": "beta", "aliases": ["b1"], "idle_ttl": 3},
            {"model": str(paths["big"]), "name": "big"},
        ],
    )
    with run_server(
        "--models", spec, "--model-alias", "gpt-*=beta", "--max-model-len", "1024",
        "--num-kv-blocks", "256",
    ) as s:  # fmt: skip
        yield s


def test_each_model_answers_under_its_names(server: Server, paths: dict[str, Path]) -> None:
    client = server.client()
    listed = cards(server)
    assert {"alpha", "a1", "beta", "b1", "big"} <= set(listed)
    assert listed["alpha"]["state"] == "loaded" and listed["alpha"]["pinned"] is True
    alpha, beta = answer(client, "alpha"), answer(client, "beta")
    assert alpha != beta  # two models with different weights
    # Served names and aliases; the path as given, its basename, "default"; patterns.
    for name in ("a1", str(paths["alpha"]), paths["alpha"].name, "default", "claude-sonnet-4"):
        assert answer(client, name) == alpha, name
    for name in ("b1", str(paths["beta"]), paths["beta"].name, "gpt-4o"):
        assert answer(client, name) == beta, name
    with pytest.raises(openai.NotFoundError) as info:
        answer(client, "nope")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]
    # The Anthropic route resolves through the same registry.
    r = httpx.post(
        f"{server.url}/v1/messages",
        json={"model": "b1", "max_tokens": 8, "messages": MESSAGES, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200 and r.json()["model"] == "b1"


def test_on_demand_load_and_idle_unload(server: Server) -> None:
    client = server.client()
    wait_state(server, "beta", "unloaded", timeout=60)  # idle_ttl 3 s after earlier tests
    assert "memory_bytes" not in cards(server)["beta"]
    answer(client, "b1")
    card = cards(server)["beta"]
    assert card["state"] == "loaded" and card["memory_bytes"] > 0
    assert card["expires_at"] > time.time()
    with server.http() as h:
        metrics = parse_metrics(h.get("/metrics").text)
        assert total(metrics, "pippin_model_loaded", model="beta", state="loaded") == 1
        assert total(metrics, "pippin_model_memory_bytes", model="beta") == card["memory_bytes"]
        assert total(metrics, "pippin_generation_tokens_total", model="beta")
        assert h.get("/v1/engine/stats", params={"model": "beta"}).json()["running"] == 0
    wait_state(server, "beta", "unloaded", timeout=60)
    with server.http() as h:
        metrics = parse_metrics(h.get("/metrics").text)
        assert total(metrics, "pippin_model_memory_bytes", model="beta") == 0
        assert h.get("/v1/engine/stats", params={"model": "beta"}).json() == {}
    assert cards(server)["alpha"]["state"] == "loaded"  # pinned: never unloaded


def test_stream_runs_while_another_model_loads(server: Server) -> None:
    client = server.client()
    assert cards(server)["big"]["state"] == "unloaded"
    arrivals: list[float] = []
    loading: list[float] = []  # times /v1/models said "big" was loading
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if cards(server)["big"]["state"] == "loading":
                loading.append(time.monotonic())
            time.sleep(0.02)

    stream = client.chat.completions.create(
        model="alpha",
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)
    assert first.model == "alpha"
    watcher = threading.Thread(target=watch)
    watcher.start()
    loader = threading.Thread(target=lambda: answer(server.client(), "big", 2))
    loader.start()
    text = []
    finish = None
    for chunk in chunks:
        arrivals.append(time.monotonic())
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    loader.join(timeout=300)
    done.set()
    watcher.join()
    assert finish == "length"
    assert loading, "the big model's load was never seen"
    during = [t for t in arrivals if loading[0] <= t <= loading[-1]]
    assert during, "no token of the running stream arrived while the other model loaded"
    assert cards(server)["big"]["state"] == "loaded"


@pytest.fixture(scope="module")
def budget_server(
    server: Server, paths: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    one = cards(server)["alpha"]["memory_bytes"]  # the same shapes as beta's
    spec = models_file(
        tmp_path_factory.mktemp("budget"),
        [
            {"model": str(paths["alpha"]), "name": "alpha"},
            {"model": str(paths["beta"]), "name": "beta"},
        ],
    )
    with run_server(
        "--models", spec, "--memory-budget", str(int(one * 1.5)), "--max-model-len", "1024",
        "--num-kv-blocks", "256", "--model-load-timeout", "0.01",
    ) as s:  # fmt: skip
        yield s


def test_eviction_under_a_memory_budget(budget_server: Server) -> None:
    client = budget_server.client()
    states = cards(budget_server)
    assert states["alpha"]["state"] == states["beta"]["state"] == "unloaded"
    # The load takes longer than --model-load-timeout: a 503 with Retry-After; it goes on.
    with pytest.raises(openai.APIStatusError) as info:
        answer(client, "alpha")
    assert info.value.status_code == 503
    assert info.value.response.headers["retry-after"].isdigit()
    assert info.value.body["code"] == "model_loading"  # type: ignore[index]
    wait_state(budget_server, "alpha", "loaded")
    answer(client, "alpha")
    with pytest.raises(openai.APIStatusError):
        answer(client, "beta")
    wait_state(budget_server, "beta", "loaded")
    # Only one fits: loading beta unloaded alpha, the least recently used.
    assert cards(budget_server)["alpha"]["state"] == "unloaded"
    assert "least recently used" in budget_server.log()


# --- names and specs, without a server ----------------------------------------------


def test_names_resolve_as_clients_send_them(tmp_path: Path) -> None:
    folder = tmp_path / "Qwen-Coder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    gguf = tmp_path / "smol.Q4_1.gguf"
    gguf.write_bytes(b"")
    settings = ServerSettings(model_aliases=[parse_alias("gpt-*=coder")])
    specs = [
        ModelSpec(model=str(gguf)),
        ModelSpec(model=f"{folder}/", names=["coder"], aliases=["c"]),
        ModelSpec(model="org/Some-Model"),
    ]
    reg = ModelRegistry(settings, specs, enabled=False)
    first, coder, hub = reg.entries()
    assert first.name == "smol.Q4_1" and coder.name == "coder" and hub.name == "org/Some-Model"
    for name in (str(gguf), "smol.Q4_1.gguf", "smol.Q4_1", "default", "claude-opus-4-1"):
        assert reg.resolve(name) is first, name
    for name in ("coder", "c", f"{folder}/", str(folder), "Qwen-Coder", "gpt-5"):
        assert reg.resolve(name) is coder, name
    assert reg.resolve("org/Some-Model") is hub and reg.resolve("Some-Model") is hub
    with pytest.raises(Exception) as info:
        reg.resolve("llama")
    assert getattr(info.value, "status", None) == 404
    with pytest.raises(SpecError):  # a pattern must name a served model
        ModelRegistry(ServerSettings(model_aliases=[("gpt-*", "nope")]), specs, enabled=False)
    with pytest.raises(SpecError):  # two models under one name
        ModelRegistry(settings, [ModelSpec("a", names=["x"]), ModelSpec("b", names=["x"])])


def test_sizes_aliases_and_model_files(tmp_path: Path) -> None:
    assert parse_size("16GB") == 16 * 10**9 and parse_size("512MiB") == 512 * 2**20
    assert parse_size("1000") == 1000 and parse_size("1.5g") == 1_500_000_000
    with pytest.raises(SpecError):
        parse_size("lots")
    with pytest.raises(SpecError):
        parse_alias("claude-*")
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    path = models_file(
        tmp_path,
        [
            {
                "model": "a",
                "name": "x",
                "aliases": ["y"],
                "chat_template": "t.jinja",
                "sampling": {"temperature": 0.2},
                "max_model_len": 512,
                "pinned": True,
                "tool_call_parser": "hermes",
            },
            {"model": "b", "idle_ttl": 60, "default": True},
        ],
    )
    a, b = load_specs(path)
    assert (a.names, a.aliases, a.chat_template, a.sampling) == (
        ["x"], ["y"], "{{ messages }}", {"temperature": 0.2}
    )  # fmt: skip
    assert a.pinned and a.max_model_len == 512 and a.tool_call_parser == "hermes"
    assert b.idle_ttl == 60 and b.default and not b.pinned
    for bad in ([{"model": "a", "colour": 1}], [{"model": "a", "sampling": {"tempo": 1}}], []):
        with pytest.raises(SpecError):
            load_specs(models_file(tmp_path, bad))


def test_keep_alive_of_a_request(paths: dict[str, Path]) -> None:
    """The registry's API for other API surfaces (Ollama's keep_alive): a request's
    keep_alive replaces the model's TTL; a model in use is never unloaded."""
    from pippin.engine.config import EngineConfig

    async def main() -> None:
        settings = ServerSettings(engine=EngineConfig(num_blocks=64, max_model_len=256))
        reg = ModelRegistry(settings, [ModelSpec(str(paths["alpha"]), names=["m"])])
        await reg.start()
        entry = reg.resolve("m")
        try:
            assert entry.state == "unloaded"  # on demand
            async with reg.lease("m", keep_alive=-1) as live:  # forever
                assert live.engine is not None and live.engine.ready
            await asyncio.sleep(1.0)
            assert entry.state == "loaded" and entry.expires_at() is None
            async with reg.lease("m", keep_alive=0.5):
                assert entry.active == 1
                await asyncio.sleep(1.0)
                assert entry.state == "loaded"  # in use: kept past its TTL
                assert (entry.expires_at() or 0) > time.time()
            assert entry.active == 0
            for _ in range(100):
                if entry.state == "unloaded":
                    break
                await asyncio.sleep(0.1)
            assert entry.state == "unloaded" and entry.live is None
            async with reg.lease("m"):
                pass
            await reg.unload("m")  # now, being idle
            assert entry.state == "unloaded"
        finally:
            await reg.stop()

    asyncio.run(main())
