"""MCP tools run by pippin for the model, end to end: the real Qwen2.5-Coder-0.5B (which
calls tools), a real MCP server (tests/support/mcp_test_server.py) over stdio and streamable
HTTP, and the official SDKs as clients: chat completions (pippin's `mcp` tools), the
Responses API's `mcp` tool (with approvals across turns) and Anthropic's `mcp_servers`;
streamed and not. Timeouts, a crash mid-call, a denied tool, arguments that fail the
schema, the call limit and a config naming a missing command.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from support.mcp_test_server import SCRIPT, http_server
from support.server_utils import SRC_DIR, Server, at_once, free_port, run_server

SERVER = SCRIPT
QUESTION = "What is the door code of the Paris office? Look it up with the tool."
CODE = "PX-4417"
LOOKUP = {
    "type": "mcp",
    "server_label": "local",
    "allowed_tools": ["lookup_code"],
    "require_approval": "never",
}


@pytest.fixture(scope="module")
def mcp_http() -> Iterator[str]:
    with http_server(free_port()) as url:
        yield url


@pytest.fixture(scope="module")
def server(
    qwen_gguf: Path, mcp_http: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    cfg = tmp_path_factory.mktemp("mcp") / "mcp.json"
    cfg.write_text(
        json.dumps(
            {
                "mcpServers": {
                    "local": {
                        "command": sys.executable,
                        "args": [SERVER],
                        "env": {"GIVEN": "yes", "API_TOKEN": "tok-s3cret"},
                        "denied_tools": ["secret_tool"],
                    },
                    "remote": {
                        "type": "http",
                        "url": mcp_http,
                        "headers": {"Authorization": "Bearer hdr-s3cret"},
                        "allowed_tools": ["lookup_code", "add"],
                    },
                }
            }
        )
    )
    with run_server(
        str(qwen_gguf),
        "--max-model-len",
        "2048",
        "--mcp-config",
        str(cfg),
        "--mcp-max-calls",
        "1",
        "--mcp-call-timeout",
        "3",
        startup_timeout=900,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _outcome(request: Callable[[], Any]) -> Any:
    """The request's result, or the exception it raised (for its own test to raise)."""
    try:
        return request()
    except Exception as e:  # noqa: BLE001
        return e


@pytest.fixture(scope="module")
def answers(server: Server, mcp_http: str) -> dict[str, Any]:
    """The answers the tests below check, asked all at once: the server batches them, and
    on a CPU a batch's decode step costs about one request's. Each test checks its own."""
    asks = {
        "chat": lambda: _ask_chat(server.client()),
        "chat_streamed": lambda: _ask_chat_streamed(server.client()),
        "client_function": lambda: _ask_client_function(server.client()),
        "responses": lambda: _ask_responses(server.client()),
        "responses_streamed": lambda: _ask_responses_streamed(server.client(), mcp_http),
        "approval_first": lambda: _ask_approval_first(server.client()),
        "anthropic": lambda: _ask_anthropic(server, mcp_http),
        "anthropic_streamed": lambda: _ask_anthropic_streamed(server),
    }
    results = at_once(*[lambda ask=ask: _outcome(ask) for ask in asks.values()])
    return dict(zip(asks, results, strict=True))


def _answer(answers: dict[str, Any], name: str) -> Any:
    got = answers[name]
    if isinstance(got, Exception):
        raise got
    return got


def _ask_chat(client: openai.OpenAI) -> Any:
    return client.chat.completions.create(
        model=_model(client),
        messages=[{"role": "user", "content": QUESTION}],
        tools=[LOOKUP],  # type: ignore[list-item]
        temperature=0,
        max_tokens=80,
    )


def test_chat_answer_needs_the_tool(answers: dict[str, Any]) -> None:
    r = _answer(answers, "chat")
    msg = r.choices[0].message
    calls = msg.model_extra["mcp_calls"]
    assert calls[0]["name"] == "lookup_code" and calls[0]["server_label"] == "local"
    assert calls[0]["output"] == CODE
    assert CODE in (msg.content or "")
    assert not msg.tool_calls and r.choices[0].finish_reason == "stop"


