"""Which MCP tools a request offers: chat's `mcp` tools and `--mcp-auto`, Responses'
`allowed_tools` / `require_approval` filters, Anthropic's `mcp_servers` and `mcp_toolset`,
against a real manager and MCP server (no model needed)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from support.mcp_test_server import SCRIPT

from pippin.api.anthropic.messages_input import mcp_tools as anthropic_tools
from pippin.api.anthropic.protocol import MessagesRequest
from pippin.api.openai.chat import mcp_tools as chat_tools
from pippin.api.openai.protocol import ChatCompletionRequest
from pippin.api.openai.responses_input import mcp_tools as responses_tools
from pippin.api.openai.responses_protocol import ResponsesRequest
from pippin.mcp.config import McpSettings, parse_server
from pippin.mcp.manager import McpManager
from pippin.serving.errors import ApiError
from pippin.serving.state import ServerSettings, ServerState

USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def state() -> Iterator[ServerState]:
    config = parse_server(
        "local", {"command": sys.executable, "args": [SCRIPT], "denied_tools": ["secret_tool"]}
    )
    assert config is not None
    settings = ServerSettings(mcp=McpSettings(servers=(config,), auto=True))
    st = ServerState(settings)
    loop = asyncio.new_event_loop()
    st.mcp = McpManager([config])
    loop.run_until_complete(st.mcp.start())
    try:
        yield st
    finally:
        loop.run_until_complete(st.mcp.stop())
        loop.close()


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **kw})


def test_chat_auto_and_explicit(state: ServerState) -> None:
    auto = chat_tools(chat(), state)
    assert auto is not None and "lookup_code" in auto.by_name and "secret_tool" not in auto.by_name
    assert not any(t.approval for t in auto.by_name.values())
    one = chat_tools(
        chat(tools=[{"type": "mcp", "server_label": "local", "allowed_tools": ["add"]}]), state
    )
    assert one is not None and list(one.by_name) == ["add"]
    assert (
        chat_tools(
            chat(tool_choice="none", tools=[{"type": "mcp", "server_label": "local"}]), state
        )
        is None
    )
    with pytest.raises(ApiError) as err:
        chat_tools(chat(n=2), state)
    assert err.value.param == "n"


def test_responses_filters(state: ServerState) -> None:
    def req(**tool: Any) -> ResponsesRequest:
        return ResponsesRequest.model_validate(
            {
                "model": "m",
                "input": "hi",
                "tools": [{"type": "mcp", "server_label": "local", **tool}],
            }
        )

    tools = responses_tools(
        req(),
        state,
    )
    assert tools is not None and all(t.approval for t in tools.by_name.values())  # "always"
    tools = responses_tools(
        req(
            allowed_tools={"tool_names": ["add", "slow"]},
            require_approval={"never": {"tool_names": ["add"]}},
        ),
        state,
    )
    assert tools is not None and set(tools.by_name) == {"add", "slow"}
    assert not tools.needs_approval("add") and tools.needs_approval("slow")
    with pytest.raises(ApiError) as err:
        responses_tools(req(headers={"X-Key": "k"}), state)
    assert err.value.param == "tools[0].headers"


def test_anthropic_servers_and_toolsets(state: ServerState) -> None:
    def req(**kw: Any) -> MessagesRequest:
        server = {"type": "url", "url": "http://x.invalid/", "name": "local"}
        return MessagesRequest.model_validate(
            {"model": "claude", "max_tokens": 5, "messages": USER, "mcp_servers": [server], **kw}
        )

    tools = anthropic_tools(state, req())
    assert tools is not None and "lookup_code" in tools.by_name
    toolset = {
        "type": "mcp_toolset",
        "mcp_server_name": "local",
        "default_config": {"enabled": False},
        "configs": {"add": {"enabled": True}},
    }
    tools = anthropic_tools(state, req(tools=[toolset]))
    assert tools is not None and list(tools.by_name) == ["add"]
    with pytest.raises(ApiError) as err:
        anthropic_tools(state, req(tools=[{**toolset, "mcp_server_name": "other"}]))
    assert err.value.param == "tools[0].mcp_server_name"
