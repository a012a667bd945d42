"""Anthropic's `mcp_servers` (the mcp-client beta): which tools of the configured MCP
servers a request offers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pippin.serving.tool_loop import McpTools, find_server, mcp_error

if TYPE_CHECKING:
    from pippin.mcp.manager import ToolInfo
    from pippin.serving.state import ServerState


def anthropic_mcp_tools(
    state: ServerState, servers: list[Any], toolsets: list[tuple[Any, str]]
) -> McpTools:
    """The tools of `mcp_servers` (with `tool_configuration`, the 2025-04-04 beta), chosen
    by `mcp_toolset` tools when the request has any (the 2025-11-20 beta)."""
    out = McpTools()
    sets: dict[str, tuple[Any, str]] = {}
    for ts, p in toolsets:
        sets[str(getattr(ts, "mcp_server_name", ""))] = (ts, p)
    for j, srv in enumerate(servers):
        p = f"mcp_servers[{j}]"
        if srv.authorization_token:
            raise mcp_error(
                "authorization_token: per-request credentials are not sent; the server's "
                "own (--mcp-config 'headers') are used.",
                f"{p}.authorization_token",
            )
        conn = find_server(state, srv.name, srv.url, p, ("name", "url"), "mcp_servers")
        cfg = srv.tool_configuration
        toolset = sets.pop(srv.name, None)
        if (cfg is not None and cfg.enabled is False) or (toolsets and toolset is None):
            continue
        allowed = cfg.allowed_tools if cfg is not None else None
        default_on, configs = True, {}
        if toolset is not None:
            default = getattr(toolset[0], "default_config", None) or {}
            configs = getattr(toolset[0], "configs", None) or {}
            if not isinstance(default, dict) or not isinstance(configs, dict):
                raise mcp_error(
                    "default_config and configs must be objects.", f"{toolset[1]}.configs"
                )
            default_on = default.get("enabled", True) is not False

        def keep(
            info: ToolInfo,
            allowed: Any = allowed,
            on: bool = default_on,
            configs: dict[str, Any] = configs,
        ) -> bool:
            if allowed is not None and info.name not in allowed:
                return False
            one = configs.get(info.name)
            return (one if isinstance(one, dict) else {}).get("enabled", on) is not False

        out.add_server(srv.name, conn, keep, lambda _: False, p)
    for name, (_, p) in sets.items():
        raise mcp_error(f"No server named '{name}' in mcp_servers.", f"{p}.mcp_server_name")
    return out
