"""vLLM's /tokenize and /detokenize (and llama.cpp's shapes of them), and its request
fields prompt_logprobs, allowed_token_ids, bad_words and truncate_prompt_tokens on chat
completions and completions, through the official client against `pippin serve`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from support.server_utils import Server, run_server

MAX_LEN = 2048
MSG = [{"role": "user", "content": "Tell me about the sea and the sky."}]
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    with run_server(
        str(tiny_models("llama")), "--served-model-name", "tiny", "--max-model-len", str(MAX_LEN)
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def post(server: Server, path: str, body: dict[str, Any]) -> Any:
    with server.http() as http:
        return http.post(path, json=body)


def bad(call: Callable[[], Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.body["param"] == param, e.value.body


# --- /tokenize and /detokenize --------------------------------------------------


def test_tokenize_chat_counts_what_chat_completions_uses(server: Server, client) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for extra in ({}, {"tools": tools}):
        got = post(server, "/tokenize", {"model": "tiny", "messages": MSG, **extra})
        assert got.status_code == 200, got.text
        body = got.json()
        chat = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=1, **extra)
        assert body["count"] == len(body["tokens"]) == chat.usage.prompt_tokens
        assert body["max_model_len"] == MAX_LEN and body["token_strs"] is None
    # Without the generation prompt: fewer tokens; the model may be left out.
    bare = post(server, "/tokenize", {"messages": MSG, "add_generation_prompt": False}).json()
    assert bare["count"] < body["count"]
    refused = post(server, "/tokenize", {"messages": MSG, "chat_template": "{{ x }}"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"


def test_tokenize_prompt_and_detokenize(server: Server, client) -> None:
    body = post(
        server, "/tokenize", {"model": "tiny", "prompt": PROMPT, "return_token_strs": True}
    ).json()
    done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    assert body["count"] == done.usage.prompt_tokens
    assert len(body["token_strs"]) == body["count"]
    plain = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert plain["count"] <= body["count"]
    text = post(server, "/detokenize", {"model": "tiny", "tokens": plain["tokens"]}).json()
    assert text["prompt"] == text["content"] == PROMPT
    for tokens in ([10**9], [-1]):
        r = post(server, "/detokenize", {"model": "tiny", "tokens": tokens})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    assert post(server, "/tokenize", {"model": "nope", "prompt": "x"}).status_code == 404


def test_llama_cpp_shapes(server: Server) -> None:
    ids = post(server, "/tokenize", {"content": PROMPT}).json()["tokens"]
    same = post(server, "/tokenize", {"prompt": PROMPT, "add_special_tokens": False}).json()
    assert ids == same["tokens"]
    pieces = post(server, "/tokenize", {"content": PROMPT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert "".join(p["piece"] for p in pieces).strip() == PROMPT
    assert post(server, "/detokenize", {"tokens": ids}).json()["content"] == PROMPT


# --- prompt_logprobs ----------------------------------------------------------


def _check_prompt_logprobs(lps: list[Any], ids: list[int], k: int) -> None:
    """vLLM's shape: None, then {token id: {logprob, rank, decoded_token}} per prompt
    token: the token's own entry and the top k (ranks 1..k)."""
    assert len(lps) == len(ids) and lps[0] is None
    for tok, entry in zip(ids[1:], lps[1:]):
        mine = entry[str(tok)]
        assert mine["logprob"] <= 0 and mine["rank"] >= 1 and isinstance(mine["decoded_token"], str)
        assert len(entry) in (k, k + 1)
        assert set(range(1, k + 1)) <= {v["rank"] for v in entry.values()}


