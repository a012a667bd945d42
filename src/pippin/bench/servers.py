"""Servers that `pippin bench --serve` starts, measures and stops.

A spec is shell words: ``[VAR=VALUE ...] [NAME=]KIND:MODEL [SERVER FLAGS ...]``. Leading
words whose name is in capitals set that server's environment; NAME (default: KIND) names
it in the results; the rest go to the server's command line. Kinds:

- ``pippin``: ``PYTHON -m pippin.cli serve MODEL --port P``, running the pippin that runs
  the benchmark (its folder first on ``PYTHONPATH``);
- ``mlx_lm``: ``PYTHON -m mlx_lm.server --model MODEL --port P``, asked for its model as
  ``default_model``. Its HTTP server closes every connection and has a listen backlog of 5,
  so a burst of connects is reset: with it in a run, clients start a few ms apart and a
  refused connect is retried (counted in the results);
- ``vllm_mlx``: ``PYTHON -m vllm_mlx.cli serve MODEL --port P --continuous-batching
  --stream-interval 1``;
- ``cmd``: any command, MODEL being the program; ``{port}`` in a word is replaced by the
  port (``cmd:llama-server -m model.gguf --port {port}``).

MODEL may be ``random:NAME`` (see `pippin.bench.models`): built once, the same folder for
every server. PYTHON is the benchmark's own Python unless ``--python KIND=PATH`` says
otherwise (a peer in a virtual environment of its own).

Every server gets a free port on 127.0.0.1 and its own process group, and counts as ready
when ``/health`` or ``/v1/models`` answers 200. While one server is measured the others are
paused (SIGSTOP), so one that polls while idle takes no CPU from it. MLX settings pippin made
for itself (`pippin.mlx_env.SET`) are taken out of the peers' environment; on Linux, every
server's MLX gets the same BLAS (``--blas``).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx

from pippin.bench.models import resolve_model

KINDS = ("pippin", "mlx_lm", "vllm_mlx", "cmd")
_ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass
class ServerSpec:
    name: str
    kind: str
    model: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ramps_clients(self) -> bool:
        """Whether clients must connect a few at a time (mlx_lm.server's small backlog)."""
        return self.kind == "mlx_lm"


def parse_spec(text: str) -> ServerSpec:
    words = shlex.split(text)
    env: dict[str, str] = {}
    while words and _ENV_WORD.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if not words:
        raise ValueError(f"--serve {text!r}: no KIND:MODEL")
    head, args = words[0], words[1:]
    name, sep, rest = head.partition("=")
    if not sep or ":" in name:
        name, rest = "", head
    kind, sep, model = rest.partition(":")
    if not sep or kind not in KINDS or not model:
        raise ValueError(
            f"--serve {text!r}: expected [VAR=VALUE ...] [NAME=]KIND:MODEL [FLAGS ...] "
            f"with KIND one of {', '.join(KINDS)}"
        )
    return ServerSpec(name or kind, kind, model, args, env)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def package_version(name: str, python: str) -> str | None:
    """`name`'s installed version for `python` (this interpreter's without a subprocess)."""
    if os.path.abspath(python) == os.path.abspath(sys.executable):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    code = f"import importlib.metadata as m; print(m.version({name!r}))"
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def resolve_blas(choice: str) -> str | None:
    """The BLAS library every server's MLX uses on Linux, or None for none preloaded.

    The Linux ``mlx[cpu]`` wheel links the reference BLAS and pippin preloads OpenBLAS by
    itself; ``auto`` gives the peers that same OpenBLAS, ``none`` turns pippin's preload
    off too, so that the comparison is of servers, not BLAS builds."""
    if choice == "none" or not sys.platform.startswith("linux"):
        return None
    if choice != "auto":
        return choice
    from pippin.blas import find_openblas  # imports no MLX

    return find_openblas()


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of `pid` and its live descendants (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # After the command name: utime, stime, cutime, cstime are fields 14-17.
    total = sum(int(x) for x in stat[stat.rfind(b")") + 2 :].split()[11:15])
    seconds = total / os.sysconf("SC_CLK_TCK")
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            seconds += proc_cpu_seconds(int(child)) or 0.0
    return seconds


def machine_busy_seconds() -> float | None:
    """Busy CPU seconds of the whole machine, all cores (Linux /proc/stat)."""
    try:
        with open("/proc/stat", "rb") as f:
            vals = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    spec: ServerSpec
    cmd: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    model_field: str | None = None  # the `model` requests carry (None: its first listed)
    model: str | None = None  # what it serves: a folder for random:NAME
    version: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def start(self, timeout: float) -> None:
        """Start it and wait until it answers; RuntimeError (with its log's tail) if not."""
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.cmd,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a process group of its own: stopped as one
            )
        with httpx.Client(timeout=5.0) as client:
            while time.perf_counter() - t0 < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.spec.name} exited with code {self.proc.returncode} while "
                        f"starting ({' '.join(self.cmd)}); log {self.log_path}:\n" + self.log_tail()
                    )
                for route in ("/health", "/v1/models"):
                    try:
                        if client.get(self.url + route).status_code == 200:
                            self.startup_s = time.perf_counter() - t0
                            return
                    except httpx.HTTPError:
                        pass
                time.sleep(0.25)
        raise RuntimeError(
            f"{self.spec.name} did not answer within {timeout:.0f} s; log {self.log_path}:\n"
            + self.log_tail()
        )

    def _signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def pause(self, paused: bool) -> None:
        self._signal(signal.SIGSTOP if paused else signal.SIGCONT)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            proc.wait(timeout=10)

    def cpu_seconds(self) -> float | None:
        return None if self.proc is None else proc_cpu_seconds(self.proc.pid)

    def info(self) -> dict[str, Any]:
        return {
            "kind": self.spec.kind,
            "pid": self.proc.pid if self.proc else None,
            "cmd": self.cmd,
            "env": self.spec.env,
            "startup_s": self.startup_s,
            "model_path": self.model,
            "package_version": self.version,
            "log": str(self.log_path),
        }


