"""GET /v1/mcp/servers and /v1/mcp/tools: the configured MCP servers (state, tools) and
the tools the model may be offered. Nothing secret: no env, headers, args or URL query."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from pippin.api.common import get_state

router = APIRouter()


@router.get("/v1/mcp/servers")
async def list_servers(request: Request) -> dict[str, Any]:
    manager = get_state(request).mcp
    servers = [] if manager is None else [c.public() for c in manager.servers.values()]
    return {"object": "list", "data": servers}


@router.get("/v1/mcp/tools")
async def list_tools(request: Request) -> dict[str, Any]:
    manager = get_state(request).mcp
    tools = []
    for conn in [] if manager is None else manager.servers.values():
        for t in conn.tools.values():
            tools.append(
                {
                    "server": conn.name,
                    "server_state": conn.state,
                    "name": t.name,
                    "description": t.description,
                    "input_schema": t.input_schema,
                    "annotations": t.annotations,
                }
            )
    return {"object": "list", "data": tools}