def test_prompt_logprobs_on_completions_and_chat(server: Server, client) -> None:
    ids = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    done = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2}
    )
    _check_prompt_logprobs(done.choices[0].model_extra["prompt_logprobs"], ids, 2)
    # k = 0: the prompt's own tokens only; the same numbers again (the prefix is cached
    # now, and recomputed).
    again = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 0}
    )
    first = done.choices[0].model_extra["prompt_logprobs"]
    zero = again.choices[0].model_extra["prompt_logprobs"]
    _check_prompt_logprobs(zero, ids, 0)
    for a, b, tok in zip(first[1:], zero[1:], ids[1:]):
        assert a[str(tok)]["logprob"] == pytest.approx(b[str(tok)]["logprob"], abs=1e-3)

    chat_ids = post(server, "/tokenize", {"messages": MSG}).json()["tokens"]
    chat = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    _check_prompt_logprobs(chat.model_extra["prompt_logprobs"], chat_ids, 1)
    plain = client.chat.completions.create(model="tiny", messages=MSG, max_tokens=1)
    assert "prompt_logprobs" not in (plain.model_extra or {})

    bad(
        lambda: client.chat.completions.create(
            model="tiny", messages=MSG, stream=True, extra_body={"prompt_logprobs": 1}
        ),
        "prompt_logprobs",
    )
    bad(
        lambda: client.completions.create(
            model="tiny", prompt=PROMPT, extra_body={"prompt_logprobs": 21}
        ),
        "prompt_logprobs",
    )


# --- allowed_token_ids, bad_words, truncate_prompt_tokens -------------------------


def test_allowed_token_ids(server: Server, client) -> None:
    allowed = post(server, "/tokenize", {"content": " sea sky"}).json()["tokens"]
    texts = {post(server, "/detokenize", {"tokens": [t]}).json()["prompt"] for t in allowed}
    for kind in ("chat", "completions"):
        if kind == "chat":
            out = client.chat.completions.create(
                model="tiny",
                messages=MSG,
                max_tokens=8,
                logprobs=True,
                temperature=1.0,
                extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
            )
            tokens = [t.token for t in out.choices[0].logprobs.content]
        else:
            done = client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=8,
                logprobs=0,
                extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
            )
            tokens = done.choices[0].logprobs.tokens
        assert tokens and set(tokens) <= texts, (tokens, texts)
    for ids in ([10**9], []):
        bad(
            lambda ids=ids: client.completions.create(
                model="tiny", prompt=PROMPT, extra_body={"allowed_token_ids": ids}
            ),
            "allowed_token_ids",
        )


def test_bad_words(client) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    free = client.completions.create(**kw).choices[0].logprobs.tokens
    word = next(t for t in free if t.strip())
    got = client.completions.create(**kw, extra_body={"bad_words": [word.strip()]})
    assert word not in got.choices[0].logprobs.tokens
    chat = client.chat.completions.create(
        model="tiny",
        messages=MSG,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        extra_body={"bad_words": [word.strip()]},
    )
    assert word not in [t.token for t in chat.choices[0].logprobs.content]
    bad(
        lambda: client.chat.completions.create(
            model="tiny", messages=MSG, extra_body={"bad_words": [" "]}
        ),
        "bad_words",
    )


def test_truncate_prompt_tokens(client) -> None:
    done = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"truncate_prompt_tokens": 3}
    )
    assert done.usage.prompt_tokens == 3
    chat = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=1, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage.prompt_tokens == 5
    whole = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}
    )
    assert whole.usage.prompt_tokens > 5
    for value in (MAX_LEN + 1, 0):
        bad(
            lambda value=value: client.chat.completions.create(
                model="tiny", messages=MSG, extra_body={"truncate_prompt_tokens": value}
            ),
            "truncate_prompt_tokens",
        )


def test_echo_with_logprobs(server: Server, client) -> None:
    """OpenAI's echo with logprobs (lm-eval-harness scores prompts so): the prompt's tokens
    come first, the first without a logprob, then the generated ones."""
    ids = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    kw: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=2, echo=True, logprobs=1)
    done = client.completions.create(**kw, temperature=0)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 == done.usage.total_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    scored = (
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 1}
        )
        .choices[0]
        .model_extra["prompt_logprobs"]
    )
    for tok, entry, value in zip(ids[1:], scored[1:], lp.token_logprobs[1:]):
        assert entry[str(tok)]["logprob"] == pytest.approx(value, abs=1e-3)

    streamed: list[Any] = []
    for chunk in client.completions.create(**kw, temperature=0, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.token_logprobs
    assert streamed[0] is None
    assert streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)
