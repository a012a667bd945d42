"""Running a benchmark: warm-up, then for each repetition and load level one measurement
window per server, the servers taking turns (rotated each window) so that drift on the
machine touches them all alike. Every server gets the same prompts in a window.

Load levels are either concurrencies (closed loop: that many clients, each sending its
next request when the last one ends) or request rates (open loop: sessions start at
Poisson-distributed times, at that many per second on average).
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import os
import random
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

import httpx

from pippin.bench.client import RequestResult, stream_request
from pippin.bench.fingerprint import machine, server_info
from pippin.bench.progress import Progress
from pippin.bench.scrape import (
    CacheStats,
    SpecStats,
    TraceStats,
    cache_hit_rate,
    decode_traces,
    scrape,
    spec_acceptance,
)
from pippin.bench.sessions import make_sessions
from pippin.bench.workload import Session, Workload

Mode = Literal["concurrency", "rate"]


@dataclass
class Target:
    name: str
    base_url: str  # scheme://host:port, without /v1
    model: str | None = None  # None: the first of its /v1/models
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class Watch(Protocol):
    """Told whose turn it is (`begin`, before a server's warm-up and each of its windows)
    and when the window ends (`end`, which may return figures to keep with the window, such
    as CPU use). `pippin.bench.servers.ServerSet` is one: it pauses the idle servers."""

    def begin(self, name: str) -> None: ...

    def end(self, name: str) -> dict[str, float] | None: ...


@dataclass
class BenchConfig:
    targets: list[Target]
    workload: Workload
    mode: Mode = "concurrency"
    levels: list[float] = field(default_factory=lambda: [1.0])
    num_requests: int | None = None  # per window; None: from the level
    requests_per_client: float = 4.0  # closed loop, num_requests None: per client a window
    warmup: int = 2  # requests per server before measuring
    repetitions: int = 1
    seed: int = 0
    max_concurrency: int | None = None  # rate mode: cap on requests in flight
    timeout: float = 600.0
    progress: bool = True
    # Closed-loop clients are spread over this many processes (0: one per 64 clients, up
    # to the cores but one), so the client's own CPU does not cap what a fast server shows.
    client_processes: int = 0
    # Closed loop: seconds between the starts of a window's clients (a ramp, for servers
    # that reset a burst of connects), and retries of a refused or reset connect.
    stagger: float = 0.0
    connect_retries: int = 3
    watch: Watch | None = None

    def processes_at(self, level: float) -> int:
        if self.mode != "concurrency":
            return 1
        return client_processes(self.client_processes, int(level))

    def requests_at(self, level: float) -> int:
        if self.num_requests is not None:
            return self.num_requests
        if self.mode == "concurrency" and self.workload.prompt_source == "agent":
            return int(level) * self.workload.turns  # a session per client, all at once
        # Enough for each client to send a few; in rate mode about ten seconds' worth.
        if self.mode == "concurrency":
            return max(8, math.ceil(self.requests_per_client * level))
        return max(16, int(10 * level))


def client_processes(requested: int, clients: int) -> int:
    """Processes a closed loop of `clients` clients is spread over: `requested`, or (0) one
    per 64 clients, up to the cores but one. One Python client process saturates its core
    at a few thousand streamed tokens/s, which a fast server exceeds."""
    n = requested or min(math.ceil(clients / 64), (os.cpu_count() or 2) - 1)
    return max(1, min(n, clients))


def shares(clients: int, n: int) -> list[int]:
    """`clients` dealt out to `n` processes as evenly as they go."""
    return [clients // n + (i < clients % n) for i in range(n)]


async def start_pool(n: int) -> ProcessPoolExecutor:
    """`n` spawned client processes, all started now (spawning imports httpx), not inside
    a measured window."""
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()
    await asyncio.gather(*(loop.run_in_executor(pool, time.sleep, 0.2) for _ in range(n)))
    return pool


@dataclass
class Window:
    target: str
    level: float
    rep: int
    wall: float
    results: list[RequestResult]
    cache: CacheStats | None = None
    spec: SpecStats | None = None  # speculative decoding's proposals, where it reports them
    traces: TraceStats | None = None  # pippin's decode graphs traced in the window
    cpu: dict[str, float] | None = None  # from the watch: shares of a core


@dataclass
class BenchRun:
    config: BenchConfig
    machine: dict[str, Any]
    servers: list[dict[str, Any]]
    windows: list[Window]
    started: str
    # Stopped (SIGINT, a cancel) while measuring: `windows` are those that finished.
    interrupted: bool = False


def _body(
    t: Target, w: Workload, prompt: Any, max_tokens: int, tools: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": t.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": w.temperature,
        ("messages" if w.api == "chat" else "prompt"): prompt,
    }
    if tools:
        body["tools"] = tools
    if w.ignore_eos:
        body["ignore_eos"] = True
    body.update(t.extra_body)
    return body


async def run_session(
    client: httpx.AsyncClient,
    t: Target,
    w: Workload,
    session: Session,
    done: Callable[[RequestResult], None],
    retries: int = 3,
) -> None:
    """The session's turns one after another, each with the conversation so far."""
    path = "/v1/chat/completions" if w.api == "chat" else "/v1/completions"
    messages: list[dict[str, Any]] = []
    if session.system is not None:
        messages.append({"role": "system", "content": session.system})
    text = ""
    for i, turn in enumerate(session.turns):
        if w.api == "chat":
            if turn.call is not None and messages and messages[-1]["role"] == "assistant":
                # The last answer becomes the call of a tool, whose result follows.
                messages[-1] = {**messages[-1], "tool_calls": [turn.call]}
                msg = {"role": "tool", "tool_call_id": turn.call["id"], "content": turn.text}
            else:
                msg = {"role": "user", "content": turn.text}
            messages.append(msg)
            prompt: Any = list(messages)
        else:
            text = f"{text}\n{turn.text}" if text else turn.text
            prompt = text
        body = _body(t, w, prompt, turn.max_tokens, session.tools)
        res = await stream_request(client, t.base_url + path, body, t.headers(), retries)
        res.turn = i
        done(res)
        if not res.ok:
            return  # the rest of the session would build on a missing answer
        if w.api == "chat":
            messages.append({"role": "assistant", "content": res.text})
        else:
            text += res.text


async def run_window(
    client: httpx.AsyncClient,
    t: Target,
    cfg: BenchConfig,
    level: float,
    sessions: list[Session],
    seed: str,
    progress: Progress,
    first: int = 0,
) -> Window:
    """One window; `first` numbers this process's first client (for the stagger)."""
    results: list[RequestResult] = []
    end = 0.0

    def done(res: RequestResult) -> None:
        nonlocal end
        results.append(res)
        end = time.perf_counter()
        progress.advance()

    w = cfg.workload
    start = time.perf_counter()
    if cfg.mode == "concurrency":
        queue = deque(sessions)

        async def worker(i: int) -> None:
            if cfg.stagger:
                await asyncio.sleep((first + i) * cfg.stagger)
            while queue:
                await run_session(client, t, w, queue.popleft(), done, cfg.connect_retries)

        await asyncio.gather(*(worker(i) for i in range(max(1, int(level)))))
    else:
        limit = asyncio.Semaphore(cfg.max_concurrency or 1 << 30)

        async def limited(s: Session) -> None:
            async with limit:
                await run_session(client, t, w, s, done, cfg.connect_retries)

        tasks = []
        for s, gap in zip(sessions, arrival_gaps(seed, level, len(sessions)), strict=True):
            tasks.append(asyncio.create_task(limited(s)))
            await asyncio.sleep(gap)
        await asyncio.gather(*tasks)
    return Window(t.name, level, 0, max(end - start, 1e-9), results)


def arrival_gaps(seed: str, rate: float, n: int) -> list[float]:
    """Seconds after each of `n` sessions before the next starts: Poisson arrivals at
    `rate` a second, the same for every server of a window (seeded)."""
    rng = random.Random(f"arrivals|{seed}")
    return [rng.expovariate(rate) for _ in range(n)]


def _client_part(
    t: Target, cfg: BenchConfig, clients: int, first: int, sessions: list[Session]
) -> Window:
    """One client process's share of a closed-loop window (run in a worker process)."""

    async def run() -> Window:
        timeout = httpx.Timeout(cfg.timeout, connect=30)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            await _open_connections(client, t, clients)
            return await run_window(
                client, t, cfg, clients, sessions, "", Progress(0, False), first
            )

    return asyncio.run(run())


async def _open_connections(client: httpx.AsyncClient, t: Target, n: int) -> None:
    """`n` connections opened before a client process's window, as the main process's
    warm-up opens its own: a fresh process's first request otherwise also pays for its
    connection and httpx's first use (25-50 ms seen), which is the client, not the server."""

    async def one() -> None:
        try:
            await client.get(f"{t.base_url}/v1/models", headers=t.headers(), timeout=30)
        except httpx.HTTPError:
            pass  # the window's own requests will say what is wrong

    await asyncio.gather(*(one() for _ in range(n)))


async def run_window_in(
    pool: ProcessPoolExecutor, t: Target, cfg: BenchConfig, level: float, sessions: list[Session]
) -> Window:
    """A closed-loop window with its clients and sessions dealt out to the pool's processes.
    The window runs from the first process's start to the last one's end (perf_counter is
    the machine's monotonic clock, the same in every process)."""
    n = cfg.processes_at(level)
    loop = asyncio.get_running_loop()
    share = shares(int(level), n)
    sub = replace(cfg, watch=None)  # what goes to the worker processes
    parts = await asyncio.gather(
        *(
            loop.run_in_executor(pool, _client_part, t, sub, k, sum(share[:i]), sessions[i::n])
            for i, k in enumerate(share)
        )
    )
    results = [r for p in parts for r in p.results]
    start = min(r.start for r in results) if results else 0.0
    end = max(r.start + (r.e2e or 0.0) for r in results) if results else 0.0
    return Window(t.name, level, 0, max(end - start, 1e-9), results)


async def _resolve_model(client: httpx.AsyncClient, t: Target) -> None:
    if t.model:
        return
    r = await client.get(f"{t.base_url}/v1/models", headers=t.headers(), timeout=30)
    r.raise_for_status()
    data = r.json().get("data") or []
    if not data:
        raise RuntimeError(f"{t.name}: /v1/models lists no model; pass --model")
    t.model = data[0]["id"]


async def run_benchmark(cfg: BenchConfig) -> BenchRun:
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    turns = cfg.workload.turns
    per_rep = sum(math.ceil(cfg.requests_at(lv) / turns) * turns for lv in cfg.levels)
    total = (per_rep * cfg.repetitions + cfg.warmup) * len(cfg.targets)
    progress = Progress(total, cfg.progress)
    timeout = httpx.Timeout(cfg.timeout, connect=30)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        servers = []
        for t in cfg.targets:
            if cfg.watch:
                cfg.watch.begin(t.name)
            await _resolve_model(client, t)
            info = await server_info(client, t.base_url, t.headers())
            servers.append({"name": t.name, "model": t.model, **info})
        for t in cfg.targets:
            if cfg.warmup:
                if cfg.watch:
                    cfg.watch.begin(t.name)
                await _warm_up(client, t, cfg, progress)
        windows: list[Window] = []
        most = max((cfg.processes_at(lv) for lv in cfg.levels), default=1)
        pool = await start_pool(most) if most > 1 else None
        interrupted = False
        try:
            await _measure(client, cfg, progress, pool, windows)
        except asyncio.CancelledError:
            # SIGINT (`timeout -s INT` in the GPU scripts) or a caller's cancel while
            # measuring: the windows that finished are still reported, not lost.
            interrupted = True
        finally:
            if pool is not None:
                pool.shutdown(cancel_futures=True)
    progress.close()
    return BenchRun(cfg, machine(), servers, windows, started, interrupted)


async def _measure(
    client: httpx.AsyncClient,
    cfg: BenchConfig,
    progress: Progress,
    pool: ProcessPoolExecutor | None,
    windows: list[Window],
) -> None:
    for rep in range(cfg.repetitions):
        for li, level in enumerate(cfg.levels):
            seed = f"{cfg.seed}|{rep}|{li}"
            sessions = make_sessions(cfg.workload, cfg.requests_at(level), seed)
            k = (rep + li) % len(cfg.targets)
            for t in cfg.targets[k:] + cfg.targets[:k]:
                progress.start(f"{t.name} {cfg.mode} {level:g} rep {rep + 1}")
                if cfg.watch:
                    cfg.watch.begin(t.name)
                before = await scrape(client, t.base_url, t.headers())
                if pool is not None and cfg.processes_at(level) > 1:
                    win = await run_window_in(pool, t, cfg, level, sessions)
                    progress.advance(len(win.results))
                else:
                    win = await run_window(client, t, cfg, level, sessions, seed, progress)
                after = await scrape(client, t.base_url, t.headers())
                win.rep, win.cache = rep, cache_hit_rate(before, after)
                win.spec = spec_acceptance(before, after)
                win.traces = decode_traces(before, after)
                win.cpu = cfg.watch.end(t.name) if cfg.watch else None
                windows.append(win)


async def _warm_up(client: httpx.AsyncClient, t: Target, cfg: BenchConfig, p: Progress) -> None:
    """Single-turn requests, as many at once as the highest level sends (up to the number
    of warm-up requests), so connections are open before the first window."""
    p.start(f"warm-up {t.name}")
    one_turn = replace(cfg.workload, turns=1)
    sessions = deque(make_sessions(one_turn, cfg.warmup, seed=f"warmup|{cfg.seed}"))
    width = cfg.max_concurrency or int(max(cfg.levels)) if cfg.mode == "rate" else max(cfg.levels)

    async def worker(i: int) -> None:
        await asyncio.sleep(i * cfg.stagger)
        while sessions:
            await run_session(
                client, t, one_turn, sessions.popleft(), lambda _: p.advance(), cfg.connect_retries
            )

    await asyncio.gather(*(worker(i) for i in range(max(1, min(int(width), cfg.warmup)))))
