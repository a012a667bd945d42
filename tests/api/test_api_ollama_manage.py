"""Ollama's model management over a real server, through the official `ollama` client:
/api/create (from a folder under --models-dir, from a library model, from uploaded
blobs, the legacy Modelfile, MLX quantisation), /api/copy, /api/delete (also while a
stream runs), /api/push refused, /api/blobs, and who may do it (admin keys,
--disable-model-management). Tiny random models; their tokenizer is real enough to count
prompt tokens."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support.server_utils import Server, run_server
from support.waiting import wait_for

ollama = pytest.importorskip("ollama")

ADMIN, USER = "admin-secret", "user-secret"
HI = [{"role": "user", "content": "Hello, how are you today?"}]
SYSTEM = "You are a helpful assistant. Write a short poem about the sea."
# ChatML without tools (the tiny models' own template, trimmed): applied when given.
TEMPLATE = (
    "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models-dir")


@pytest.fixture(scope="module")
def source(tiny_models: Callable[..., Path], models_dir: Path) -> Path:
    """A tiny safetensors model placed under --models-dir (the only place paths may be)."""
    dst = models_dir / "sources" / "tiny-llama"
    shutil.copytree(tiny_models("llama", seed=3), dst)
    return dst


@pytest.fixture(scope="module")
def server(
    tiny_models: Callable[..., Path], models_dir: Path, source: Path, tmp_path_factory
) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(
        json.dumps([{"key": ADMIN, "name": "ops", "admin": True}, {"key": USER, "name": "app"}])
    )
    args = ["--models-dir", str(models_dir), "--api-keys", str(keys), "--max-model-len", "512"]
    with run_server(str(tiny_models("llama", seed=1)), "--served-model-name", "base", *args) as s:
        s.api_key = ADMIN
        yield s


def client_for(server: Server, key: str = ADMIN) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=300, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return client_for(server)


def error_of(call: Callable[[], object]) -> ollama.ResponseError:
    with pytest.raises(ollama.ResponseError) as info:
        call()
    return info.value


def tags(client: ollama.Client) -> dict[str, ollama.ListResponse.Model]:
    return {m.model or "": m for m in client.list().models}


def shown(server: Server, name: str) -> dict[str, object]:
    """/api/show's whole answer (the client's model leaves out `system`)."""
    with server.http() as http:
        return http.post("/api/show", json={"model": name}).json()


def create(client: ollama.Client, model: str, **kw: object) -> list[str]:
    return [p.status or "" for p in client.create(model=model, stream=True, **kw)]


def test_create_from_a_folder_with_settings(
    server: Server, client: ollama.Client, source: Path
) -> None:
    statuses = create(
        client,
        "tiny",
        from_=str(source),
        template=TEMPLATE,
        system=SYSTEM,
        parameters={"temperature": 0, "num_predict": 3, "stop": ["<|im_end|>"]},
        license="MIT",
    )
    assert statuses[-2:] == ["writing manifest", "success"]
    assert any(s.startswith("using existing layer sha256:") for s in statuses)
    listed = tags(client)
    assert "tiny:latest" in listed and "base" in listed
    tiny = listed["tiny:latest"]
    assert len(tiny.digest or "") == 64 and (tiny.size or 0) > 0
    assert tiny.details is not None and tiny.details.format == "safetensors"
    show = client.show("tiny")
    assert show.template == TEMPLATE and show.license == "MIT"
    assert shown(server, "tiny")["system"] == SYSTEM
    assert "temperature" in (show.parameters or "") and '"<|im_end|>"' in (show.parameters or "")
    assert (show.modelfile or "").startswith("FROM tiny:latest\n")
    assert "SYSTEM" in (show.modelfile or "") and "PARAMETER num_predict 3" in (
        show.modelfile or ""
    )
    # The parameters are the defaults: num_predict 3 caps the answer.
    plain = client.chat(model="tiny", messages=HI)
    assert plain.done and 1 <= (plain.eval_count or 0) <= 3
    # The model's system prompt is used when the request has none, not beside its own.
    given = client.chat(model="tiny", messages=[{"role": "system", "content": SYSTEM}, *HI])
    other = client.chat(model="tiny:latest", messages=[{"role": "system", "content": "Hi."}, *HI])
    assert plain.prompt_eval_count == given.prompt_eval_count
    assert (other.prompt_eval_count or 0) < (plain.prompt_eval_count or 0)
    with server.http() as http:
        models = http.get("/v1/models").json()["data"]
    assert "tiny:latest" in {m["id"] for m in models}


def test_create_from_a_library_model_and_messages(client: ollama.Client, source: Path) -> None:
    if "tiny:latest" not in tags(client):
        create(client, "tiny", from_=str(source), system=SYSTEM)
    preset = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Ahoy!"}]
    create(client, "tiny-chatty", from_="tiny", messages=preset, parameters={"num_predict": 2})
    show = client.show("tiny-chatty")
    assert show.details is not None and show.details.parent_model == "tiny:latest"
    assert "num_predict" in (show.parameters or "")
    # The same files: the same digest, no copy of the weights.
    listed = tags(client)
    assert listed["tiny-chatty:latest"].digest == listed["tiny:latest"].digest
    with_preset = client.chat(model="tiny-chatty", messages=HI)
    without = client.chat(model="tiny", messages=HI, options={"num_predict": 2})
    assert (with_preset.prompt_eval_count or 0) > (without.prompt_eval_count or 0)
    assert (with_preset.eval_count or 0) <= 2


def test_legacy_modelfile(server: Server, client: ollama.Client) -> None:
    modelfile = (
        '# a comment\nFROM base\nSYSTEM """Be brief.\nVery brief."""\n'
        'PARAMETER temperature 0.2\nPARAMETER stop <a>\nPARAMETER stop "<b>"\n'
    )
    with server.http() as http:
        r = http.post("/api/create", json={"model": "from-file", "modelfile": modelfile})
        lines = [json.loads(x) for x in r.text.splitlines()]
        assert r.status_code == 200 and lines[0] == {"status": "parsing modelfile"}
        assert lines[-1] == {"status": "success"}
        bad = http.post("/api/create", json={"model": "x", "modelfile": "FROM base\nFOO bar\n"})
        assert bad.status_code == 400 and "'FOO'" in bad.json()["error"]
    show = shown(server, "from-file")
    assert show["system"] == "Be brief.\nVery brief." and show["details"]["parent_model"] == "base"
    assert str(show["parameters"]).count("stop") == 2


def test_quantize(client: ollama.Client, source: Path) -> None:
    for quantize, level in (("q8_0", "Q8"), ("q4_K_M", "Q4")):
        name = f"tiny-{quantize.lower()}"
        statuses = create(client, name, from_=str(source), quantize=quantize)
        assert f"quantizing safetensors model to {quantize}" in statuses
        r = client.chat(model=name, messages=HI, options={"num_predict": 2})
        assert r.done and (r.eval_count or 0) >= 1
        show = client.show(name)
        assert show.details is not None and show.details.quantization_level == level
        assert tags(client)[f"{name}:latest"].details.quantization_level == level


def test_create_refusals(
    server: Server, client: ollama.Client, tmp_path: Path, source: Path
) -> None:
    outside = tmp_path / "elsewhere"
    shutil.copytree(source, outside)
    e = error_of(lambda: client.create(model="nope", from_=str(outside)))
    assert e.status_code == 400 and "--models-dir" in e.error
    e = error_of(lambda: client.create(model="nope", from_=str(source), adapters={"a": "b"}))
    assert e.status_code == 400 and "--lora-modules" in e.error
    e = error_of(lambda: client.create(model="nope", from_=str(source), quantize="q5_K_M"))
    assert e.status_code == 400 and "q5_K_M" in e.error
    e = error_of(lambda: client.create(model="nope", from_="base", template="{{ .Prompt }}"))
    assert e.status_code == 400 and "Jinja" in e.error
    e = error_of(lambda: client.create(model="nope", from_="base", parameters={"mirostat": 1}))
    assert e.status_code == 400 and "mirostat" in e.error
    for unknown in ("no-such-model", "claude-3-opus"):  # not the default, by pattern
        e = error_of(lambda: client.create(model="nope", from_=unknown))  # noqa: B023
        assert e.status_code == 404
    assert error_of(lambda: client.delete("claude-3-opus")).status_code == 404
    with server.http() as http:
        r = http.post("/api/create", json={"model": "nope", "from": "base", "colour": "red"})
        assert r.status_code == 400 and "colour" in r.json()["error"]
    assert "nope:latest" not in tags(client)


def test_copy_then_delete_the_source(server: Server, client: ollama.Client, source: Path) -> None:
    create(client, "original", from_=str(source), system="one")
    client.copy("original", "duplicate")
    assert client.show("duplicate").details.parent_model == "original:latest"
    client.delete("original")
    assert "original:latest" not in tags(client)
    e = error_of(lambda: client.chat(model="original", messages=HI))
    assert e.status_code == 404
    r = client.chat(model="duplicate", messages=HI, options={"num_predict": 2})
    assert r.done and shown(server, "duplicate")["system"] == "one"
    e = error_of(lambda: client.delete("original"))
    assert e.status_code == 404 and e.error == "model 'original' not found"
    e = error_of(lambda: client.delete("base"))
    assert e.status_code == 400 and "command line" in e.error
    e = error_of(lambda: client.copy("base", "base-copy"))
    assert e.status_code == 400 and "command line" in e.error


def test_delete_while_a_stream_runs(client: ollama.Client, source: Path, models_dir: Path) -> None:
    create(client, "victim", from_=str(source))
    content = {p.name for p in (models_dir / "content").iterdir()}
    stream = client.chat(
        model="victim", messages=HI, options={"num_predict": 300, "temperature": 1}, stream=True
    )
    first = next(stream)
    assert first.model == "victim"
    client.delete("victim")  # answered at once; the files wait for the stream
    e = error_of(lambda: client.chat(model="victim", messages=HI))
    assert e.status_code == 404
    rest = list(stream)
    assert (rest[-1] if rest else first).done
    # Once the stream has ended and the model unloaded, its files go.
    wait_for(
        lambda: len({p.name for p in (models_dir / "content").iterdir()}) == len(content) - 1,
        "the deleted model's files removed",
    )


def test_push_is_refused(client: ollama.Client) -> None:
    e = error_of(lambda: client.push("base"))
    assert e.status_code == 400 and "does not push" in e.error


def test_blobs_and_create_from_files(server: Server, client: ollama.Client, source: Path) -> None:
    files = {p.name: client.create_blob(p) for p in sorted(source.iterdir()) if p.is_file()}
    with server.http() as http:
        assert http.head(f"/api/blobs/{files['config.json']}").status_code == 200
        assert http.head(f"/api/blobs/sha256:{'0' * 64}").status_code == 404
        assert http.head("/api/blobs/sha256:xyz").status_code == 400
        r = http.post(f"/api/blobs/sha256:{'1' * 64}", content=b"not these bytes")
        assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
        assert http.head(f"/api/blobs/sha256:{'1' * 64}").status_code == 404
    e = error_of(lambda: client.create(model="x", files={"config.json": files["config.json"]}))
    assert e.status_code == 400 and "safetensors" in e.error
    statuses = create(client, "uploaded", files=files)
    assert statuses[-1] == "success"
    assert statuses.count("using existing layer sha256:" + files["config.json"][7:]) == 1
    r = client.chat(model="uploaded", messages=HI, options={"num_predict": 2})
    assert r.done
    with server.http() as http:  # the files moved into the model: no blob is kept
        assert http.head(f"/api/blobs/{files['config.json']}").status_code == 404


def test_only_admin_keys_manage_models(server: Server) -> None:
    user = client_for(server, USER)
    assert "base" in tags(user)  # reading is for every key
    for call in (
        lambda: user.create(model="mine", from_="base"),
        lambda: user.copy("base", "mine"),
        lambda: user.delete("base"),
        lambda: user.push("base"),
    ):
        e = error_of(call)
        assert e.status_code == 403 and "admin" in e.error
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {USER}"}) as http:
        assert http.head(f"/api/blobs/sha256:{'0' * 64}").status_code == 403


def test_model_management_can_be_turned_off(tiny_models: Callable[..., Path]) -> None:
    with run_server(str(tiny_models("llama", seed=1)), "--disable-model-management") as s:
        c = ollama.Client(host=s.url, timeout=300)
        e = error_of(lambda: c.create(model="mine", from_="x"))
        assert e.status_code == 403 and "--disable-model-management" in e.error
        e = error_of(lambda: c.delete("x"))
        assert e.status_code == 403


def test_create_from_a_gguf_file(client: ollama.Client, models_dir: Path, qwen_gguf: Path) -> None:
    placed = models_dir / "sources" / "coder.gguf"
    try:
        os.link(qwen_gguf, placed)  # no second copy of the weights
    except OSError:
        shutil.copyfile(qwen_gguf, placed)
    e = error_of(lambda: client.create(model="coder", from_=str(placed), quantize="q4_K_M"))
    assert e.status_code == 400 and "GGUF" in e.error
    assert create(client, "coder", from_=str(placed))[-1] == "success"
    coder = tags(client)["coder:latest"]
    assert coder.details is not None and coder.details.format == "gguf"
    assert coder.size == placed.stat().st_size
