"""Ollama's /api/generate `suffix` (fill-in-the-middle), `options.num_ctx`, unknown options
and the timing fields, through the `ollama` library against a real `pippin serve` of the
real Qwen2.5-Coder-0.5B-Instruct GGUF (whose tokenizer has FIM tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.server_utils import Server, run_server

ollama = pytest.importorskip("ollama")

GREEDY = {"temperature": 0, "num_predict": 12}
BEFORE = "def add(a, b):\n    "
AFTER = "\n\n\nprint(add(2, 3))\n"


@pytest.fixture(scope="module")
def server(qwen_gguf: Path) -> Iterator[Server]:
    with run_server(str(qwen_gguf), "--max-model-len", "2048", startup_timeout=900) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=600)


@pytest.fixture(scope="module")
def model(client: ollama.Client) -> str:
    return client.list().models[0].model


def test_suffix_fills_the_middle(client: ollama.Client, model: str) -> None:
    r = client.generate(model=model, prompt=BEFORE, suffix=AFTER, options=GREEDY)
    # The body that fits between the two (this instruct model then writes on: it ends a
    # middle with no end token, so `num_predict` ends the answer).
    assert r.response.startswith("return a + b\n")
    # The prompt was the FIM prompt: the same tokens, written out, in raw mode (whose
    # tokenizer reads the special tokens' spelling), give the same answer.
    fim = f"<|fim_prefix|>{BEFORE}<|fim_suffix|>{AFTER}<|fim_middle|>"
    raw = client.generate(model=model, prompt=fim, raw=True, options=GREEDY)
    assert raw.prompt_eval_count == r.prompt_eval_count
    assert raw.response == r.response
    # Streamed, the same.
    parts = list(
        client.generate(model=model, prompt=BEFORE, suffix=AFTER, options=GREEDY, stream=True)
    )
    assert "".join(p.response for p in parts) == r.response


def test_suffix_refusals(client: ollama.Client, model: str) -> None:
    for extra in ({"system": "Be brief."}, {"think": True}):
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(model=model, prompt=BEFORE, suffix=AFTER, **extra)
        assert e.value.status_code == 400 and "suffix" in e.value.error


def test_num_ctx_caps_the_request(client: ollama.Client, model: str) -> None:
    # Raw code: the model writes on to the token limit.
    kw = {"model": model, "prompt": "import os\nimport sys\n\n\n", "raw": True}
    opts = {"temperature": 0, "num_predict": 16}
    free = client.generate(**kw, options=opts)
    prompt = free.prompt_eval_count
    assert free.eval_count == 16
    capped = client.generate(**kw, options={**opts, "num_ctx": prompt + 7})
    assert capped.eval_count == 7 and capped.done_reason == "length"
    assert free.response.startswith(capped.response)
    # Above the served context: the served context decides.
    wide = client.generate(**kw, options={**opts, "num_ctx": 32768})
    assert wide.eval_count == 16
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(**kw, options={"num_ctx": prompt - 1})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error
    # /api/chat too.
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model, messages=msgs, options={"num_ctx": 4})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error


def test_unknown_option_is_named(client: ollama.Client, model: str) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=model, prompt="Hi", options={"temprature": 0.5})
    assert e.value.status_code == 400 and "temprature" in e.value.error


def _consistent(r: ollama.GenerateResponse) -> None:
    assert r.prompt_eval_duration and r.prompt_eval_duration > 0
    assert r.eval_duration and r.eval_duration > 0
    assert r.load_duration is not None and r.load_duration > 0
    assert r.total_duration >= r.load_duration + r.prompt_eval_duration + r.eval_duration


def test_timings_measured(server: Server, client: ollama.Client, model: str) -> None:
    warm = client.generate(model=model, prompt="Hi", options=GREEDY)
    _consistent(warm)
    # keep_alive 0: unloaded once this request ends; the next one loads it again.
    client.generate(model=model, prompt="Hi", options=GREEDY, keep_alive=0)
    for _ in range(100_000):
        if not client.ps().models:
            break
    else:
        raise AssertionError("the model was never unloaded")
    cold = client.generate(model=model, prompt="Hi", options=GREEDY)
    _consistent(cold)
    # Loading a model takes far longer than finding a loaded one.
    assert cold.load_duration > 10 * warm.load_duration
    assert cold.load_duration > 50_000_000  # 50 ms