def _ask_chat_streamed(client: openai.OpenAI) -> list[Any]:
    stream = client.chat.completions.create(
        model=_model(client),
        messages=[{"role": "user", "content": QUESTION}],
        tools=[LOOKUP],  # type: ignore[list-item]
        temperature=0,
        max_tokens=80,
        stream=True,
    )
    return list(stream)


def test_chat_streamed(answers: dict[str, Any]) -> None:
    content, mcp_calls, finish, tool_deltas = "", [], None, 0
    for chunk in _answer(answers, "chat_streamed"):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            mcp_calls += (ch.delta.model_extra or {}).get("mcp_calls") or []
            tool_deltas += len(ch.delta.tool_calls or [])
            finish = ch.finish_reason or finish
    assert [c["output"] for c in mcp_calls] == [CODE]
    assert CODE in content and "<tool_call>" not in content
    assert tool_deltas == 0 and finish == "stop"  # pippin's calls are not the client's


def _ask_client_function(client: openai.OpenAI) -> Any:
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    return client.chat.completions.create(
        model=_model(client),
        messages=[{"role": "user", "content": "What is the weather like in Paris right now?"}],
        tools=[weather, LOOKUP],  # type: ignore[list-item]
        temperature=0,
        max_tokens=60,
    )


def test_client_function_beside_mcp(answers: dict[str, Any]) -> None:
    choice = _answer(answers, "client_function").choices[0]
    # The client's own tool is the client's to run: the loop ends with its call.
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls or []] == ["get_weather"]


def _ask_responses(client: openai.OpenAI) -> Any:
    return client.responses.create(
        model=_model(client),
        input=QUESTION,
        tools=[LOOKUP],  # type: ignore[list-item]
        temperature=0,
        max_output_tokens=80,
    )


def test_responses_mcp_tool(answers: dict[str, Any]) -> None:
    r = _answer(answers, "responses")
    kinds = [item.type for item in r.output]
    assert kinds[:2] == ["mcp_list_tools", "mcp_call"] and kinds[-1] == "message", kinds
    listed, call = r.output[0], r.output[1]
    assert listed.server_label == "local" and [t.name for t in listed.tools] == ["lookup_code"]
    assert call.name == "lookup_code" and call.output == CODE and call.error is None
    assert json.loads(call.arguments)["city"].lower() == "paris"
    assert CODE in r.output_text
    assert r.usage is not None and r.usage.output_tokens > 0


def _ask_responses_streamed(client: openai.OpenAI, mcp_http: str) -> list[Any]:
    tool = {
        "type": "mcp",
        "server_label": "web",
        "server_url": mcp_http,
        "allowed_tools": ["lookup_code"],
        "require_approval": "never",
    }
    return list(
        client.responses.create(
            model=_model(client),
            input=QUESTION,
            tools=[tool],  # type: ignore[list-item]
            temperature=0,
            max_output_tokens=80,
            stream=True,
        )
    )


def test_responses_streamed_over_http_server(answers: dict[str, Any]) -> None:
    events = _answer(answers, "responses_streamed")
    types = [e.type for e in events]
    for t in (
        "response.mcp_list_tools.in_progress",
        "response.mcp_list_tools.completed",
        "response.mcp_call_arguments.delta",
        "response.mcp_call_arguments.done",
        "response.mcp_call.in_progress",
        "response.mcp_call.completed",
        "response.output_text.delta",
    ):
        assert t in types, t
    assert types.index("response.mcp_call.completed") < types.index("response.output_text.delta")
    final = events[-1].response
    assert final.status == "completed"
    call = next(i for i in final.output if i.type == "mcp_call")
    assert call.server_label == "web" and call.output == CODE
    assert CODE in final.output_text


def _approval_tool() -> dict[str, Any]:
    tool = {**LOOKUP}
    del tool["require_approval"]  # OpenAI's default: every call is approved first
    return tool


def _ask_approval_first(client: openai.OpenAI) -> Any:
    return client.responses.create(
        model=_model(client),
        input=QUESTION,
        tools=[_approval_tool()],  # type: ignore[list-item]
        temperature=0,
        max_output_tokens=60,
    )


