"""`--mcp-config`: the MCP servers pippin may start or connect to.

The file is Claude Desktop's `{"mcpServers": {name: {...}}}` (vllm-mlx's `"servers"` key
and its `"transport"` / `"enabled"` keys are accepted too). A server is a process over
stdio (`command`, `args`, `env`, `cwd`) or a remote one (`url`, `headers`; streamable
HTTP unless `type`/`transport` says "sse"). pippin's own keys: `allowed_tools` and
`denied_tools` (which of the server's tools the model may see and call) and `timeout`
(seconds a call may take, over `--mcp-call-timeout`).

Secrets live in `env` and `headers`: `public()` leaves them out, and nothing logs them.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

Transport = Literal["stdio", "streamable_http", "sse"]

_TRANSPORTS: dict[str, Transport] = {
    "stdio": "stdio",
    "http": "streamable_http",
    "streamable-http": "streamable_http",
    "streamable_http": "streamable_http",
    "streamablehttp": "streamable_http",
    "sse": "sse",
}
_KEYS = {
    "command",
    "args",
    "env",
    "cwd",
    "url",
    "headers",
    "type",
    "transport",
    "enabled",
    "timeout",
    "allowed_tools",
    "allowedTools",
    "denied_tools",
    "deniedTools",
    "disabled_tools",
    "disabledTools",
    "description",
    # vllm-mlx's command whitelist switch: pippin has no whitelist (the config is trusted).
    "skip_security_validation",
}


class McpConfigError(ValueError):
    """A config pippin cannot run; the message names the server and the key."""


@dataclass(frozen=True)
class ServerConfig:
    name: str
    transport: Transport
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    allowed_tools: frozenset[str] | None = None  # None: all
    denied_tools: frozenset[str] = frozenset()
    timeout: float | None = None
    description: str | None = None

    def allows(self, tool: str) -> bool:
        if tool in self.denied_tools:
            return False
        return self.allowed_tools is None or tool in self.allowed_tools

    def public(self) -> dict[str, Any]:
        """What `/v1/mcp/servers` shows: no `env`, `headers` or `args` (any may hold a
        key), a URL without its user info or query."""
        out: dict[str, Any] = {"name": self.name, "transport": self.transport}
        if self.command is not None:
            out["command"] = Path(self.command).name
        if self.url is not None:
            out["url"] = public_url(self.url)
        if self.allowed_tools is not None:
            out["allowed_tools"] = sorted(self.allowed_tools)
        if self.denied_tools:
            out["denied_tools"] = sorted(self.denied_tools)
        if self.description:
            out["description"] = self.description
        return out


def public_url(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _str_map(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise McpConfigError(f"{where} must be an object of strings.")
    return dict(value)


def _names(value: Any, where: str) -> frozenset[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise McpConfigError(f"{where} must be a list of tool names.")
    return frozenset(value)


def parse_server(name: str, spec: Any) -> ServerConfig | None:
    """One server's entry; None when it is switched off (`"enabled": false`)."""
    where = f"mcpServers.{name}"
    if not isinstance(spec, dict):
        raise McpConfigError(f"{where} must be an object.")
    unknown = sorted(set(spec) - _KEYS)
    if unknown:
        raise McpConfigError(f"{where}.{unknown[0]}: unknown key.")
    if spec.get("enabled", True) is False:
        return None
    kind = spec.get("type") or spec.get("transport")
    if kind is None:
        kind = "stdio" if "command" in spec else "streamable_http"
    transport = _TRANSPORTS.get(str(kind).lower())
    if transport is None:
        raise McpConfigError(
            f"{where}.type: {kind!r} is not a transport; use stdio, http (streamable) or sse."
        )
    timeout = spec.get("timeout")
    if timeout is not None and (not isinstance(timeout, int | float) or timeout <= 0):
        raise McpConfigError(f"{where}.timeout must be a positive number of seconds.")
    allowed = _names(spec.get("allowed_tools", spec.get("allowedTools")), f"{where}.allowed_tools")
    denied_raw = next(
        (
            spec[k]
            for k in ("denied_tools", "deniedTools", "disabled_tools", "disabledTools")
            if k in spec
        ),
        None,
    )
    denied = _names(denied_raw, f"{where}.denied_tools") or frozenset()
    common: dict[str, Any] = {
        "name": name,
        "transport": transport,
        "allowed_tools": allowed,
        "denied_tools": denied,
        "timeout": float(timeout) if timeout is not None else None,
        "description": spec.get("description"),
    }
    if transport == "stdio":
        command = spec.get("command")
        if not isinstance(command, str) or not command:
            raise McpConfigError(f"{where}.command: a stdio server needs a command.")
        args = spec.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise McpConfigError(f"{where}.args must be a list of strings.")
        env = _str_map(spec.get("env"), f"{where}.env")
        cwd = spec.get("cwd")
        if cwd is not None and not Path(cwd).is_dir():
            raise McpConfigError(f"{where}.cwd: {cwd} is not a folder.")
        # The server's PATH is the one it is given (else pippin's): look the command up there.
        path = env.get("PATH", os.environ.get("PATH", os.defpath))
        if shutil.which(command, path=path) is None and not (
            cwd is not None and shutil.which(str(Path(cwd) / command))
        ):
            raise McpConfigError(
                f"{where}.command: {command!r} was not found (not an executable file, nor a "
                "program on the PATH)."
            )
        return ServerConfig(command=command, args=tuple(args), env=env, cwd=cwd, **common)
    url = spec.get("url")
    if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https"):
        raise McpConfigError(f"{where}.url: a remote server needs an http(s) URL.")
    headers = _str_map(spec.get("headers"), f"{where}.headers")
    return ServerConfig(url=url, headers=headers, **common)


def load_config(path: str | Path) -> list[ServerConfig]:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise McpConfigError(f"cannot read the MCP config: {exc.strerror}") from None
    except ValueError as exc:
        raise McpConfigError(f"the MCP config is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise McpConfigError("the MCP config must be an object with 'mcpServers'.")
    servers = data.get("mcpServers", data.get("servers"))
    if not isinstance(servers, dict):
        raise McpConfigError("the MCP config needs an 'mcpServers' object (name -> server).")
    out = []
    for name, spec in servers.items():
        if not name or any(c in name for c in "/ \t\n"):
            raise McpConfigError(f"mcpServers: {name!r} is not a usable server name.")
        server = parse_server(name, spec)
        if server is not None:
            out.append(server)
    return out


@dataclass(frozen=True)
class McpSettings:
    """The `--mcp-*` flags."""

    servers: tuple[ServerConfig, ...] = ()
    call_timeout: float = 60.0  # --mcp-call-timeout, seconds per call
    max_calls: int = 8  # --mcp-max-calls, MCP calls per request
    # --mcp-auto: chat completions that name no MCP tool get every server's tools.
    auto: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.servers)
