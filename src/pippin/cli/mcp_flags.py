"""`pippin serve`'s MCP flags and the `McpSettings` they give."""

from __future__ import annotations

import argparse
import importlib.util
import sys

from pippin.argtypes import positive_float, positive_int
from pippin.mcp.config import McpConfigError, McpSettings, load_config


def add_mcp_flags(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group(
        "MCP tools",
        "tools of Model Context Protocol servers, run by pippin for the model (see "
        "docs/api-compatibility.md: Responses 'mcp' tools, Anthropic mcp_servers, chat "
        "'mcp' tools)",
    )
    t.add_argument(
        "--mcp-config",
        metavar="FILE",
        help="the MCP servers pippin starts (stdio) or connects to (streamable HTTP, SSE): "
        "Claude Desktop's {\"mcpServers\": {...}} JSON (vllm-mlx's keys too). No MCP "
        "server runs without it. Needs the 'mcp' extra",
    )
    t.add_argument(
        "--mcp-max-calls",
        type=positive_int,
        default=McpSettings.max_calls,
        metavar="N",
        help="MCP tool calls pippin makes for one request; then the model answers without "
        "the MCP tools (default: %(default)s)",
    )
    t.add_argument(
        "--mcp-call-timeout",
        type=positive_float,
        default=McpSettings.call_timeout,
        metavar="SECONDS",
        help="how long one MCP tool call may take before it ends with a timeout result "
        "(a server's own 'timeout' key overrides it; default: %(default)s)",
    )
    t.add_argument(
        "--mcp-auto",
        action="store_true",
        help="chat completions requests that name no 'mcp' tool get the tools of every "
        "configured server (for clients that know nothing of MCP)",
    )


def mcp_settings(args: argparse.Namespace) -> McpSettings:
    """The `--mcp-*` flags; a config pippin cannot run is one line and exit code 3."""
    if args.mcp_config is None:
        if args.mcp_auto:
            raise SystemExit("pippin serve: --mcp-auto needs --mcp-config")
        return McpSettings()
    if importlib.util.find_spec("mcp") is None:
        raise SystemExit("pippin serve: --mcp-config needs the MCP SDK: pip install 'pippin[mcp]'")
    try:
        servers = load_config(args.mcp_config)
    except McpConfigError as e:
        print(f"pippin serve: --mcp-config {args.mcp_config}: {e}", file=sys.stderr)
        raise SystemExit(3) from None
    return McpSettings(
        servers=tuple(servers),
        call_timeout=args.mcp_call_timeout,
        max_calls=args.mcp_max_calls,
        auto=args.mcp_auto,
    )
