"""The security review's findings (docs/reliability.md, "Security review"), each held by a
test against a real server: CORS off unless asked, every route but /health behind the key,
limits on the request head and JSON nesting in each API's error format, and no prompt or
output in the log unless --log-prompts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support.errors import assert_api_error
from support.server_utils import Server, run_server

KEY = "sk-test-security"
ORIGIN = "https://app.example"
MARKER = "zebra-marmalade-4417"  # a prompt nobody else sends: found in the log or not


@pytest.fixture(scope="module")
def server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    with run_server(
        str(tiny_models("llama")),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "256",
        "--log-level",
        "debug",
        "--allowed-origins",
        ORIGIN,
        api_key=KEY,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def logging_server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    with run_server(str(tiny_models("llama")), "--served-model-name", "tiny", "--log-prompts") as s:
        yield s


def chat_body(text: str, **kw: object) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 4, **kw}


# --- the key -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/metrics", "/version", "/v1/engine/stats", "/v1/cache/stats", "/openapi.json", "/docs"],
)
def test_every_route_but_health_needs_the_key(server: Server, path: str) -> None:
    assert_api_error(httpx.get(server.url + path), 401, code="invalid_api_key")
    assert_api_error(
        httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}),
        401,
        code="invalid_api_key",
    )
    assert httpx.get(server.url + path, headers=server.headers()).status_code == 200


def test_health_stays_open(server: Server) -> None:
    assert httpx.get(server.url + "/health").status_code == 200


def test_anthropic_route_refuses_in_its_own_format(server: Server) -> None:
    r = httpx.post(server.url + "/v1/messages", json={"model": "tiny"})
    assert_api_error(r, 401, type="authentication_error")


# --- CORS ------------------------------------------------------------------------


def preflight(server: Server, origin: str) -> httpx.Response:
    return httpx.options(
        server.url + "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )


def test_cors_allows_only_the_origins_given(server: Server) -> None:
    r = preflight(server, ORIGIN)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = preflight(server, "https://evil.example")
    assert "access-control-allow-origin" not in r.headers
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json=chat_body("hi"),
        headers={"Origin": ORIGIN, **server.headers()},
    )
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-credentials" not in r.headers


def test_cors_is_off_by_default(logging_server: Server) -> None:
    r = preflight(logging_server, ORIGIN)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    r = httpx.get(logging_server.url + "/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


# --- limits ------------------------------------------------------------------------


def test_too_many_headers_is_431(server: Server) -> None:
    many = [(f"x-h{i}", "v") for i in range(120)]
    r = httpx.get(server.url + "/v1/models", headers=many + list(server.headers().items()))
    assert_api_error(r, 431, code="request_header_fields_too_large")
    r = httpx.post(server.url + "/v1/messages", headers=many, json={})
    assert_api_error(r, 431, type="invalid_request_error")


def test_too_large_headers_is_431(server: Server) -> None:
    r = httpx.get(server.url + "/health", headers={"x-big": "a" * 40_000})
    assert_api_error(r, 431, code="request_header_fields_too_large")


def test_too_long_url_is_414(server: Server) -> None:
    r = httpx.get(server.url + "/v1/models/" + "m" * 9000, headers=server.headers())
    assert_api_error(r, 414, code="uri_too_long")


def test_deep_json_is_a_clear_400(server: Server) -> None:
    deep = '{"model": "tiny", "messages": [], "metadata": ' + "[" * 5000 + "]" * 5000 + "}"
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=deep,
        headers={"content-type": "application/json", **server.headers()},
    )
    assert_api_error(r, 400, code="invalid_json", message="recursion limit")
    r = httpx.post(
        server.url + "/v1/messages",
        content=deep,
        headers={"content-type": "application/json", **server.headers()},
    )
    assert_api_error(r, 400)


def test_stop_sequences_are_capped(server: Server) -> None:
    """Each is searched for after every token on the engine's shared thread."""
    stops = [f"s{i}" for i in range(65)]
    h = server.headers()
    r = httpx.post(server.url + "/v1/chat/completions", json=chat_body("x", stop=stops), headers=h)
    assert_api_error(r, 400, message="at most 64")
    assert r.json()["error"]["param"] == "stop"
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "stop": stops[:64], "max_tokens": 2},
        headers=h,
    )
    assert r.status_code == 200
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}
    r = httpx.post(server.url + "/v1/messages", json={**body, "stop_sequences": stops}, headers=h)
    assert_api_error(r, 400, message="at most 64")


# --- prompts and outputs in the log ------------------------------------------------------


def test_prompts_and_outputs_are_not_logged(server: Server) -> None:
    h = server.headers()
    with httpx.Client(base_url=server.url, headers=h, timeout=60) as c:
        assert c.post("/v1/chat/completions", json=chat_body(MARKER)).status_code == 200
        assert (
            c.post("/v1/chat/completions", json=chat_body(MARKER, stream=True)).status_code == 200
        )
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": MARKER, "max_tokens": 2})
        assert r.status_code == 200
        # A refused request: the marker in a bad field value and as an unknown field's name.
        assert_api_error(c.post("/v1/chat/completions", json=chat_body("x", stop=[1, MARKER])), 400)
        assert_api_error(c.post("/v1/chat/completions", json={**chat_body("x"), MARKER: 1}), 400)
    server.answered("/v1/completions")  # the request lines are written
    log = server.log()
    assert "endpoint=/v1/chat/completions status=200" in log  # logging at debug works
    assert MARKER not in log


def test_log_prompts_logs_them(logging_server: Server) -> None:
    with logging_server.http() as c:
        r = c.post("/v1/chat/completions", json=chat_body(MARKER, stream=True))
        assert r.status_code == 200
    logging_server.answered("/v1/chat/completions")
    lines = [ln for ln in logging_server.log().splitlines() if MARKER in ln]
    assert len(lines) == 1 and "request_body=" in lines[0] and "response_body=" in lines[0]
    assert "chat.completion.chunk" in lines[0]  # the streamed output is there too
