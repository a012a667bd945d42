"""Ollama's /api/pull through the official `ollama` client, on a real `pippin serve` whose
Hugging Face endpoint (HF_ENDPOINT) is a fake hub on the loopback address
(`support.fake_hub`): the streamed statuses in Ollama's order, `stream: false`, errors
before the stream (status and Ollama's body) and within it (an error line), a client that
leaves mid-download (nothing listed, the next pull resumes), and the management guard."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support.fake_hub import FakeHub, fake_hub
from support.server_utils import Server, run_server
from support.waiting import wait_for

from pippin.store.library import ModelLibrary
from pippin.store.loaded import ModelLoadError
from pippin.store.loader import default_model_path, load_model

ollama = pytest.importorskip("ollama")

GGUF = "SmolLM2-135M-Instruct-Q4_1.gguf"


@pytest.fixture(scope="module")
def hub(tiny_models: Callable[..., Path]) -> Iterator[FakeHub]:
    with fake_hub() as h:
        h.add_repo("org/tiny-mlx", tiny_models("llama", seed=3))
        h.add_repo("org/tags-GGUF", {"m-Q8_0.gguf": b"GGUF8", "m-F16.gguf": b"GGUF16"})
        try:
            h.add_repo("org/smol-GGUF", {GGUF: default_model_path()})
        except ModelLoadError:
            pass  # the test that needs it skips
        yield h


@pytest.fixture(autouse=True)
def no_faults(hub: FakeHub) -> Iterator[None]:
    yield
    hub.clear()


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("library")


@pytest.fixture(scope="module")
def server(hub: FakeHub, models_dir: Path, tiny_models: Callable[..., Path]) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", hub.url)  # read by huggingface_hub in the server
        mp.delenv("HF_TOKEN", raising=False)
        with run_server(
            str(tiny_models("llama")), "--models-dir", str(models_dir), "--max-model-len", "512"
        ) as s:
            yield s


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=300)


def test_pull_streams_ollamas_statuses(
    client: ollama.Client, hub: FakeHub, models_dir: Path
) -> None:
    parts = list(client.pull("org/tiny-mlx", stream=True))
    statuses = [p.status for p in parts]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    files = [p for p in parts if p.digest]
    repo = hub.repos["org/tiny-mlx"]
    lfs = {f"sha256:{f.sha256}" for p, f in repo.files.items() if f.lfs}
    assert lfs <= {p.digest for p in files}  # one digest a file, as the Hub lists it
    for p in files:
        assert p.status == f"pulling {p.digest[7:19]}" and p.total and p.completed is not None  # type: ignore[index]
    last = {p.digest: p for p in files}
    assert all(p.completed == p.total for p in last.values())
    # Listed under Ollama's name, and loadable from the library's folder.
    stored = ModelLibrary(models_dir).require("org/tiny-mlx")
    assert stored.source == f"org/tiny-mlx@{repo.commit}"
    assert "org/tiny-mlx:latest" in {m.model for m in client.list().models}
    assert load_model(str(stored.path)).config["model_type"] == "llama"


def test_pulled_models_are_served(client: ollama.Client) -> None:
    """The registry serves the library's models on demand (`ModelRegistry.sync_library`)."""
    client.pull("org/tiny-mlx")
    messages = [{"role": "user", "content": "Hello"}]
    r = client.chat(model="org/tiny-mlx", messages=messages, options={"num_predict": 3})
    assert r.done and r.eval_count == 3
    assert "completion" in (client.show("org/tiny-mlx").capabilities or [])


def test_pull_without_streaming(client: ollama.Client, models_dir: Path) -> None:
    r = client.pull("hf.co/org/tags-GGUF:f16", stream=False)
    assert r.status == "success" and r.digest is None
    stored = ModelLibrary(models_dir).require("hf.co/org/tags-GGUF:f16")
    assert stored.format == "gguf" and stored.entry == "m-F16.gguf"


@pytest.mark.parametrize(
    ("name", "status", "said"),
    [
        ("llama3.2", 400, "'llama3.2' is not a Hugging Face repository"),
        ("hf.co/nobody/nothing", 404, "repository nobody/nothing not found on Hugging Face"),
        ("hf.co/org/tags-GGUF", 404, "no GGUF file tagged 'Q4_K_M'; its tags: F16, Q8_0"),
        ("hf.co/org/tags-GGUF:Q2_K", 404, "no GGUF file tagged 'Q2_K'"),
    ],
)
def test_errors_before_the_stream(client: ollama.Client, name: str, status: int, said: str) -> None:
    for stream in (True, False):
        with pytest.raises(ollama.ResponseError) as e:
            list(client.pull(name, stream=True)) if stream else client.pull(name)
        assert e.value.status_code == status and said in e.value.error


def test_errors_within_the_stream(
    client: ollama.Client, hub: FakeHub, server: Server, models_dir: Path
) -> None:
    wrong = hub.wrong_sha256("org/tiny-mlx", "model.safetensors")
    seen = []
    with pytest.raises(ollama.ResponseError) as e:
        for part in client.pull("org/tiny-mlx:latest", stream=True):
            seen.append(part.status)
    assert e.value.error.startswith("model.safetensors: sha256 mismatch (expected " + wrong)
    assert seen[0] == "pulling manifest" and "success" not in seen
    assert ModelLibrary(models_dir).get("org/tiny-mlx") is not None  # the old copy stays
    with pytest.raises(ollama.ResponseError) as e:
        client.pull("org/tiny-mlx", stream=False)
    assert e.value.status_code == 502 and "sha256 mismatch" in e.value.error
    with pytest.raises(ollama.ResponseError, match="insecure"):
        client.pull("org/tiny-mlx", insecure=True)
    r = httpx.post(f"{server.url}/api/pull", json={"model": ""})
    assert r.status_code == 400 and r.json() == {"error": "model is required"}


def test_client_that_leaves_stops_the_download(
    client: ollama.Client, hub: FakeHub, server: Server, models_dir: Path
) -> None:
    if "org/smol-GGUF" not in hub.repos:
        pytest.skip("the default model is not installed")
    name = "hf.co/org/smol-GGUF:Q4_1"
    release = hub.hold("org/smol-GGUF", GGUF, 25_000_000)
    body = {"model": name}
    with httpx.stream("POST", f"{server.url}/api/pull", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if json.loads(line).get("completed"):
                break  # some of the file is written: leave
    release.set()
    # The server stops at its next chunk: the hub's answer ends short of the file.
    size = hub.repos["org/smol-GGUF"].files[GGUF].size
    first = wait_for(lambda: hub.gets("org/smol-GGUF", GGUF), "the first download logged")[0]
    assert first.sent < size
    assert name not in {m.model for m in client.list().models}
    assert ModelLibrary(models_dir).get(name) is None
    # The next pull resumes it.
    assert list(client.pull(name, stream=True))[-1].status == "success"
    again = hub.gets("org/smol-GGUF", GGUF)[1:]
    assert len(again) == 1 and again[0].range is not None
    start = int(again[0].range.removeprefix("bytes=").rstrip("-"))
    assert start > 0 and again[0].sent == size - start


def test_management_turned_off(
    hub: FakeHub, tiny_models: Callable[..., Path], tmp_path: Path
) -> None:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", hub.url)
        args = (str(tiny_models("llama")), "--models-dir", str(tmp_path))
        with run_server(*args, "--disable-model-management") as s:
            with pytest.raises(ollama.ResponseError) as e:
                ollama.Client(host=s.url).pull("org/tiny-mlx")
    assert e.value.status_code == 403 and "--disable-model-management" in e.value.error
    assert ModelLibrary(tmp_path).list() == []
