"""Serving benchmark: pippin side by side with its peers, over HTTP, in one run.

`pippin bench` measures servers that are already running (any OpenAI-compatible URL); this
script also builds the model, starts pippin and its peers, pauses the idle ones and checks
for foreign CPU use. It times requests with `pippin bench`'s client (`pippin.bench.client`).

Starts every server up front on the same model (one after another, waiting for each to answer
its health route), then measures them one at a time so they never compete for the CPU, with the
order rotated between windows. For each repetition, for each concurrency, for each server it runs
one closed-loop measurement window of streaming requests and records, per request, the time to
the first content chunk (TTFT), the gaps between content chunks (ITL) and the end-to-end time.
Aggregate output tokens/s is total output tokens divided by the wall time of the window.

Run by hand, never as a test. Typical use on a development machine:

    .venv/bin/python bench/serve_bench.py --build-model /tmp/pippin-bench-model \\
        --out /tmp/serve_bench.json

Servers (``--servers``, comma separated):

- ``pippin``: ``<python> -m pippin.cli serve MODEL --port P`` (``src`` is put on PYTHONPATH).
- ``mlx_lm``: ``<python> -m mlx_lm.server --model MODEL --port P``. Its HTTP server has a listen
  backlog of 5 and resets connections on a burst of connects, so clients are started staggered
  (``--stagger-ms``) and a refused connect is retried (counted in the results).
- ``vllm_mlx``: ``<vllm python> -m vllm_mlx.cli serve MODEL --port P --continuous-batching``,
  from a separate virtual environment (``--vllm-mlx-python``); skipped with a note if missing.

Fairness on a small shared CPU: every server's MLX uses the same BLAS (``--blas``; pippin
preloads OpenBLAS on Linux, so the peers get it too), idle servers are paused with SIGSTOP while
another is measured, every window uses fresh prompts (no prefix-cache hits) that are the same
for every server, and a window during which other processes on the machine took more than
``--max-foreign-cpu`` percent of a core is measured again (``--busy-retries``). Client, server
and foreign CPU are reported per window so that a client-side bottleneck would show.

Output: a table on stdout, the full results as JSON (``--out``) and a Markdown snippet for
docs/benchmarks.md (``--md``, also printed) with the command line and a machine fingerprint.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
from checkout import REPO_ROOT

# The request timing and percentiles are `pippin bench`'s; this script adds starting the
# peers, pausing idle ones and checking for foreign CPU use around them.
from pippin import mlx_env  # noqa: E402
from pippin.bench.client import RequestResult, stream_request  # noqa: E402
from pippin.bench.runner import client_processes, shares, start_pool  # noqa: E402
from pippin.bench.stats import percentile as pct  # noqa: E402

DEFAULT_VLLM_MLX_PYTHON = "/tmp/vllm-mlx-venv/bin/python"
ALL_SERVERS = ("pippin", "mlx_lm", "vllm_mlx")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Plain words for prompts; each request gets its own random sequence of them, so that no server
# can answer from a prefix cache (every prompt differs from its first word on).
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot right "
    "study book eye job word business issue side kind head house service friend father power "
    "hour game line end member law car city community name president team minute idea kid body "
    "information back parent face others level office door health person art war history party "
    "result change morning reason research girl guy moment air teacher force education river "
    "stone light garden window paper music market table letter window bridge forest cloud winter "
    "summer autumn spring engine signal number matrix vector kernel thread socket buffer packet"
).split()


# --------------------------------------------------------------------------------------------
# Tiny model
# --------------------------------------------------------------------------------------------


def build_model(out_dir: Path, vocab_size: int = 8000, seed: int = 0) -> dict[str, Any]:
    """Build a tiny random-weight Qwen3 model folder that ``mlx_lm.utils.load`` can open.

    The tokenizer is a byte-level BPE trained on Python's standard library sources, saved with a
    ChatML chat template and ``<|im_end|>`` as end of sequence. Weights are float32 (the fastest
    dtype on CPU).
    """
    import sysconfig

    import mlx.core as mx
    from mlx_lm.models import qwen3
    from mlx_lm.utils import get_total_parameters, save_config, save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    out_dir.mkdir(parents=True, exist_ok=True)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in files], trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
        "chat_template": CHATML_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for t, i in ids.items()
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )

    config: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "intermediate_size": 768,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": tok.get_vocab_size(),
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": ids["<|im_end|>"],
    }
    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    save_model(out_dir, model)
    save_config(config, out_dir / "config.json")
    (out_dir / "generation_config.json").write_text(
        json.dumps({"eos_token_id": ids["<|im_end|>"]}, indent=2)
    )
    info = {
        "path": str(out_dir),
        "architecture": "qwen3 (mlx-lm class), random weights, float32",
        "hidden_size": 256,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "vocab_size": config["vocab_size"],
        "parameters": int(get_total_parameters(model)),
    }
    (out_dir / "bench_model.json").write_text(json.dumps(info, indent=2))
    return info


def model_info(model_dir: Path) -> dict[str, Any]:
    info_file = model_dir / "bench_model.json"
    if info_file.exists():
        return json.loads(info_file.read_text())
    info: dict[str, Any] = {"path": str(model_dir)}
    cfg = model_dir / "config.json"
    if cfg.exists():
        c = json.loads(cfg.read_text())
        info.update(
            architecture=c.get("model_type"),
            hidden_size=c.get("hidden_size"),
            layers=c.get("num_hidden_layers"),
            vocab_size=c.get("vocab_size"),
        )
    return info


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


class PromptMaker:
    """Random-word prompts of about ``n_tokens`` tokens (counted with the model's tokenizer)."""

    def __init__(self, model_dir: Path, n_tokens: int, seed: int) -> None:
        self.n_tokens = n_tokens
        self.seed = seed
        self._tok: Any = None
        tj = model_dir / "tokenizer.json"
        if tj.exists():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(tj))

    def _count(self, text: str) -> int:
        if self._tok is None:
            return int(len(text.split()) * 1.3)
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def make(self, key: str) -> tuple[str, int]:
        rng = random.Random(f"{self.seed}:{key}")
        words = [rng.choice(WORDS) for _ in range(self.n_tokens)]
        # Trim (binary search) to the longest prefix with at most n_tokens tokens.
        lo, hi = 1, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._count(" ".join(words[:mid])) <= self.n_tokens:
                lo = mid
            else:
                hi = mid - 1
        text = " ".join(words[:lo])
        return text, self._count(text)