def _pippin_path() -> str:
    """The folder holding the `pippin` package that runs now (`src/` in a checkout)."""
    import pippin

    return str(Path(pippin.__file__).resolve().parent.parent)


def make_server(
    spec: ServerSpec,
    log_dir: Path,
    python: str = sys.executable,
    blas: str | None = None,
    model_root: Path | None = None,
) -> Server:
    """The command, environment and port of `spec` (nothing started yet)."""
    from pippin import mlx_env

    port = free_port()
    env = dict(os.environ)
    model = resolve_model(spec.model, model_root) if spec.kind != "cmd" else None
    model_field = None
    if spec.kind == "pippin":
        env["PYTHONPATH"] = os.pathsep.join(
            [_pippin_path(), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
        )
        if blas is None:
            env["PIPPIN_NO_OPENBLAS"] = "1"
        # No model: pippin's default one (SmolLM2-135M-Instruct).
        cmd = [python, "-m", "pippin.cli", "serve", *([model] if model else [])]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        version = package_version("pippin", python)
    else:
        for key in mlx_env.SET:  # pippin's MLX settings are pippin's, not the peer's
            env.pop(key, None)
        if blas:
            env["LD_PRELOAD"] = ":".join(x for x in (blas, env.get("LD_PRELOAD")) if x)
        if spec.kind == "mlx_lm":
            cmd = [python, "-m", "mlx_lm.server", "--model", model, "--port", str(port)]
            model_field = "default_model"  # its /v1/models lists the Hub cache instead
            version = package_version("mlx-lm", python)
        elif spec.kind == "vllm_mlx":
            cmd = [python, "-m", "vllm_mlx.cli", "serve", model, "--port", str(port)]
            cmd += ["--continuous-batching", "--stream-interval", "1"]
            version = package_version("vllm-mlx", python)
        else:
            cmd = [spec.model]
            version = None
    cmd += spec.args
    cmd = [w.replace("{port}", str(port)) for w in cmd]
    env.update(spec.env)
    log = log_dir / f"{spec.name}.log"
    return Server(spec, cmd, env, port, log, model_field, model, version)


@contextmanager
def pippin_server(
    *args: str,
    model: str = "",
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    blas: str = "auto",
    startup_timeout: float = 600.0,
) -> Iterator[Server]:
    """`pippin serve [MODEL] *args` on a free port of 127.0.0.1 until it answers, stopped
    (its whole process group) on the way out: how every bench script starts a pippin, as
    `pippin bench --serve` does. MODEL may be `random:NAME`; none is pippin's default."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="pippin-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    spec = ServerSpec("pippin", "pippin", model, list(args), env or {})
    server = make_server(spec, log_dir, blas=resolve_blas(blas))
    try:
        server.start(startup_timeout)
        yield server
    finally:
        server.stop()


class ServerSet:
    """The servers of a run: started in order, each waited for, all stopped at the end.

    As the runner's watch (`pippin.bench.runner.Watch`) it pauses all but the server being
    measured and reads the CPU each window took."""

    def __init__(
        self,
        specs: list[ServerSpec],
        *,
        pythons: dict[str, str] | None = None,
        blas: str = "auto",
        startup_timeout: float = 600.0,
        pause_idle: bool = True,
        log_dir: Path | None = None,
        model_root: Path | None = None,
        echo: Any = None,
    ) -> None:
        self.specs = specs
        self.pythons = pythons or {}
        self.blas = resolve_blas(blas)
        self.startup_timeout = startup_timeout
        self.pause_idle = pause_idle
        self.log_dir = log_dir
        self.model_root = model_root
        self.echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.servers: dict[str, Server] = {}
        self._cpu0: tuple[float | None, float | None, float] = (None, None, 0.0)

    def __enter__(self) -> ServerSet:
        log_dir = self.log_dir or Path(tempfile.mkdtemp(prefix="pippin-bench-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.echo(f"server logs in {log_dir}")
        try:
            for spec in self.specs:
                python = self.pythons.get(spec.kind, sys.executable)
                srv = make_server(spec, log_dir, python, self.blas, self.model_root)
                self.servers[spec.name] = srv
                self.echo(f"[{spec.name}] starting: {shlex.join(srv.cmd)}")
                srv.start(self.startup_timeout)
                self.echo(f"[{spec.name}] ready in {srv.startup_s:.1f} s on {srv.url}")
                srv.pause(self.pause_idle)  # until its turn
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        for srv in self.servers.values():
            srv.stop()

    # The runner's watch.
    def begin(self, name: str) -> None:
        """`name`'s turn: it runs, the others wait (if pausing), its CPU clock starts."""
        for n, srv in self.servers.items():
            srv.pause(self.pause_idle and n != name)
        srv = self.servers.get(name)
        self._cpu0 = (
            srv.cpu_seconds() if srv else None,
            machine_busy_seconds(),
            time.perf_counter(),
        )

    def end(self, name: str) -> dict[str, float] | None:
        """The share of a core the server and the whole machine used since `begin`."""
        server0, busy0, t0 = self._cpu0
        wall = time.perf_counter() - t0
        srv = self.servers.get(name)
        server1, busy1 = srv.cpu_seconds() if srv else None, machine_busy_seconds()
        out = {}
        if server0 is not None and server1 is not None:
            out["server_cpu"] = (server1 - server0) / wall
        if busy0 is not None and busy1 is not None:
            out["machine_cpu"] = (busy1 - busy0) / wall
        return out or None
