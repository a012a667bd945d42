"""The configured MCP servers, kept connected, and the calls made to their tools.

All MCP work runs on a thread of its own ("pippin-mcp") with a plain asyncio loop, not on
the server's uvloop: uvloop spawns processes with fork(), whose pre-fork handlers
(OpenBLAS's joins its worker threads) can deadlock the whole server while the engine
runs; CPython's subprocess spawns with vfork, which runs no such handlers. It also keeps
the SDK's work off the loop that serves requests. `ServerConn.call` and
`McpManager.start` / `stop` may be awaited from any loop.

Each server has a supervising task (`ServerConn.run`) that connects with the `mcp` SDK's
transports (stdio, streamable HTTP, SSE), lists the tools, then watches the connection
(a failed call or missed pings mean it died) and reconnects with an exponential backoff.
A call never raises: a timeout, a crashed server, arguments that fail the tool's schema
or a tool the config does not allow each come back as an error result, so the request
that made the call goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import sys
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from mcp import ClientSession, StdioServerParameters
from mcp.client.sse import sse_client
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.types import PaginatedRequestParams

from pippin.mcp.config import ServerConfig, public_url

log = logging.getLogger("pippin.mcp")

# Connecting and listing tools; a server slower than this to start is retried.
CONNECT_TIMEOUT = 30.0
PING_SECONDS = 5.0
PING_TIMEOUT = 10.0
MISSED_PINGS = 3  # a server busy in a blocking tool may miss a ping or two
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
# A connection that stayed up this long resets the backoff.
HEALTHY_SECONDS = 60.0


@dataclass(frozen=True)
class ToolInfo:
    server: str
    name: str
    description: str | None
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None = None

    def function(self) -> dict[str, Any]:
        """The tool as a chat template's function tool."""
        # The OpenAI order (templates `tojson` it as it is): as a client's tool renders.
        fn: dict[str, Any] = {"name": self.name}
        if self.description:
            fn["description"] = self.description
        fn["parameters"] = self.input_schema
        return {"type": "function", "function": fn}

    @property
    def read_only(self) -> bool:
        return bool((self.annotations or {}).get("readOnlyHint"))


@dataclass(frozen=True)
class CallResult:
    output: str
    # None on success; else what went wrong: "tool_error" (the tool said so), "timeout",
    # "server_error" (crashed or unreachable), "invalid_arguments", "not_allowed".
    error: str | None = None

    @property
    def is_error(self) -> bool:
        return self.error is not None


def _result_text(result: Any) -> str:
    parts = []
    for c in result.content or []:
        text = getattr(c, "text", None)
        if isinstance(text, str):
            parts.append(text)
        else:
            parts.append(json.dumps(c.model_dump(mode="json", exclude_none=True)))
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content))
    return "\n".join(parts)


_URL = re.compile(r"https?://[^\s'\"<>]+")


def _describe(exc: BaseException) -> str:
    """An error as one line without the config's secrets (headers and env never appear
    in the SDK's messages; a URL's query might)."""
    group = getattr(exc, "exceptions", None)
    if isinstance(group, tuple | list) and group:
        return "; ".join(_describe(e) for e in group[:3])
    msg = str(exc).splitlines()[0] if str(exc) else ""
    # A URL's user info or query may hold a key: only scheme, host and path are kept.
    msg = _URL.sub(lambda m: public_url(m.group(0)), msg)
    return f"{type(exc).__name__}: {msg}"[:300] if msg else type(exc).__name__