# --------------------------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    name: str
    cmd: list[str]
    env: dict[str, str]
    port: int
    log_path: Path
    model_field: str | None = None  # the `model` value requests carry
    extra_body: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    version: str | None = None
    startup_s: float | None = None
    error: str | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cpu_seconds(self) -> float | None:
        """User + system CPU seconds of the server process (all its threads), from /proc."""
        if self.proc is None:
            return None
        return tree_cpu_seconds(self.proc.pid)


def proc_cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    # Fields after the command name start at field 3 (state); utime/stime are fields 14/15,
    # cutime/cstime 16/17 (children already waited for).
    ticks = sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def system_busy_seconds() -> float | None:
    """Busy CPU seconds of the whole machine (all cores), from /proc/stat."""
    try:
        with open("/proc/stat", "rb") as f:
            parts = f.readline().split()
    except OSError:
        return None
    vals = [int(x) for x in parts[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    busy = sum(vals[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float | None:
    """CPU seconds of a process and its live descendants (vllm-mlx may fork helpers)."""
    total = proc_cpu_seconds(pid)
    if total is None:
        return None
    children: list[str] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += (task / "children").read_text().split()
        except OSError:
            pass
    for c in children:
        sub = tree_cpu_seconds(int(c))
        if sub is not None:
            total += sub
    return total


def package_version(name: str, python: str | None = None) -> str | None:
    # Compare without resolving links: a venv's python links to the same base interpreter.
    if python is None or os.path.abspath(python) == os.path.abspath(sys.executable):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None
    try:
        out = subprocess.run(
            [python, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def resolve_blas(choice: str) -> str | None:
    """The BLAS library every server's MLX should use on Linux CPU, or None for MLX's own.

    The Linux ``mlx[cpu]`` wheel links the reference BLAS; pippin preloads OpenBLAS (prefill
    several times faster). So that the comparison is of serving stacks and not of BLAS
    builds, ``auto`` gives the peers the same OpenBLAS through LD_PRELOAD, and ``none`` turns
    pippin's preload off (PIPPIN_NO_OPENBLAS) so that nobody has it.
    """
    if choice == "none" or not sys.platform.startswith("linux"):
        return None
    if choice != "auto":
        return choice
    from pippin.blas import find_openblas  # pure Python: imports no MLX

    return find_openblas()


def make_server(name: str, args: argparse.Namespace, log_dir: Path) -> Server | str:
    """Build the launch description of one server, or return why it is skipped."""
    port = free_port()
    env = dict(os.environ)
    if name != "pippin":
        for key in mlx_env.SET:  # pippin's MLX settings, not the peer's
            env.pop(key, None)
    if name != "pippin" and args.blas_lib:
        env["LD_PRELOAD"] = ":".join(x for x in (args.blas_lib, env.get("LD_PRELOAD")) if x)
    if name == "pippin" and args.blas_lib is None:
        env["PIPPIN_NO_OPENBLAS"] = "1"
    model = str(args.model)
    log = log_dir / f"{name}.log"
    if name == "pippin":
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO_ROOT / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
        )
        probe = subprocess.run(
            [args.python, "-m", "pippin.cli", "serve", "--help"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if probe.returncode != 0:
            tail = (probe.stderr or probe.stdout).strip().splitlines()[-1:] or ["?"]
            return f"`pippin.cli serve --help` failed: {tail[0]}"
        cmd = [args.python, "-m", "pippin.cli", "serve", model, "--port", str(port)]
        cmd += shlex.split(args.pippin_args)
        srv = Server(name, cmd, env, port, log, extra_body={"ignore_eos": True})
        srv.version = package_version("pippin") or "src"
        return srv
    if name == "mlx_lm":
        cmd = [args.python, "-m", "mlx_lm.server", "--model", model, "--port", str(port)]
        cmd += shlex.split(args.mlx_lm_args)
        # mlx_lm.server has no ignore_eos: it may stop early on an end token (reported).
        srv = Server(name, cmd, env, port, log, model_field="default_model")
        srv.version = package_version("mlx-lm", args.python)
        return srv
    if name == "vllm_mlx":
        py = args.vllm_mlx_python
        if not py or not Path(py).exists():
            return f"vllm-mlx python not found at {py!r} (install it in a separate venv)"
        probe = subprocess.run(
            [py, "-c", "import vllm_mlx.cli"], capture_output=True, text=True, timeout=300
        )
        if probe.returncode != 0:
            tail = probe.stderr.strip().splitlines()[-1:] or ["?"]
            return f"vllm_mlx does not import: {tail[0]}"
        cmd = [py, "-m", "vllm_mlx.cli", "serve", model, "--port", str(port)]
        cmd += shlex.split(args.vllm_mlx_args)
        env.pop("PYTHONPATH", None)
        srv = Server(name, cmd, env, port, log)
        # vllm-mlx pins its own mlx-lm; name what its venv has.
        srv.version = (
            f"{package_version('vllm-mlx', py)} (mlx-lm {package_version('mlx-lm', py)}, "
            f"mlx {package_version('mlx', py)})"
        )
        return srv
    return f"unknown server {name!r}"


def start_server(srv: Server, timeout: float) -> bool:
    t0 = time.perf_counter()
    log = open(srv.log_path, "wb")  # noqa: SIM115 - closed with the process
    srv.proc = subprocess.Popen(
        srv.cmd,
        env=srv.env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # its own process group, so we can stop it and its children
        cwd=str(REPO_ROOT),
    )
    log.close()
    deadline = t0 + timeout
    with httpx.Client(timeout=5.0) as client:
        while time.perf_counter() < deadline:
            if srv.proc.poll() is not None:
                srv.error = f"exited with code {srv.proc.returncode} during startup"
                return False
            try:
                ok = False
                for route in ("/health", "/v1/models"):
                    r = client.get(srv.base + route)
                    if r.status_code == 200:
                        ok = True
                        break
                if ok:
                    srv.startup_s = time.perf_counter() - t0
                    if srv.model_field is None:
                        srv.model_field = first_model_id(client, srv.base) or str(srv.cmd[-3])
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    srv.error = f"not ready after {timeout:.0f} s"
    return False


def first_model_id(client: httpx.Client, base: str) -> str | None:
    try:
        r = client.get(base + "/v1/models")
        data = r.json().get("data") or []
        return str(data[0]["id"]) if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None


def pause_server(srv: Server, pause: bool) -> None:
    """SIGSTOP / SIGCONT the process group this script started for a server.

    Idle servers are paused while another one is measured, so that one that polls while idle
    (vllm-mlx does) takes no CPU from the one under test.
    """
    if srv.proc is None or srv.proc.poll() is not None:
        return
    try:
        os.killpg(srv.proc.pid, signal.SIGSTOP if pause else signal.SIGCONT)
    except ProcessLookupError:
        pass


def stop_server(srv: Server) -> None:
    proc = srv.proc
    if proc is None or proc.poll() is not None:
        return
    pause_server(srv, False)
    try:
        os.killpg(proc.pid, signal.SIGTERM)  # the group this script created for it
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=5)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass


# --------------------------------------------------------------------------------------------
# Load generator
# --------------------------------------------------------------------------------------------


def request_body(
    srv: Server, args: argparse.Namespace, prompt: str, max_tokens: int
) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": srv.model_field,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": args.temperature,
    }
    if args.endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    body.update(srv.extra_body)
    return srv.base + path, body


@dataclass
class Window:
    server: str
    concurrency: int
    repetition: int
    order: int
    wall_s: float
    requests: int
    ok: int
    output_tokens: int
    tok_per_s: float
    ttfts: list[float]
    itls: list[float]
    e2es: list[float]
    tpots: list[float]
    short_outputs: int
    finish_stop: int
    connect_retries: int
    errors: list[str]
    server_cpu_s: float | None
    other_servers_cpu_s: float | None
    client_cpu_s: float
    foreign_cpu_s: float | None
    busy_retries: int = 0


def _client_share(
    bodies: Sequence[tuple[str, dict[str, Any]]],
    clients: int,
    first: int,
    stagger_ms: float,
    read_timeout: float,
    retries: int,
) -> tuple[float, float, list[RequestResult], float]:
    """Closed loop: `clients` clients (numbered from `first`, for the stagger) take bodies
    from a shared list until it is empty. (start, end, results, CPU seconds used)."""

    async def go() -> tuple[float, float, list[RequestResult]]:
        results: list[RequestResult] = []
        next_idx = 0
        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
        timeout = httpx.Timeout(connect=10.0, read=read_timeout, write=30.0, pool=None)
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

            async def worker(i: int) -> None:
                nonlocal next_idx
                await asyncio.sleep((first + i) * stagger_ms / 1000.0)
                while next_idx < len(bodies):
                    url, body = bodies[next_idx]
                    next_idx += 1
                    results.append(await stream_request(client, url, body, None, retries))

            t0 = time.perf_counter()
            await asyncio.gather(*(worker(i) for i in range(clients)))
            return t0, time.perf_counter(), results

    cpu0 = time.process_time()
    t0, t1, results = asyncio.run(go())
    return t0, t1, results, time.process_time() - cpu0


_POOL: ProcessPoolExecutor | None = None


async def run_window(
    srv: Server,
    others: Sequence[Server],
    args: argparse.Namespace,
    prompts: Sequence[str],
    concurrency: int,
    max_tokens: int,
) -> tuple[float, list[RequestResult], dict[str, float | None]]:
    """Closed loop: ``concurrency`` clients take prompts from a shared list until it is
    empty, spread over `client_processes` processes (each with its share of the list).
    The window runs from the first client's start to the last one's end (perf_counter is
    the machine's monotonic clock, the same in every process)."""
    global _POOL
    bodies = [request_body(srv, args, p, max_tokens) for p in prompts]
    n = client_processes(args.client_processes, concurrency)
    sys0 = system_busy_seconds()
    cpu0 = srv.cpu_seconds()
    others0 = [o.cpu_seconds() for o in others]
    if n == 1:
        t0, t1, results, client_cpu = await asyncio.to_thread(
            _client_share,
            bodies,
            concurrency,
            0,
            args.stagger_ms,
            args.request_timeout,
            args.retries,
        )
    else:
        if _POOL is None or _POOL._max_workers < n:  # type: ignore[attr-defined]
            if _POOL is not None:
                _POOL.shutdown()
            _POOL = await start_pool(n)
        share = shares(concurrency, n)
        firsts = [sum(share[:i]) for i in range(n)]
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(
            *(
                loop.run_in_executor(
                    _POOL,
                    _client_share,
                    bodies[i::n],
                    share[i],
                    firsts[i],
                    args.stagger_ms,
                    args.request_timeout,
                    args.retries,
                )
                for i in range(n)
            )
        )
        t0, t1 = min(p[0] for p in parts), max(p[1] for p in parts)
        results = [r for p in parts for r in p[2]]
        client_cpu = sum(p[3] for p in parts)
    wall = t1 - t0
    sys1 = system_busy_seconds()
    cpu1 = srv.cpu_seconds()
    others1 = [o.cpu_seconds() for o in others]
    server_cpu = None if cpu0 is None or cpu1 is None else cpu1 - cpu0
    other_cpu: float | None = 0.0
    for a, b in zip(others0, others1, strict=True):
        if a is None or b is None or other_cpu is None:
            other_cpu = None
        else:
            other_cpu += b - a
    # Everything else on the machine (other users' jobs): busy CPU not ours.
    foreign = None
    if sys0 is not None and sys1 is not None and server_cpu is not None:
        foreign = max(0.0, (sys1 - sys0) - server_cpu - (other_cpu or 0.0) - client_cpu)
    return (
        wall,
        results,
        {
            "server": server_cpu,
            "others": other_cpu,
            "client": client_cpu,
            "foreign": foreign,
        },
    )


def summarize_window(
    srv: Server,
    concurrency: int,
    rep: int,
    order: int,
    wall: float,
    results: list[RequestResult],
    cpu: dict[str, float | None],
    max_tokens: int,
) -> Window:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    itls = [x for r in ok for x in r.itls]
    errors = sorted({r.error for r in results if r.error})
    return Window(
        server=srv.name,
        concurrency=concurrency,
        repetition=rep,
        order=order,
        wall_s=wall,
        requests=len(results),
        ok=len(ok),
        output_tokens=tokens,
        tok_per_s=tokens / wall if wall > 0 else 0.0,
        ttfts=[r.ttft for r in ok if r.ttft is not None],
        itls=itls,
        e2es=[r.e2e for r in ok if r.e2e is not None],
        # Time per output token after the first: robust to a server that sends (or a socket
        # read that delivers) several tokens at once, which ITL counts as zero gaps.
        tpots=[
            (r.e2e - r.ttft) / (r.output_tokens - 1)
            for r in ok
            if r.e2e is not None and r.ttft is not None and r.output_tokens > 1
        ],
        short_outputs=sum(1 for r in ok if r.output_tokens < max_tokens),
        finish_stop=sum(1 for r in ok if r.finish_reason == "stop"),
        connect_retries=sum(r.connect_retries for r in results),
        errors=errors[:5],
        server_cpu_s=cpu["server"],
        other_servers_cpu_s=cpu["others"],
        client_cpu_s=float(cpu["client"] or 0.0),
        foreign_cpu_s=cpu["foreign"],
    )


# --------------------------------------------------------------------------------------------
# Statistics and reports
# --------------------------------------------------------------------------------------------


def aggregate(windows: Sequence[Window]) -> dict[str, Any]:
    """Pool one server's windows at one concurrency (all repetitions)."""
    tps = [w.tok_per_s for w in windows]
    ttfts = [x for w in windows for x in w.ttfts]
    itls = [x for w in windows for x in w.itls]
    e2es = [x for w in windows for x in w.e2es]
    tpots = [x for w in windows for x in w.tpots]
    wall = sum(w.wall_s for w in windows)
    scpu = [w.server_cpu_s for w in windows]
    out: dict[str, Any] = {
        "tok_per_s": statistics.median(tps) if tps else 0.0,
        "tok_per_s_reps": tps,
        "windows": len(windows),
        "busy_retries": sum(w.busy_retries for w in windows),
        "requests": sum(w.requests for w in windows),
        "ok": sum(w.ok for w in windows),
        "output_tokens": sum(w.output_tokens for w in windows),
        "short_outputs": sum(w.short_outputs for w in windows),
        "finish_stop": sum(w.finish_stop for w in windows),
        "connect_retries": sum(w.connect_retries for w in windows),
        "errors": sorted({e for w in windows for e in w.errors})[:5],
        "client_cpu_pct": 100.0 * sum(w.client_cpu_s for w in windows) / wall if wall else None,
        "server_cpu_pct": (
            100.0 * sum(x for x in scpu if x is not None) / wall
            if wall and all(x is not None for x in scpu)
            else None
        ),
        "foreign_cpu_pct": (
            100.0 * sum(w.foreign_cpu_s or 0.0 for w in windows) / wall if wall else None
        ),
        "idle_servers_cpu_pct": (
            100.0 * sum(w.other_servers_cpu_s or 0.0 for w in windows) / wall if wall else None
        ),
    }
    for name, xs in (("ttft", ttfts), ("itl", itls), ("tpot", tpots), ("e2e", e2es)):
        for q in (50, 90, 99):
            v = pct(xs, q)
            out[f"{name}_p{q}_ms"] = None if v is None else v * 1000.0
        out[f"{name}_samples"] = len(xs)
    return out


def fmt(v: float | None, nd: int = 1) -> str:
    return "-" if v is None else f"{v:,.{nd}f}"


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def fingerprint(args: argparse.Namespace, servers: Sequence[Server]) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        if sys.platform == "darwin":
            try:
                cpu = subprocess.run(
                    ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True
                ).stdout.strip()
            except OSError:
                pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    try:
        import mlx.core as mx

        device = str(mx.default_device())
    except Exception:  # noqa: BLE001 - only a label
        device = "?"
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "cores": usable,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "mlx": package_version("mlx"),
        "mlx_lm": package_version("mlx-lm"),
        "mlx_device": device,
        "blas": args.blas_lib or "MLX bundled",
        "pippin_commit": commit,
        "server_versions": {s.name: s.version for s in servers},
    }


def build_tables(
    summary: dict[int, dict[str, dict[str, Any]]], names: Sequence[str], markdown: bool
) -> str:
    peers = [n for n in names if n != "pippin"]
    has_pippin = "pippin" in names
    header = [
        "conc",
        "server",
        "tok/s",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "TPOT p50",
        "short/err",
    ]
    if has_pippin:
        header += ["pippin tok/s ×", "TTFT p50 ×", "TPOT p50 ×"]
    rows: list[list[str]] = []
    for conc in sorted(summary):
        for name in names:
            a = summary[conc].get(name)
            if a is None:
                continue
            row = [
                str(conc),
                name,
                fmt(a["tok_per_s"]),
                fmt(a["ttft_p50_ms"]) + " ms",
                fmt(a["ttft_p99_ms"]) + " ms",
                fmt(a["itl_p50_ms"], 2) + " ms",
                fmt(a["itl_p99_ms"], 2) + " ms",
                fmt(a["tpot_p50_ms"], 2) + " ms",
                f"{a['short_outputs']}/{a['requests'] - a['ok']}",
            ]
            if has_pippin:
                p = summary[conc].get("pippin")
                if name in peers and p is not None:
                    row += [
                        ratio(p["tok_per_s"], a["tok_per_s"]),
                        ratio(p["ttft_p50_ms"], a["ttft_p50_ms"]),
                        ratio(p["tpot_p50_ms"], a["tpot_p50_ms"]),
                    ]
                else:
                    row += ["", "", ""]
            rows.append(row)
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)
    ]
    out = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(out)


def foreign_note(summary: dict[int, dict[str, dict[str, Any]]]) -> str:
    vals = [a["foreign_cpu_pct"] for by in summary.values() for a in by.values()]
    vals = [v for v in vals if v is not None]
    if not vals:
        return ""
    retried = sum(a["busy_retries"] for by in summary.values() for a in by.values())
    return (
        f"Other processes on the machine used {statistics.mean(vals):.0f}% of a core on "
        f"average during the kept windows (max {max(vals):.0f}%); {retried} windows were "
        "measured again because of them."
    )


def markdown_report(
    args: argparse.Namespace,
    fp: dict[str, Any],
    minfo: dict[str, Any],
    summary: dict[int, dict[str, dict[str, Any]]],
    names: Sequence[str],
    skipped: dict[str, str],
    command: str,
) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in fp["server_versions"].items())
    lines = [
        f"### Serving, {args.endpoint} endpoint, {fp['date']}",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {fp['cpu']}, {fp['cores']} cores, {fp['platform']}, MLX device "
        f"{fp['mlx_device']}, BLAS {fp['blas']}; Python {fp['python']}, mlx {fp['mlx']}, "
        f"mlx-lm {fp['mlx_lm']}; "
        f"servers: {versions}; pippin commit {fp['pippin_commit']}.",
        "",
        f"Model: {minfo.get('architecture')} hidden {minfo.get('hidden_size')}, "
        f"{minfo.get('layers')} layers, vocab {minfo.get('vocab_size')}"
        + (f", {minfo['parameters'] / 1e6:.1f}M params" if minfo.get("parameters") else "")
        + f". Workload: streaming, prompts of ~{args.prompt_tokens} tokens (random words, all "
        f"distinct), {args.max_tokens} output tokens, temperature {args.temperature}, "
        f"{args.repetitions} interleaved repetitions; tok/s is the median over repetitions, "
        "latency percentiles pool all requests. Ratios are pippin / peer (tok/s: higher is "
        "better for pippin; latency: lower is). ITL: gaps between streamed content chunks; "
        "TPOT: per request, (end to end - TTFT) / (output tokens - 1). `short/err`: requests "
        "that ended before max_tokens (end token; only servers without ignore_eos) / failed. "
        "Idle servers are paused (SIGSTOP) while another is measured. " + foreign_note(summary),
        "",
        build_tables(summary, names, markdown=True),
    ]
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + "."]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="model folder (default: the --build-model folder)")
    p.add_argument(
        "--build-model",
        type=Path,
        metavar="DIR",
        help="build a tiny random Qwen3 model in DIR (if it has none) and use it",
    )
    p.add_argument("--rebuild", action="store_true", help="rebuild the --build-model folder")
    p.add_argument("--build-only", action="store_true", help="only build the model, then exit")
    p.add_argument(
        "--servers",
        default=",".join(ALL_SERVERS),
        help="comma-separated subset of: " + ", ".join(ALL_SERVERS),
    )
    p.add_argument("--python", default=sys.executable, help="python for pippin and mlx_lm")
    p.add_argument("--vllm-mlx-python", default=DEFAULT_VLLM_MLX_PYTHON)
    p.add_argument("--pippin-args", default="", help="extra arguments for pippin serve")
    p.add_argument("--mlx-lm-args", default="", help="extra arguments for mlx_lm.server")
    p.add_argument(
        "--vllm-mlx-args",
        default="--continuous-batching --stream-interval 1",
        help="extra arguments for vllm-mlx serve",
    )
    p.add_argument(
        "--blas",
        default="auto",
        help="BLAS for MLX on Linux CPU, the same for every server: auto (the OpenBLAS pippin "
        "preloads, also preloaded into the peers), none (MLX's bundled reference BLAS for all), "
        "or a library path",
    )
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    p.add_argument("--repetitions", type=int, default=2)
    p.add_argument(
        "--requests-per-client",
        type=int,
        default=3,
        help="requests per window = max(concurrency * this, --min-requests)",
    )
    p.add_argument("--min-requests", type=int, default=12)
    p.add_argument(
        "--warmup-requests",
        type=int,
        default=1,
        help="warm-up requests per client at each concurrency before timing",
    )
    p.add_argument(
        "--max-warmup-requests",
        type=int,
        default=None,
        help="cap on the warm-up requests at each concurrency",
    )
    p.add_argument("--stagger-ms", type=float, default=3.0, help="delay between client starts")
    p.add_argument("--retries", type=int, default=20, help="retries of a refused/reset connect")
    p.add_argument(
        "--client-processes",
        type=int,
        default=0,
        help="spread each window's clients over this many processes (0: one per 64 clients)",
    )
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--no-pause-idle",
        action="store_true",
        help="leave idle servers running (by default they are SIGSTOPped while another is "
        "measured)",
    )
    p.add_argument(
        "--max-foreign-cpu",
        type=float,
        default=30.0,
        help="a window during which processes not started by this run used more than this "
        "percent of one core is measured again (the machine is shared)",
    )
    p.add_argument("--busy-retries", type=int, default=1, help="at most this many re-measures")
    p.add_argument("--busy-wait", type=float, default=10.0, help="seconds before a re-measure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the full results as JSON here")
    p.add_argument("--md", type=Path, help="write the Markdown snippet here")
    p.add_argument("--log-dir", type=Path, help="server logs (default: a temporary folder)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "python " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(__file__)] + list(argv or sys.argv[1:])
    )

    if args.build_model is not None:
        if args.rebuild or not (args.build_model / "config.json").exists():
            t0 = time.perf_counter()
            info = build_model(args.build_model, seed=args.seed)
            print(
                f"built {info['parameters'] / 1e6:.2f}M-param model in {args.build_model} "
                f"({time.perf_counter() - t0:.1f} s)",
                flush=True,
            )
        if args.model is None:
            args.model = args.build_model
    if args.build_only:
        return 0
    if args.model is None:
        print("error: give --model DIR or --build-model DIR", file=sys.stderr)
        return 2
    args.model = args.model.resolve()

    args.blas_lib = resolve_blas(args.blas)
    print(f"BLAS for every server: {args.blas_lib or 'MLX bundled'}", flush=True)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="serve_bench_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs in {log_dir}", flush=True)

    servers: list[Server] = []
    skipped: dict[str, str] = {}
    try:
        for name in names:
            made = make_server(name, args, log_dir)
            if isinstance(made, str):
                skipped[name] = made
                print(f"[{name}] skipped: {made}", flush=True)
                continue
            print(f"[{name}] starting: {' '.join(made.cmd)}", flush=True)
            if start_server(made, args.startup_timeout):
                print(f"[{name}] ready in {made.startup_s:.1f} s on port {made.port}", flush=True)
                servers.append(made)
            else:
                skipped[name] = f"{made.error} (log: {made.log_path})"
                print(f"[{name}] failed: {skipped[name]}", flush=True)
                stop_server(made)
        if not servers:
            print("no server to measure", file=sys.stderr)
            return 1
        return asyncio.run(run_all(args, servers, skipped, levels, command))
    finally:
        for srv in servers:
            stop_server(srv)