def test_responses_approval_across_turns(client: openai.OpenAI, answers: dict[str, Any]) -> None:
    tool = _approval_tool()
    first = _answer(answers, "approval_first")
    asks = [i for i in first.output if i.type == "mcp_approval_request"]
    assert len(asks) == 1 and asks[0].name == "lookup_code"
    assert not [i for i in first.output if i.type == "mcp_call"]  # nothing ran yet
    second = client.responses.create(
        model=_model(client),
        previous_response_id=first.id,
        input=[
            {"type": "mcp_approval_response", "approval_request_id": asks[0].id, "approve": True}
        ],
        tools=[tool],
        temperature=0,
        max_output_tokens=60,
    )
    kinds = [i.type for i in second.output]
    assert "mcp_list_tools" not in kinds  # listed once in the conversation
    call = next(i for i in second.output if i.type == "mcp_call")
    assert call.approval_request_id == asks[0].id and call.output == CODE
    assert CODE in second.output_text


def _approved(name: str, arguments: dict[str, Any], rid: str = "mcpr_1") -> list[dict[str, Any]]:
    return [
        {
            "type": "mcp_approval_request",
            "id": rid,
            "server_label": "local",
            "name": name,
            "arguments": json.dumps(arguments),
        },
        {"type": "mcp_approval_response", "approval_request_id": rid, "approve": True},
    ]