class ServerConn:
    """One configured server: its connection, state and tools."""

    def __init__(
        self,
        config: ServerConfig,
        call_timeout: float,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.config = config
        self.loop = loop  # the MCP thread's loop (None: the caller's own)
        self.call_timeout = config.timeout or call_timeout
        self.state = "starting"  # starting, ready, restarting, stopped
        self.error: str | None = None
        self.restarts = 0
        self.connected_at: float | None = None
        self.tools: dict[str, ToolInfo] = {}  # those the config allows
        self._session: ClientSession | None = None
        self._dead = asyncio.Event()
        self._stop = asyncio.Event()
        self.ready = asyncio.Event()  # set after the first attempt, whatever it gave
        self._task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.config.name

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.run())

    async def stop(self) -> None:
        self._stop.set()
        self._dead.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            if not self._task.done():
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
        self.state = "stopped"

    def public(self) -> dict[str, Any]:
        out = self.config.public()
        out |= {
            "state": self.state,
            "error": self.error,
            "restarts": self.restarts,
            "tools": sorted(self.tools),
        }
        return out

    def _transport(self) -> contextlib.AbstractAsyncContextManager[Any]:
        c = self.config
        if c.transport == "stdio":
            assert c.command is not None
            # Only the config's env over the SDK's minimal one (PATH, HOME, USER, ...).
            params = StdioServerParameters(
                command=c.command, args=list(c.args), env=dict(c.env), cwd=c.cwd
            )
            return stdio_client(params, errlog=sys.stderr)
        assert c.url is not None
        if c.transport == "sse":
            return sse_client(c.url, headers=dict(c.headers) or None)

        @contextlib.asynccontextmanager
        async def http() -> Any:
            async with create_mcp_http_client(headers=dict(c.headers)) as client:
                async with streamable_http_client(c.url, http_client=client) as streams:
                    yield streams

        return http()

    async def run(self) -> None:
        delay = BACKOFF_FIRST
        while not self._stop.is_set():
            self._dead.clear()
            try:
                await self._connected()
            except Exception as exc:  # noqa: BLE001 - any failure means reconnect
                self.error = _describe(exc)
                log.warning("MCP server %s: %s", self.name, self.error)
            finally:
                self._session = None
                self.ready.set()
            if self._stop.is_set():
                break
            up = time.monotonic() - self.connected_at if self.connected_at else 0.0
            if up > HEALTHY_SECONDS:
                delay = BACKOFF_FIRST
            self.state = "restarting"
            self.restarts += 1
            log.info("MCP server %s: reconnecting in %.1fs", self.name, delay)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)
            delay = min(delay * 2, BACKOFF_MAX)

    async def _connected(self) -> None:
        self.connected_at = None
        async with contextlib.AsyncExitStack() as stack:
            read, write = await self._enter(stack)
            session = await stack.enter_async_context(ClientSession(read, write))
            await asyncio.wait_for(session.initialize(), CONNECT_TIMEOUT)
            self.tools = await asyncio.wait_for(self._list(session), CONNECT_TIMEOUT)
            self._session = session
            self.state, self.error = "ready", None
            self.connected_at = time.monotonic()
            self.ready.set()
            log.info("MCP server %s: ready with %d tools", self.name, len(self.tools))
            await self._watch(session)
            self._session = None
            if not self._stop.is_set() and self.error is None:
                self.error = "the connection was lost"

    async def _enter(self, stack: contextlib.AsyncExitStack) -> tuple[Any, Any]:
        streams = await stack.enter_async_context(self._transport())
        return streams[0], streams[1]

    async def _list(self, session: ClientSession) -> dict[str, ToolInfo]:
        tools: dict[str, ToolInfo] = {}
        cursor = None
        while True:
            params = PaginatedRequestParams(cursor=cursor) if cursor is not None else None
            listed = await session.list_tools(params=params)
            for t in listed.tools:
                if self.config.allows(t.name):
                    ann = t.annotations.model_dump(exclude_none=True) if t.annotations else None
                    tools[t.name] = ToolInfo(
                        self.name, t.name, t.description, dict(t.input_schema or {}), ann
                    )
            cursor = listed.next_cursor
            if not cursor:
                return tools

    async def _watch(self, session: ClientSession) -> None:
        """Returns when the connection is dead: a call saw it close, or pings go unanswered."""
        missed = 0
        while not self._dead.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._dead.wait(), PING_SECONDS)
            if self._dead.is_set():
                return
            try:
                await asyncio.wait_for(session.send_ping(), PING_TIMEOUT)
                missed = 0
            except asyncio.TimeoutError:
                missed += 1
                if missed >= MISSED_PINGS:
                    self.error = "the server stopped answering pings"
                    return
            except Exception as exc:  # noqa: BLE001 - a closed connection
                self.error = _describe(exc)
                return

    async def call(self, name: str, arguments: str | dict[str, Any]) -> CallResult:
        """Runs the call on the MCP thread; awaitable from any loop, never raises."""
        return await on_loop(self.loop, self._call(name, arguments))

    async def _call(self, name: str, arguments: str | dict[str, Any]) -> CallResult:
        if not self.config.allows(name):
            return CallResult(f"The tool '{name}' is not allowed on '{self.name}'.", "not_allowed")
        tool = self.tools.get(name)
        if tool is None:
            return CallResult(f"'{self.name}' has no tool '{name}'.", "not_allowed")
        args = arguments
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return CallResult("The arguments are not valid JSON.", "invalid_arguments")
        if not isinstance(args, dict):
            return CallResult("The arguments must be a JSON object.", "invalid_arguments")
        problem = validate_arguments(tool.input_schema, args)
        if problem is not None:
            return CallResult(f"Invalid arguments for '{name}': {problem}", "invalid_arguments")
        session = self._session
        if session is None or self.state != "ready":
            why = f" ({self.error})" if self.error else ""
            return CallResult(f"The MCP server '{self.name}' is {self.state}{why}.", "server_error")
        try:
            result = await asyncio.wait_for(session.call_tool(name, args), self.call_timeout)
        except asyncio.TimeoutError:
            log.warning("MCP server %s: %s timed out", self.name, name)
            return CallResult(
                f"The tool '{name}' did not answer within {self.call_timeout:g} s.", "timeout"
            )
        except Exception as exc:  # noqa: BLE001 - the server crashed or the link broke
            self.error = _describe(exc)
            self._dead.set()
            log.warning("MCP server %s: %s failed: %s", self.name, name, self.error)
            return CallResult(f"The MCP server '{self.name}' failed: {self.error}", "server_error")
        text = _result_text(result)
        if result.is_error:
            return CallResult(text or "The tool reported an error.", "tool_error")
        return CallResult(text)


