"""Start a real `pippin serve` process for tests and talk to it over HTTP."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

SRC_DIR = Path(__file__).resolve().parents[2] / "src"


def at_once(*requests: Callable[[], Any]) -> list[Any]:
    """Each callable's result, all run at the same time. The server batches them: on a CPU
    a decode step costs about the same for one sequence as for a few (it reads every weight
    once either way), so independent requests to a real model take one request's time."""
    with ThreadPoolExecutor(len(requests)) as pool:
        futures = [pool.submit(r) for r in requests]
        return [f.result() for f in futures]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen[bytes]
    log_path: Path
    api_key: str | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def answered(self, endpoint: str, timeout: float = 15.0) -> list[tuple[str, str]]:
        """(path, status) of every logged request to `endpoint`. The server logs a request
        once its response is sent, so a client can exit before the line is written: wait
        until there is one and no more come for a second."""
        pattern = re.compile(rf"endpoint=({re.escape(endpoint)}\S*) status=(\d+)")
        deadline = time.monotonic() + timeout
        seen: list[tuple[str, str]] = []
        while True:
            now = pattern.findall(self.log())
            if (now and now == seen) or time.monotonic() > deadline:
                return now
            seen = now
            time.sleep(1.0)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def check_alive(self) -> None:
        """Raise, with the server's exit status and log tail, if its process has ended
        (the kernel's OOM killer ends it with -9): clearer than the refused connections
        its clients report next."""
        code = self.proc.poll()
        if code is not None:
            why = " (killed: out of memory?)" if code == -9 else ""
            raise RuntimeError(f"pippin exited with {code}{why}:\n{self.log()[-4000:]}")

    def _sdk_kwargs(self, kw: dict[str, object]) -> dict[str, object]:
        return {
            "base_url": f"{self.url}/v1",
            "api_key": self.api_key or "unused",
            "max_retries": 0,
            "timeout": 300,
            **kw,
        }

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(**self._sdk_kwargs(kw))  # type: ignore[arg-type]

    def async_client(self, **kw: object) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(**self._sdk_kwargs(kw))  # type: ignore[arg-type]

    def http(self, **kw: object) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers(), timeout=300, **kw)  # type: ignore[arg-type]

    def peak_rss_kib(self) -> int:
        """The server's peak resident memory (Linux), to show a body was not buffered."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
        raise RuntimeError("no VmHWM")


@contextmanager
def run_server(
    *args: str, api_key: str | None = None, startup_timeout: float = 300
) -> Iterator[Server]:
    """`python -m pippin.cli serve *args` on a free port, until /health says ok."""
    port = free_port()
    cmd = [sys.executable, "-m", "pippin.cli", "serve", *args, "--port", str(port)]
    if os.environ.get("PIPPIN_TEST_ENGINE_PROCESS") == "1" and "--engine-process" not in args:
        cmd.append("--engine-process")  # the API suites against an engine process
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ)
    no_torch = str(Path(__file__).parent / "no_torch")  # as a user's install: no torch
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (no_torch, str(SRC_DIR), env.get("PYTHONPATH")) if p
    )
    env.pop("PIPPIN_API_KEY", None)
    fd, log_name = tempfile.mkstemp(prefix="pippin-server-", suffix=".log")
    log_path = Path(log_name)
    with os.fdopen(fd, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", proc, log_path, api_key)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server not healthy in {startup_timeout}s:\n{server.log()[-4000:]}"
                )
            time.sleep(0.25)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log_path.unlink(missing_ok=True)


def engine_process_pid(server: Server) -> int:
    """The pid of the server's engine process (`spawn_main` in its command line; `pippin
    serve` may have re-executed itself as a child of the process the test started)."""
    todo, found = [server.proc.pid], []
    while todo:
        pid = todo.pop()
        kids = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        for kid in map(int, kids.stdout.split()):
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes()
            (found if b"spawn_main" in cmd else todo).append(kid)
    assert len(found) == 1, found
    return found[0]
