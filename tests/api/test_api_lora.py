"""LoRA adapters over HTTP: a real `pippin serve` with `--lora-modules`, the openai SDK as
the client. /v1/models lists adapters with their base as parent; a request names the
adapter as its model on every API (OpenAI chat and completions, Anthropic, Ollama);
adapters load and unload at run time, within --models-dir, for admins only."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from mlx_lm.utils import load
from support.lora_adapters import random_lora, reference, with_adapter, write_mlx, write_peft
from support.server_utils import Server, engine_process_pid, run_server

PROMPT = [11, 23, 35, 47, 59, 61, 73, 85, 97, 109, 12, 14]
GEN = 8


@pytest.fixture(scope="module")
def setup(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tiny_models("llama")
    model, _ = load(str(base))
    root = tmp_path_factory.mktemp("models")
    n = len(model.layers)
    a = random_lora(model, rank=4, seed=1)
    b = random_lora(model, rank=8, seed=2, keys=("self_attn.q_proj", "mlp.down_proj"))
    return {
        "base": base,
        "root": root,
        "a": write_mlx(root / "adapter-a", a, scale=2.0, num_layers=n),
        "b": write_peft(root / "adapter-b", b, alpha=16.0),
        "b_mlx": write_mlx(tmp_path_factory.mktemp("ref") / "b", b, scale=2.0, num_layers=n),
        "outside": write_mlx(tmp_path_factory.mktemp("elsewhere") / "a", a, 2.0, n),
    }


@pytest.fixture(scope="module")
def server(setup: dict[str, Path]) -> Iterator[Server]:
    bay = {"name": "bay", "path": str(setup["b"]), "base_model_name": setup["base"].name}
    args = [str(setup["base"]), "--lora-modules", f"sea={setup['a']}", json.dumps(bay)]
    with run_server(*args, "--models-dir", str(setup["root"])) as s:
        yield s


def expected(setup: dict[str, Path], adapter: Path | None) -> str:
    model, tokenizer = load(str(setup["base"]))
    if adapter is not None:
        with_adapter(model, adapter)
    tokens, _, _ = reference(model, PROMPT, GEN)
    return tokenizer.decode(tokens)


def complete(server: Server, model: str) -> str:
    r = server.client().completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=GEN,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.model == model
    return r.choices[0].text


def cards(server: Server) -> dict[str, dict[str, Any]]:
    return {m.id: m.model_dump() for m in server.client().models.list().data}


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    with server.http() as h:
        return h.post(path, json=body)


def test_models_lists_the_adapter_with_its_base(server: Server, setup: dict[str, Path]) -> None:
    listed = cards(server)
    base = setup["base"].name
    assert listed["sea"]["parent"] == base
    assert listed["sea"]["root"] == str(setup["a"])
    assert "parent" not in listed[base]
    assert listed["bay"]["parent"] == base and listed["bay"]["root"] == str(setup["b"])
    assert server.client().models.retrieve("sea").model_dump()["parent"] == base


def test_completions_equal_mlx_lm_with_the_adapter_fused(
    server: Server, setup: dict[str, Path]
) -> None:
    with_a, alone = complete(server, "sea"), complete(server, setup["base"].name)
    assert with_a == expected(setup, setup["a"])
    assert alone == expected(setup, None)
    assert with_a != alone


def test_every_api_reaches_the_adapter(server: Server) -> None:
    r = server.client().chat.completions.create(
        model="sea",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=4,
        temperature=0,
    )
    assert r.model == "sea" and r.usage is not None and r.usage.completion_tokens >= 1
    body = {
        "model": "sea",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hello"}],
    }
    with server.http() as h:
        assert h.post("/v1/messages", json=body).status_code == 200
        resp = h.post("/v1/responses", json={"model": "sea", "input": "hi", "max_output_tokens": 4})
        assert resp.status_code == 200, resp.text
        chat = {"model": "sea", "messages": body["messages"], "stream": False}
        o = h.post("/api/chat", json={**chat, "options": {"num_predict": 4}})
        assert o.status_code == 200 and o.json()["model"] == "sea", o.text
        g = h.post("/api/generate", json={"model": "sea:latest", "prompt": "hi", "stream": False})
        assert g.status_code == 200, g.text


def test_unknown_adapter_is_model_not_found(server: Server) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        complete(server, "no-such-adapter")
    assert e.value.code == "model_not_found"


def test_load_use_unload_at_run_time(server: Server, setup: dict[str, Path]) -> None:
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "lake", "lora_path": str(setup["b"])})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'lake' added successfully."
    assert cards(server)["lake"]["parent"] == setup["base"].name
    assert complete(server, "lake") == expected(setup, setup["b_mlx"])
    again = post(
        server, "/v1/load_lora_adapter", {"lora_name": "lake", "lora_path": str(setup["b"])}
    )
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]

    # Running with it: unloading waits for the request (409), then goes. 2,000 tokens: the
    # request must still run when the unload arrives (40 once finished first, on an idle
    # machine: the server has its first chunk out before the client reads it).
    stream = server.client().completions.create(
        model="lake", prompt=PROMPT, max_tokens=2000, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))  # the request is in the engine
    busy = post(server, "/v1/unload_lora_adapter", {"lora_name": "lake"})
    assert busy.status_code == 409, busy.text
    for _ in stream:  # the last chunk comes once the engine has let the request go
        pass
    done = post(server, "/v1/unload_lora_adapter", {"lora_name": "lake"})
    assert done.status_code == 200, done.text
    assert done.text == "Success: LoRA adapter 'lake' removed successfully."
    assert "lake" not in cards(server)
    with pytest.raises(openai.NotFoundError):
        complete(server, "lake")
    gone = post(server, "/v1/unload_lora_adapter", {"lora_name": "lake"})
    assert gone.status_code == 400 and "cannot be found" in gone.json()["error"]["message"]


def test_load_checks_path_and_files(server: Server, setup: dict[str, Path]) -> None:
    outside = {"lora_name": "x", "lora_path": str(setup["outside"])}
    r = post(server, "/v1/load_lora_adapter", outside)
    assert r.status_code == 400 and r.json()["error"]["code"] == "path_not_allowed"
    dora = setup["root"] / "dora"
    dora.mkdir(exist_ok=True)
    config = json.loads((setup["a"] / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "fine_tune_type": "dora"}))
    r = post(server, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(dora)})
    assert r.status_code == 400 and "dora" in r.json()["error"]["message"]
    missing = {"lora_name": "x", "lora_path": str(setup["root"] / "none")}
    assert post(server, "/v1/load_lora_adapter", missing).status_code == 400
    taken = {"lora_name": setup["base"].name, "lora_path": str(setup["b"])}
    assert post(server, "/v1/load_lora_adapter", taken).status_code == 400
    assert "x" not in cards(server)


def test_management_disabled_refuses_loading(setup: dict[str, Path]) -> None:
    args = [str(setup["base"]), "--models-dir", str(setup["root"]), "--disable-model-management"]
    with run_server(*args) as s:
        r = post(s, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(setup["a"])})
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "model_management_disabled"
        assert post(s, "/v1/unload_lora_adapter", {"lora_name": "x"}).status_code == 403


def test_lora_modules_forms(setup: dict[str, Path], tmp_path: Path) -> None:
    """NAME=PATH, vLLM's JSON form with its base, and a bad folder stopping the start."""
    from pippin.serving.adapters import Adapters, parse_module
    from pippin.serving.model_specs import SpecError
    from pippin.serving.settings import ServerSettings

    item = json.dumps({"name": "j", "path": str(setup["a"]), "base_model_name": "m"})
    assert parse_module(("", item)).base == "m"
    assert parse_module(("n", "/p")).base is None
    with pytest.raises(SpecError, match="needs 'name' and 'path'"):
        parse_module(("", json.dumps({"name": "j"})))
    ok = Adapters(ServerSettings(lora_modules=[("a", str(setup["a"])), ("", item)]))
    assert set(ok.by_name) == {"a", "j"}
    with pytest.raises(SpecError, match="no adapter_config.json"):
        Adapters(ServerSettings(lora_modules=[("bad", str(tmp_path))]))


def test_a_restarted_engine_process_loads_its_adapters_again(setup: dict[str, Path]) -> None:
    args = [str(setup["base"]), "--engine-process", "--models-dir", str(setup["root"])]
    with run_server(*args) as s:
        body = {"lora_name": "lake", "lora_path": str(setup["b"])}
        assert post(s, "/v1/load_lora_adapter", body).status_code == 200
        before = complete(s, "lake")
        os.kill(engine_process_pid(s), signal.SIGKILL)
        with s.http() as h:  # /health says when it is gone, then when it is back
            while h.get("/health").status_code == 200:
                time.sleep(0.05)
            while h.get("/health").status_code != 200:
                time.sleep(0.2)
        assert complete(s, "lake") == before == expected(setup, setup["b_mlx"])