def validate_arguments(schema: dict[str, Any], args: dict[str, Any]) -> str | None:
    """The first way `args` breaks the tool's input schema, or None."""
    if not schema:
        return None
    try:
        cls = jsonschema.validators.validator_for(schema)
        error = jsonschema.exceptions.best_match(cls(schema).iter_errors(args))
    except jsonschema.exceptions.SchemaError:
        return None  # the server's own schema is broken: let the server judge
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message


async def on_loop(loop: asyncio.AbstractEventLoop | None, coro: Coroutine[Any, Any, Any]) -> Any:
    """`coro` run on `loop` (another thread's), awaited from the caller's loop; cancelling
    the caller cancels it there."""
    if loop is None or loop is asyncio.get_running_loop():
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


@dataclass
class McpManager:
    """Every configured server, by name, on the MCP thread."""

    configs: list[ServerConfig]
    call_timeout: float = 60.0
    servers: dict[str, ServerConn] = field(default_factory=dict)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.SelectorEventLoop)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.servers = {c.name: ServerConn(c, self.call_timeout, self.loop) for c in self.configs}

    async def start(self, wait: float = CONNECT_TIMEOUT) -> None:
        """Starts the MCP thread and every server; waits (up to `wait`) for each one's first
        attempt."""
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="pippin-mcp", daemon=True
        )
        self._thread.start()
        await on_loop(self.loop, self._start(wait))

    async def _start(self, wait: float) -> None:
        for conn in self.servers.values():
            conn.start()
        waits = [conn.ready.wait() for conn in self.servers.values()]
        if waits:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.gather(*waits), wait)

    async def stop(self) -> None:
        if self._thread is None:
            return
        await on_loop(self.loop, self._stop_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        await asyncio.to_thread(self._thread.join, 10)
        self._thread = None

    async def _stop_all(self) -> None:
        await asyncio.gather(*(conn.stop() for conn in self.servers.values()))

    def get(self, name: str) -> ServerConn | None:
        return self.servers.get(name)

    def by_url(self, url: str) -> ServerConn | None:
        want = public_url(url).rstrip("/")
        for conn in self.servers.values():
            if conn.config.url is not None and public_url(conn.config.url).rstrip("/") == want:
                return conn
        return None

    def tools(self) -> list[ToolInfo]:
        return [t for conn in self.servers.values() for t in conn.tools.values()]
