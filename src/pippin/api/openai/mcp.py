"""OpenAI's `mcp` tools (Responses; chat completions as pippin's extension): which tools of
the configured MCP servers a request offers, and its finished calls as OpenAI reports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pippin.serving.tool_loop import McpCall, McpTools, find_server, mcp_error

if TYPE_CHECKING:
    from pippin.mcp.manager import CallResult, ToolInfo
    from pippin.serving.state import ServerState


def _matches(f: Any, info: ToolInfo) -> bool:
    if f.tool_names is not None and info.name not in f.tool_names:
        return False
    return f.read_only is None or info.read_only == f.read_only


def openai_mcp_tools(
    state: ServerState, specs: list[tuple[Any, str]], *, approvals: bool
) -> McpTools:
    """The tools of a request's `mcp` tools (`McpTool`s with their param paths).
    `approvals`: whether the API has the approval flow (Responses); without it, only
    `require_approval: "never"` is accepted."""
    out = McpTools()
    for t, p in specs:
        for name in ("connector_id", "tunnel_id"):
            if getattr(t, name) is not None:
                raise mcp_error(
                    f"{p}.{name}: OpenAI's connectors and tunnels are not available; name a "
                    "server of this server's --mcp-config by server_label or server_url.",
                    f"{p}.{name}",
                )
        if t.defer_loading:
            raise mcp_error(
                "There is no tool search: MCP tools are always loaded.", f"{p}.defer_loading"
            )
        if t.allowed_callers and "programmatic" in t.allowed_callers:
            raise mcp_error("Only 'direct' calls exist here.", f"{p}.allowed_callers")
        for name in ("headers", "authorization"):
            if getattr(t, name):
                raise mcp_error(
                    f"{p}.{name}: per-request credentials are not sent; the server's own "
                    "(--mcp-config 'headers') are used.",
                    f"{p}.{name}",
                )
        conn = find_server(state, t.server_label, t.server_url, p)
        allowed = t.allowed_tools

        def keep(info: ToolInfo, allowed: Any = allowed) -> bool:
            if allowed is None:
                return True
            if isinstance(allowed, list):
                return info.name in allowed
            return _matches(allowed, info)

        rule = t.require_approval
        if not approvals and rule not in (None, "never"):
            raise mcp_error(
                "Chat completions have no approval flow: require_approval must be 'never' "
                "(use the Responses API for approvals).",
                f"{p}.require_approval",
            )

        def approval(info: ToolInfo, rule: Any = rule) -> bool:
            if not approvals or rule == "never":
                return False
            if rule is None or rule == "always":
                return True  # OpenAI's default: every call is approved first
            if rule.never is not None and _matches(rule.never, info):
                return False
            return rule.always is None or _matches(rule.always, info)

        out.add_server(t.server_label, conn, keep, approval, p)
    return out


def call_summary(call: McpCall) -> dict[str, Any]:
    """A finished call as chat completions report it (`message.mcp_calls`, pippin's)."""
    assert call.result is not None
    return {
        "id": call.id,
        "type": "mcp_call",
        "server_label": call.label,
        "name": call.name,
        "arguments": call.arguments,
        "output": None if call.result.is_error else call.result.output,
        "error": call.result.output if call.result.is_error else None,
    }


def error_body(result: CallResult) -> dict[str, Any] | None:
    """A failed call's error as Responses' `mcp_call.error` (a tool's own failure is an
    execution error; anything else a protocol error)."""
    if result.error is None:
        return None
    if result.error == "tool_error":
        return {
            "type": "mcp_tool_execution_error",
            "content": [{"type": "text", "text": result.output}],
        }
    codes = {"timeout": -32001, "invalid_arguments": -32602, "not_allowed": -32601}
    return {
        "type": "mcp_protocol_error",
        "code": codes.get(result.error, -32603),
        "message": result.output,
    }