@contextlib.contextmanager
def paused_others(
    args: argparse.Namespace, servers: Sequence[Server], active: Server
) -> Iterator[None]:
    others = [] if args.no_pause_idle else [s for s in servers if s is not active]
    for s in others:
        pause_server(s, True)
    try:
        yield
    finally:
        for s in others:
            pause_server(s, False)


async def run_all(
    args: argparse.Namespace,
    servers: list[Server],
    skipped: dict[str, str],
    levels: list[int],
    command: str,
) -> int:
    prompts = PromptMaker(args.model, args.prompt_tokens, args.seed)
    names = [s.name for s in servers]
    sample, sample_len = prompts.make("sample")
    print(f"prompts: ~{sample_len} tokens of random words, e.g. {sample[:60]!r}...", flush=True)

    # Warm-up: every server, every concurrency, with prompts no timed window uses.
    for srv in servers:
        for conc in levels:
            n = conc * args.warmup_requests
            if args.max_warmup_requests is not None:
                n = min(n, args.max_warmup_requests)
            ps = [prompts.make(f"warmup:{srv.name}:{conc}:{i}")[0] for i in range(n)]
            with paused_others(args, servers, srv):
                wall, results, _ = await run_window(srv, [], args, ps, conc, args.max_tokens)
            bad = [r for r in results if not r.ok]
            print(
                f"[{srv.name}] warm-up c={conc}: {len(results)} requests in {wall:.1f} s"
                + (f", {len(bad)} failed: {bad[0].error}" if bad else ""),
                flush=True,
            )

    # Idle CPU of every server over one second: a busy-polling idle server would steal CPU
    # from the one being measured.
    idle: dict[str, float | None] = {}
    before = {s.name: s.cpu_seconds() for s in servers}
    await asyncio.sleep(1.0)
    for s in servers:
        a, b = before[s.name], s.cpu_seconds()
        idle[s.name] = None if a is None or b is None else 100.0 * (b - a)
    print("idle CPU %: " + ", ".join(f"{k} {fmt(v)}" for k, v in idle.items()), flush=True)

    windows: list[Window] = []
    for rep in range(args.repetitions):
        for ci, conc in enumerate(levels):
            n_req = max(conc * args.requests_per_client, args.min_requests)
            # The same prompts for every server in this window; new ones for every window.
            ps = [prompts.make(f"r{rep}:c{conc}:{i}")[0] for i in range(n_req)]
            k = (rep + ci) % len(servers)
            order = servers[k:] + servers[:k]
            for pos, srv in enumerate(order):
                others = [o for o in servers if o is not srv]
                attempt = 0
                while True:
                    if attempt:  # fresh prompts, so a retry does not hit a prefix cache
                        ps_try = [
                            prompts.make(f"r{rep}:c{conc}:{srv.name}:a{attempt}:{i}")[0]
                            for i in range(n_req)
                        ]
                    else:
                        ps_try = ps
                    with paused_others(args, servers, srv):
                        wall, results, cpu = await run_window(
                            srv, others, args, ps_try, conc, args.max_tokens
                        )
                    foreign = cpu["foreign"]
                    busy = foreign is not None and 100.0 * foreign / wall > args.max_foreign_cpu
                    if not busy or attempt >= args.busy_retries:
                        break
                    attempt += 1
                    print(
                        f"rep {rep} c={conc:<3} {srv.name:<9} other processes took "
                        f"{100.0 * foreign / wall:.0f}% CPU; measuring again in "
                        f"{args.busy_wait:.0f} s ({attempt}/{args.busy_retries})",
                        flush=True,
                    )
                    await asyncio.sleep(args.busy_wait)
                w = summarize_window(srv, conc, rep, pos, wall, results, cpu, args.max_tokens)
                w.busy_retries = attempt
                windows.append(w)
                print(
                    f"rep {rep} c={conc:<3} {srv.name:<9} {w.tok_per_s:8.1f} tok/s  "
                    f"TTFT p50 {fmt(pct(w.ttfts, 50) and pct(w.ttfts, 50) * 1000)} ms  "
                    f"ITL p50 {fmt((pct(w.itls, 50) or 0) * 1000, 2)} ms  "
                    f"TPOT p50 {fmt((pct(w.tpots, 50) or 0) * 1000, 2)} ms  "
                    f"ok {w.ok}/{w.requests}  short {w.short_outputs}  "
                    f"retries {w.connect_retries}  client CPU "
                    f"{100 * w.client_cpu_s / w.wall_s:.0f}%  foreign CPU "
                    f"{fmt(w.foreign_cpu_s and 100 * w.foreign_cpu_s / w.wall_s, 0)}%"
                    + (f"  errors: {w.errors[0]}" if w.errors else ""),
                    flush=True,
                )

    summary: dict[int, dict[str, dict[str, Any]]] = {}
    for conc in levels:
        summary[conc] = {}
        for name in names:
            ws = [w for w in windows if w.concurrency == conc and w.server == name]
            if ws:
                summary[conc][name] = aggregate(ws)

    fp = fingerprint(args, servers)
    minfo = model_info(args.model)
    print()
    print(build_tables(summary, names, markdown=False))
    for conc in levels:
        for name in names:
            a = summary[conc].get(name)
            if a is None:
                continue
            print(
                f"c={conc} {name}: client CPU {fmt(a['client_cpu_pct'])}%, server CPU "
                f"{fmt(a['server_cpu_pct'])}%, idle servers {fmt(a['idle_servers_cpu_pct'])}%, "
                f"other processes {fmt(a['foreign_cpu_pct'])}%, "
                f"stop-finished {a['finish_stop']}, connect retries {a['connect_retries']}, "
                f"windows re-measured {a['busy_retries']}"
                + (f", errors: {a['errors']}" if a["errors"] else "")
            )
    md = markdown_report(args, fp, minfo, summary, names, skipped, command)
    print()
    print(md)
    if args.md:
        args.md.write_text(md + "\n")
    if args.out:
        result = {
            "command": command,
            "fingerprint": fp,
            "model": minfo,
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "servers": {
                s.name: {"cmd": s.cmd, "startup_s": s.startup_s, "idle_cpu_pct": idle[s.name]}
                for s in servers
            },
            "skipped": skipped,
            "summary": {str(c): v for c, v in summary.items()},
            "windows": [
                {k: v for k, v in asdict(w).items() if k not in ("ttfts", "itls", "e2es")}
                for w in windows
            ],
            "markdown": md,
        }
        args.out.write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
