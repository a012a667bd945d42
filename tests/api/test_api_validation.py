"""Request validation, auth and body limits, without a model (FastAPI TestClient).

Validation happens before the engine is consulted, so an app without a model answers
400s exactly as a serving one does, and 503 once a request is valid.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.errors import assert_api_error

from pippin.server.app import create_app
from pippin.serving.state import MIB, ServerSettings

KEY = "sk-test-key"
MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": MODEL, "prompt": "hi"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = ServerSettings(served_model_names=[MODEL], api_key=KEY, max_request_body_bytes=MIB)
    with TestClient(create_app(settings, load_model=False)) as c:
        c.headers["Authorization"] = f"Bearer {KEY}"
        yield c


def chat(client: TestClient, **fields: Any) -> Any:
    return client.post("/v1/chat/completions", json={**CHAT, **fields})


def completion(client: TestClient, **fields: Any) -> Any:
    return client.post("/v1/completions", json={**COMPLETION, **fields})


def test_valid_requests_reach_the_engine_check(client: TestClient) -> None:
    # No model loaded: a valid request passes validation and then gets 503.
    err = assert_api_error(chat(client), 503)
    assert err["type"] == "server_error" and err["code"] == "model_not_ready"
    assert_api_error(completion(client), 503)


def test_health_is_open_and_reports_not_ready(client: TestClient) -> None:
    resp = client.get("/health", headers={"Authorization": ""})
    assert resp.status_code == 503
    # HEAD too (load balancers probe with it): the same status, no body.
    head = client.head("/health", headers={"Authorization": ""})
    assert head.status_code == 503 and head.content == b""


def test_head_of_the_root_is_its_get_without_a_body(client: TestClient) -> None:
    # Claude Code sends `HEAD /` before anything else; it was a 405. It needs no key (the
    # page itself does).
    get = client.get("/")
    head = client.head("/", headers={"Authorization": ""})
    assert client.get("/", headers={"Authorization": ""}).status_code == 401
    assert (get.status_code, head.status_code) == (200, 200)
    assert get.content and head.content == b""
    for name in ("content-type", "content-length", "etag"):
        assert head.headers[name] == get.headers[name]


@pytest.mark.parametrize("path", ["/v1/models", "/version", "/v1/engine/stats"])
def test_api_key_guards_routes(client: TestClient, path: str) -> None:
    assert client.get(path).status_code == 200
    err = assert_api_error(client.get(path, headers={"Authorization": ""}), 401)
    assert err["code"] == "invalid_api_key"
    assert_api_error(client.get(path, headers={"Authorization": "Bearer wrong"}), 401)
    assert_api_error(client.get(path, headers={"Authorization": "", "x-api-key": "wrong"}), 401)
    ok = client.get(path, headers={"Authorization": "", "x-api-key": KEY})
    assert ok.status_code == 200


def test_wrong_key_is_not_echoed(client: TestClient) -> None:
    resp = client.get("/v1/models", headers={"Authorization": "Bearer sk-secret-guess"})
    assert "sk-secret-guess" not in resp.text


def test_models_and_version(client: TestClient) -> None:
    data = client.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == [MODEL]
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    err = assert_api_error(client.get("/v1/models/nope"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert client.get("/version").json()["version"]


def test_unknown_route_is_an_openai_404(client: TestClient) -> None:
    assert_api_error(client.get("/v1/nothing-here"), 404)


def test_unknown_model(client: TestClient) -> None:
    err = assert_api_error(chat(client, model="gpt-9"), 404)
    assert err["code"] == "model_not_found" and err["param"] == "model"


def test_malformed_json(client: TestClient) -> None:
    resp = client.post(
        "/v1/chat/completions",
        content=b'{"model": "m", "messages": [',
        headers={"Content-Type": "application/json"},
    )
    err = assert_api_error(resp, 400)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert_api_error(client.post("/v1/completions", content=b"[1, 2]"), 400)
    assert_api_error(client.post("/v1/completions", content=b""), 400)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": 2.5}, "max_completion_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stop": ["a", 1]}, "stop[1]"),
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"1": "x"}}, "logit_bias.1"),
        ({"seed": "1"}, "seed"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        (
            {"stream": True, "stream_options": {"include_usage": "y"}},
            "stream_options.include_usage",
        ),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
            "messages[0].content[0].text",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"tool_choice": 3}, "tool_choice"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"service_tier": "gold"}, "service_tier"),
        ({"modalities": ["smell"]}, "modalities[0]"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids[0]"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"model": 5}, "model"),
    ],
)
def test_chat_bad_fields_are_named(client: TestClient, fields: dict[str, Any], param: str) -> None:
    err = assert_api_error(chat(client, **fields), 400)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"frobnicate": True}, "frobnicate"),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
        ({"echo": True}, "echo"),  # a completions field, not a chat one
    ],
)
def test_chat_unknown_fields_are_named(
    client: TestClient, fields: dict[str, Any], param: str
) -> None:
    err = assert_api_error(chat(client, **fields), 400)
    assert err["param"] == param
    assert err["code"] == "unknown_parameter"
    assert param in err["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
        ({"store": True}, "store"),
        # Forced calls need tools (structured output itself: test_api_structured.py).
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        (
            {"tools": [{"type": "custom", "custom": {"name": "x"}}]},
            "tools[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        # An image part needs its image_url (whether the model takes
                        # images is known only once it is loaded: tests/vision).
                        "content": [{"type": "image_url", "url": "http://x"}],
                    }
                ]
            },
            "messages[0].content[0].image_url",
        ),
        ({"messages": [{"role": "assistant", "audio": {"id": "a"}}]}, "messages[0].audio"),
        ({"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
        ({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
        ({"continue_final_message": True}, "continue_final_message"),
    ],
)
def test_chat_unsupported_fields_are_refused_by_name(
    client: TestClient, fields: dict[str, Any], param: str
) -> None:
    # These are refused before the engine is needed, so the 400 comes without a model.
    # (reasoning_effort and verbosity depend on the model's template: see the server tests.)
    err = assert_api_error(chat(client, **fields), 400)
    assert err["param"] == param, err


def _audio_chat(client: TestClient, audio: dict[str, Any]) -> dict[str, Any]:
    part = {"type": "input_audio", "input_audio": audio}
    return assert_api_error(chat(client, messages=[{"role": "user", "content": [part]}]), 400)


@pytest.mark.parametrize(
    ("audio", "param", "code"),
    [
        ({"format": "wav"}, "input_audio.data", "missing_required_parameter"),
        ({"data": "AAAA"}, "input_audio.format", "missing_required_parameter"),
        ({"data": "AAAA", "format": "flac"}, "input_audio.format", "invalid_value"),
        ({"data": "AAAA", "format": "wav", "rate": 8000}, "input_audio.rate", "unknown_parameter"),
    ],
)
def test_chat_malformed_input_audio_names_its_field(
    client: TestClient, audio: dict[str, Any], param: str, code: str
) -> None:
    err = _audio_chat(client, audio)
    assert err["param"] == f"messages[0].content[0].{param}", err
    assert err["code"] == code, err


def test_chat_accepts_every_other_reference_field(client: TestClient) -> None:
    fields = {
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "logit_bias": {"5": 1},
        "logprobs": True,
        "top_logprobs": 2,
        "max_completion_tokens": 5,
        "metadata": {"a": "b"},
        "modalities": ["text"],
        "n": 2,
        "parallel_tool_calls": False,
        "prompt_cache_key": "k",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
        "response_format": {"type": "text"},
        "safety_identifier": "user-1",
        "seed": 3,
        "service_tier": "auto",
        "stop": ["x"],
        "store": False,
        "stream": True,
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "temperature": 0.5,
        "tool_choice": "auto",
        "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        ],
        "top_p": 0.9,
        "user": "u",
        "verbosity": "medium",
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "ignore_eos": False,
        "stop_token_ids": [1],
        "min_tokens": 1,
        "skip_special_tokens": True,
        "chat_template_kwargs": {"x": 1},
        "add_generation_prompt": True,
    }
    # Passes validation; 503 only because no model is loaded here.
    assert_api_error(chat(client, **fields), 503)


def test_chat_message_shapes_are_accepted(client: TestClient) -> None:
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "system", "content": "sys", "name": "s"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
        {"role": "function", "name": "f", "content": "1"},
        {"role": "user", "content": "go"},
    ]
    assert_api_error(chat(client, messages=messages), 503)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": 5}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt[0]"),
        ({"logprobs": 6}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"best_of": 3}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"echo": True, "logprobs": 1, "max_tokens": 0}, "echo"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"messages": []}, "messages"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_completion_bad_fields_are_named(
    client: TestClient, fields: dict[str, Any], param: str
) -> None:
    err = assert_api_error(completion(client, **fields), 400)
    assert err["param"] == param, err


def test_completion_accepts_reference_fields(client: TestClient) -> None:
    fields = {
        "prompt": [[1, 2], [3]],
        "best_of": 2,
        "n": 2,
        "echo": True,
        "frequency_penalty": 0,
        "logit_bias": {"1": -100},
        "max_tokens": 3,
        "presence_penalty": 0,
        "seed": 1,
        "stop": "x",
        "stream": True,
        "stream_options": {"include_usage": True},
        "suffix": None,
        "temperature": 1,
        "top_p": 1,
        "user": "u",
    }
    assert_api_error(completion(client, **fields), 503)


def test_body_over_the_cap_by_content_length(client: TestClient) -> None:
    body = json.dumps({**CHAT, "pad": "x" * (2 * MIB)}).encode()
    err = assert_api_error(client.post("/v1/chat/completions", content=body), 413)
    assert err["code"] == "request_too_large"


def test_body_over_the_cap_when_chunked(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "pad": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}'

    err = assert_api_error(client.post("/v1/completions", content=chunks()), 413)
    assert err["code"] == "request_too_large"


def test_bad_content_length_is_refused(client: TestClient) -> None:
    resp = client.post("/v1/completions", content=b"{}", headers={"Content-Length": "nope"})
    assert resp.status_code in (400, 413)


# A `type` (or other tag) that is an object or a list: every union picks its member by
# a value of the body, which must be checked to be a string before it is used as a key.
# `"tools": [{"type": {}}]` on /v1/responses was a 500 (TypeError: unhashable dict).
@pytest.mark.parametrize("bad", [{}, [], [{}], {"a": 1}])
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/responses", {"input": "hi", "tools": [{"type": "?"}]}, "tools[0].type"),
        ("/v1/responses", {"input": [{"type": "?", "role": "user"}]}, "input[0].type"),
        ("/v1/responses", {"input": "hi", "text": {"format": {"type": "?"}}}, "text.format.type"),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "?"}]}, "tools[0].type"),
        ("/v1/chat/completions", {"messages": [{"role": "?"}]}, "messages[0].role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "?"}]}]},
            "messages[0].content[0].type",
        ),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "?"}}, "response_format"),
        ("/v1/messages", {"tools": [{"type": "?", "name": "f"}]}, "tools[0].type"),
        (
            "/v1/messages",
            {"messages": [{"role": "user", "content": [{"type": "?"}]}]},
            "messages[0].content[0].type",
        ),
        ("/v1/messages", {"tool_choice": {"type": "?"}}, "tool_choice"),
        ("/v1/messages", {"thinking": {"type": "?"}}, "thinking"),
    ],
)
def test_tags_that_are_not_strings_are_named(
    client: TestClient, path: str, body: dict[str, Any], param: str, bad: Any
) -> None:
    body = json.loads(json.dumps(body).replace('"?"', json.dumps(bad)))
    base = {"model": MODEL, **({"max_tokens": 5, **CHAT} if path == "/v1/messages" else {})}
    resp = client.post(path, json={**base, **body})
    assert resp.status_code == 400, resp.text
    if path == "/v1/messages":
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert f"'{param}" in err["message"], err
    else:
        err = assert_api_error(resp, 400)
        assert err["param"].startswith(param), err
