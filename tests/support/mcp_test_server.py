"""A real MCP server for the tests, on the `mcp` SDK's MCPServer (v1's FastMCP).

`python mcp_test_server.py` serves over stdio; `python mcp_test_server.py http PORT`
over streamable HTTP, `... sse PORT` over SSE. Its tools: `lookup_code` (the answer the
model needs), `add`, `slow` (sleeps), `fail` (raises), `crash` (kills its own process),
`secret_tool` (denied by the tests' config), `show_env` (the environment it was given).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from mcp.server.mcpserver import MCPServer

SCRIPT = os.path.abspath(__file__)

app = MCPServer("pippin-test")

CODES = {"paris": "PX-4417", "tokyo": "TK-9031"}


@app.tool()
def lookup_code(city: str) -> str:
    """Look up the secret door code of a city's office."""
    return CODES.get(city.strip().lower(), "unknown city")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@app.tool()
async def slow(seconds: float) -> str:
    """Wait for the given number of seconds, then answer."""
    await asyncio.sleep(seconds)
    return "finally done"


@app.tool()
def fail(reason: str) -> str:
    """Always fails."""
    raise ValueError(f"failed on purpose: {reason}")


@app.tool()
def crash() -> str:
    """Kills the server process."""
    os._exit(3)


@app.tool()
def secret_tool() -> str:
    """A tool the config denies."""
    return "should never run"


@app.tool()
def show_env(name: str) -> str:
    """The value of an environment variable in the server's process, or '<unset>'."""
    return os.environ.get(name, "<unset>")


@contextmanager
def http_server(port: int, transport: str = "http") -> Iterator[str]:
    """This server over streamable HTTP (or "sse") in a process of its own; yields its URL."""
    proc = subprocess.Popen(
        [sys.executable, SCRIPT, transport, str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}/{'sse' if transport == 'sse' else 'mcp'}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with httpx.stream("GET", url, timeout=1):
                    pass
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the MCP test server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    elif len(sys.argv) > 2 and sys.argv[1] == "sse":
        app.run("sse", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
