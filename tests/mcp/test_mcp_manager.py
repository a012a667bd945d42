"""The MCP manager against a real MCP server (tests/support/mcp_test_server.py) over stdio and
streamable HTTP: listing, calls, allow/deny lists, the environment a stdio server gets,
schema checks, timeouts, a crash mid-call and the restart after it."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.mcp_test_server import SCRIPT, http_server
from support.server_utils import free_port

from pippin.mcp.config import McpConfigError, load_config, parse_server
from pippin.mcp.manager import McpManager

SERVER = SCRIPT


def stdio_spec(**extra: object) -> dict[str, object]:
    return {"command": sys.executable, "args": [SERVER], **extra}


@pytest.fixture(scope="module")
def http_url() -> Iterator[str]:
    with http_server(free_port()) as url:
        yield url


def run(configs: dict[str, dict[str, object]], body, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    servers = [parse_server(name, spec) for name, spec in configs.items()]

    async def main() -> None:
        manager = McpManager([s for s in servers if s is not None], call_timeout=timeout)
        await manager.start()
        try:
            await body(manager)
        finally:
            await manager.stop()

    asyncio.run(main())


def test_stdio_tools_calls_and_safety(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPPIN_TEST_LEAK", "from-pippin")
    spec = stdio_spec(env={"GIVEN": "yes", "TOKEN": "s3cret"}, denied_tools=["secret_tool"])

    async def body(m: McpManager) -> None:
        conn = m.get("local")
        assert conn is not None and conn.state == "ready"
        assert set(conn.tools) == {"lookup_code", "add", "slow", "fail", "crash", "show_env"}
        assert conn.tools["add"].input_schema["required"] == ["a", "b"]
        ok = await conn.call("add", '{"a": 2, "b": 40}')
        assert (ok.output, ok.error) == ("42", None)
        # Only the config's env (and the SDK's minimal PATH/HOME/...) reaches the server.
        assert (await conn.call("show_env", {"name": "GIVEN"})).output == "yes"
        assert (await conn.call("show_env", {"name": "PIPPIN_TEST_LEAK"})).output == "<unset>"
        assert (await conn.call("show_env", {"name": "PATH"})).output != "<unset>"
        denied = await conn.call("secret_tool", "{}")
        assert denied.error == "not_allowed"
        bad = await conn.call("add", '{"a": "two", "b": 1}')
        assert bad.error == "invalid_arguments" and "a" in bad.output
        missing = await conn.call("add", '{"a": 1}')
        assert (
            missing.error == "invalid_arguments" and "'b' is a required property" in missing.output
        )
        assert (await conn.call("add", "not json")).error == "invalid_arguments"
        failed = await conn.call("fail", {"reason": "testing"})
        assert failed.error == "tool_error"
        # No secret in what /v1/mcp/servers shows.
        shown = json.dumps(conn.public())
        assert "s3cret" not in shown and "GIVEN" not in shown and "TOKEN" not in shown

    run({"local": spec}, body)


def test_timeout_then_crash_mid_call_then_restart() -> None:
    async def body(m: McpManager) -> None:
        conn = m.get("local")
        assert conn is not None and conn.state == "ready"
        t0 = time.monotonic()
        hung = await conn.call("slow", {"seconds": 30})
        assert hung.error == "timeout" and "1 s" in hung.output
        assert time.monotonic() - t0 < 10
        assert (await conn.call("add", {"a": 1, "b": 1})).output == "2"  # still serving
        crashed = await conn.call("crash", {})
        assert crashed.error == "server_error"
        deadline = time.monotonic() + 30
        while conn.restarts < 1 or conn.state != "ready":
            assert time.monotonic() < deadline, conn.public()
            await asyncio.sleep(0.1)
        assert (await conn.call("add", {"a": 2, "b": 2})).output == "4"  # a new process

    run({"local": stdio_spec()}, body, timeout=1.0)


def test_streamable_http(http_url: str) -> None:
    spec = {
        "type": "http",
        "url": http_url,
        "headers": {"Authorization": "Bearer hidden"},
        "allowed_tools": ["lookup_code", "slow"],
    }

    async def body(m: McpManager) -> None:
        conn = m.get("remote")
        assert conn is not None and conn.state == "ready", conn.public()
        assert set(conn.tools) == {"lookup_code", "slow"}
        assert (await conn.call("lookup_code", {"city": "Paris"})).output == "PX-4417"
        assert (await conn.call("add", {"a": 1, "b": 2})).error == "not_allowed"
        assert (await conn.call("slow", {"seconds": 20})).error == "timeout"
        assert m.by_url(http_url + "/") is conn
        assert "hidden" not in json.dumps(conn.public())

    run({"remote": spec}, body, timeout=1.0)


def test_sse() -> None:
    with http_server(free_port(), "sse") as url:
        spec = {"type": "sse", "url": url, "headers": {"X-Key": "k"}}

        async def body(m: McpManager) -> None:
            conn = m.get("old")
            assert conn is not None and conn.state == "ready", conn.public()
            assert (await conn.call("lookup_code", {"city": "Tokyo"})).output == "TK-9031"

        run({"old": spec}, body)


def test_config_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "mcp.json"
    cfg.write_text(json.dumps({"mcpServers": {"x": {"command": "no-such-mcp-server-cmd"}}}))
    with pytest.raises(McpConfigError, match="'no-such-mcp-server-cmd' was not found"):
        load_config(cfg)
    cfg.write_text(json.dumps({"mcpServers": {"x": {"command": sys.executable, "bogus": 1}}}))
    with pytest.raises(McpConfigError, match="mcpServers.x.bogus"):
        load_config(cfg)
    # vllm-mlx's keys: "servers", "transport", "enabled".
    cfg.write_text(
        json.dumps(
            {
                "servers": {
                    "a": {"command": sys.executable, "args": [SERVER], "transport": "stdio"},
                    "b": {"url": "http://127.0.0.1:1/sse", "transport": "sse"},
                    "c": {"command": "no-such-cmd", "enabled": False},
                }
            }
        )
    )
    got = {c.name: c.transport for c in load_config(cfg)}
    assert got == {"a": "stdio", "b": "sse"}
    assert os.environ.get("PIPPIN_TEST_LEAK") is None