def _failed_call(server: Server, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    tool = {"type": "mcp", "server_label": "local", "require_approval": "never"}
    r = server.http().post(
        "/v1/responses",
        json={
            "model": _model(server.client()),
            "input": [{"role": "user", "content": "Hi"}, *items],
            "tools": [tool],
            "max_output_tokens": 4,
        },
    )
    assert r.status_code == 200, r.text
    return [i for i in r.json()["output"] if i["type"] == "mcp_call"]


@pytest.mark.parametrize(
    ("name", "arguments", "error_type", "says"),
    [
        ("slow", {"seconds": 30}, "mcp_protocol_error", "within 3 s"),
        ("fail", {"reason": "on purpose"}, "mcp_tool_execution_error", "Error"),
        ("secret_tool", {}, "mcp_protocol_error", "not an MCP tool"),
        ("add", {"a": "two", "b": 1}, "mcp_protocol_error", "Invalid arguments"),
    ],
)
def test_failed_calls_end_with_error_results(
    server: Server, name: str, arguments: dict[str, Any], error_type: str, says: str
) -> None:
    t0 = time.monotonic()
    (call,) = _failed_call(server, _approved(name, arguments))
    assert call["status"] == "failed" and call["output"] is None
    err = call["error"]
    assert err["type"] == error_type
    assert says in (err.get("message") or json.dumps(err.get("content")))
    assert time.monotonic() - t0 < 120


def test_crash_mid_call_then_the_server_is_back(server: Server) -> None:
    (call,) = _failed_call(server, _approved("crash", {}))
    assert call["status"] == "failed" and "failed" in call["error"]["message"]
    deadline = time.monotonic() + 60
    while True:
        local = next(
            s for s in server.http().get("/v1/mcp/servers").json()["data"] if s["name"] == "local"
        )
        if local["state"] == "ready" and local["restarts"] >= 1:
            break
        assert time.monotonic() < deadline, local
        time.sleep(0.5)
    (call,) = _failed_call(server, _approved("add", {"a": 2, "b": 3}))
    assert call["status"] == "completed" and call["output"] == "5"


def test_max_calls_reached(server: Server) -> None:
    # --mcp-max-calls 1: the second approved call is not run.
    items = [*_approved("add", {"a": 1, "b": 1}, "r1"), *_approved("add", {"a": 2, "b": 2}, "r2")]
    first, second = _failed_call(server, items)
    assert first["output"] == "2"
    assert (
        second["status"] == "failed" and "limit of 1 MCP tool calls" in second["error"]["message"]
    )


def _ask_anthropic(server: Server, mcp_http: str) -> Any:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    return client.beta.messages.create(
        model="claude-test",
        max_tokens=80,
        extra_body={"temperature": 0},  # not in the SDK's signature
        messages=[{"role": "user", "content": QUESTION}],
        mcp_servers=[
            {
                "type": "url",
                "url": mcp_http,
                "name": "remote",
                "tool_configuration": {"allowed_tools": ["lookup_code"]},
            }
        ],
        betas=["mcp-client-2025-04-04"],
    )


def test_anthropic_mcp_servers(answers: dict[str, Any]) -> None:
    msg = _answer(answers, "anthropic")
    kinds = [b.type for b in msg.content]
    assert kinds[:2] == ["mcp_tool_use", "mcp_tool_result"] and kinds[-1] == "text", kinds
    use, result = msg.content[0], msg.content[1]
    assert use.name == "lookup_code" and use.server_name == "remote"
    assert use.input["city"].lower() == "paris"
    assert result.tool_use_id == use.id and not result.is_error
    assert result.content[0].text == CODE
    assert CODE in msg.content[-1].text and msg.stop_reason == "end_turn"


def _ask_anthropic_streamed(server: Server) -> tuple[list[Any], Any]:
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with client.beta.messages.stream(
        model="claude-test",
        max_tokens=80,
        extra_body={"temperature": 0},  # not in the SDK's signature
        messages=[{"role": "user", "content": QUESTION}],
        # A stdio server has no URL: its configured name names it.
        mcp_servers=[
            {
                "type": "url",
                "url": "http://unused.invalid/",
                "name": "local",
                "tool_configuration": {"allowed_tools": ["lookup_code"]},
            }
        ],
        betas=["mcp-client-2025-04-04"],
    ) as stream:
        return list(stream), stream.get_final_message()


def test_anthropic_mcp_servers_streamed(answers: dict[str, Any]) -> None:
    events, msg = _answer(answers, "anthropic_streamed")
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts[:2] == ["mcp_tool_use", "mcp_tool_result"], starts
    assert any(e.type == "input_json" for e in events)  # the call's input streamed
    assert msg.content[1].content[0].text == CODE
    assert CODE in msg.content[-1].text


def test_routes_show_no_secrets(server: Server) -> None:
    http = server.http()
    servers = {s["name"]: s for s in http.get("/v1/mcp/servers").json()["data"]}
    assert set(servers) == {"local", "remote"}
    assert servers["remote"]["transport"] == "streamable_http"
    assert set(servers["remote"]["tools"]) == {"lookup_code", "add"}
    tools = http.get("/v1/mcp/tools").json()["data"]
    names = {(t["server"], t["name"]) for t in tools}
    assert ("local", "lookup_code") in names and ("local", "secret_tool") not in names
    add = next(t for t in tools if t["name"] == "add")
    assert add["input_schema"]["required"] == ["a", "b"]
    shown = http.get("/v1/mcp/servers").text + http.get("/v1/mcp/tools").text
    for secret in ("tok-s3cret", "hdr-s3cret", "API_TOKEN", "Bearer"):
        assert secret not in shown and secret not in server.log()


def test_bad_mcp_requests(server: Server, mcp_http: str) -> None:
    http = server.http()
    model = _model(server.client())

    def post(path: str, body: dict[str, Any]) -> httpx.Response:
        return http.post(path, json={"model": model, **body})

    r = post("/v1/responses", {"input": "hi", "tools": [{"type": "mcp", "server_label": "nope"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].server_label"
    r = post(
        "/v1/responses",
        {
            "input": "hi",
            "tools": [
                {"type": "mcp", "server_label": "x", "server_url": "http://169.254.169.254/mcp"}
            ],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].server_url"
    r = post(
        "/v1/responses",
        {
            "input": "hi",
            "tools": [{"type": "mcp", "server_label": "local", "connector_id": "connector_gmail"}],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].connector_id"
    r = post(
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "mcp", "server_label": "local", "require_approval": "always"}],
        },
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].require_approval"
    r = post(
        "/v1/messages",
        {
            "max_tokens": 5,
            "messages": [{"role": "user", "content": "hi"}],
            "mcp_servers": [{"type": "url", "url": "http://10.0.0.1/", "name": "x"}],
        },
    )
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert "configured" in r.json()["error"]["message"]


def test_config_naming_a_missing_command(tmp_path: Path) -> None:
    cfg = tmp_path / "mcp.json"
    cfg.write_text(json.dumps({"mcpServers": {"tools": {"command": "no-such-mcp-server"}}}))
    env = {"PYTHONPATH": str(SRC_DIR), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "pippin.cli", "serve", "--mcp-config", str(cfg), "--port", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 3
    assert "mcpServers.tools.command: 'no-such-mcp-server' was not found" in proc.stderr
