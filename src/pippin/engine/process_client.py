"""`EngineClient` with the engine in a process of its own (`pippin serve --engine-process`).

In one process the engine thread and the event loop share the GIL: under hundreds of
streams the loop (framing, parsing, sending chunks) takes it from the engine between
steps. Here the model, the scheduler and detokenizing run in a child process, with its
own GIL; the API process keeps the tokenizer and templates, and talks to it over a pipe:

- API → engine: ``("add", id, prompt, params)``, ``("abort", id)``,
  ``("call", n, name, args)`` (`EngineLoop.CALLS`), ``("stop",)``.
- engine → API: ``("ready", max_model_len, stats, info)`` or ``("failed", message)`` once;
  then ``("outs", outputs, stats, events)`` per delivery (one pickle for a whole step's
  outputs; ``events`` replays the scheduler and step timings into the API side's
  metrics) and ``("result", n, ok, value)``; ``("exiting", why)`` just before it ends
  on purpose (a tensor-parallel group lost a rank).

The child runs the same `EngineLoop` as the in-process client, on its main thread. What
the child needs from the layers above the engine (logging as the API process logs, a
grammar compiler to rebuild constraints: `Constraint.__reduce__`) comes in as picklable
hooks, so the engine imports nothing above it.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import signal
import threading
from collections.abc import AsyncIterator, Callable
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

from pippin.engine.config import EngineConfig
from pippin.engine.core import check_prompt
from pippin.engine.loop import EngineLoop, LoraRecord
from pippin.engine.observer import EngineObserver
from pippin.engine.streams import OutputStreams
from pippin.engine.types import EngineError, RequestOutput, SamplingParams
from pippin.store.loaded import LoadedModel

log = logging.getLogger(__name__)

MAX_RESTARTS = 5
RESTART_BACKOFF_S = 1.0

# Run in the child before it loads the model, and once it has (both picklable).
OnStart = Callable[[], None]
OnLoaded = Callable[[LoadedModel], None]
ChildMain = Callable[
    [Connection, dict[str, Any], EngineConfig, OnStart | None, OnLoaded | None], None
]


def _lost_rank(pids: dict[int, int]) -> str | None:
    """Why a tensor-parallel engine process ended, if it could not say: the first of its
    other ranks whose process is gone (exited, or a zombie), else None."""
    for rank, pid in sorted(pids.items()):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = b"X"  # no such process (or no /proc: then every rank reads as gone)
        if state in (b"Z", b"X"):
            return f"tensor parallel: rank {rank} is gone (its process ended)"
    return None


class _Pipe:
    """One end of the pipe; sends from several threads, one message at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: tuple[Any, ...], timeout: float = -1) -> bool:
        """False if the other process is gone (or the pipe stayed busy for `timeout`
        seconds, when given)."""
        if not self._lock.acquire(timeout=timeout):
            return False
        try:
            self.conn.send(msg)
        except (OSError, ValueError):
            return False
        finally:
            self._lock.release()
        return True


class ProcessClient:
    """The engine process loads the model itself from `load_kwargs` (the arguments of
    `pippin.store.loader.load_model`)."""

    def __init__(
        self,
        load_kwargs: dict[str, Any],
        config: EngineConfig,
        observer: EngineObserver | None = None,
        *,
        on_start: OnStart | None = None,
        on_loaded: OnLoaded | None = None,
        child_main: ChildMain | None = None,
    ) -> None:
        self.load_kwargs = load_kwargs
        # What the engine process runs: `_child_main`, or rank 0 of a tensor-parallel
        # group (`tp.rank0.child_main`), which takes the same arguments.
        self.child_main = child_main or _child_main
        self.config = config
        self.observer = observer or EngineObserver()
        self.streams = OutputStreams(self.observer, config.request_timeout_s)
        self.hooks = (on_start, on_loaded)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None
        self._pipe: _Pipe | None = None
        self._ready = False
        self._exit_reason: str | None = None  # its "exiting" message, if it sent one
        # Tensor parallel: the other ranks' processes ({rank: pid}, from its "ready"), so
        # that an engine process that died without saying why (a collective that failed
        # aborts it) can still be told apart from a rank that was lost.
        self._rank_pids: dict[int, int] = {}
        self._limit = 0
        self._stats: dict[str, int] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = 0
        self._stopped = False
        # Restarts after the engine process died: each waits twice as long as the one
        # before (RESTART_BACKOFF_S, 2x, 4x, ...); after MAX_RESTARTS in a row that failed
        # to start, it stays down (/health 503). One that starts resets the count.
        self.restarts = 0
        self._restart: asyncio.Task[None] | None = None
        # LoRA adapters loaded, name → path: an engine process that restarts loads them again.
        self._loras = LoraRecord(self._call)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=self.child_main,
            args=(child, self.load_kwargs, self.config, *self.hooks),
            name="pippin-engine",
            daemon=True,
        )
        self._proc.start()
        child.close()
        self._pipe = _Pipe(conn)
        try:
            msg = await asyncio.to_thread(conn.recv)
        except EOFError:
            raise EngineError(f"the engine process exited ({self._proc.exitcode})") from None
        if msg[0] == "failed":
            raise EngineError(f"the engine process failed to start: {msg[1]}")
        _, self._limit, self._stats, info = msg
        self._rank_pids = info.get("rank_pids", {})
        self._ready = True
        threading.Thread(target=self._read, name="pippin-engine-reader", daemon=True).start()

    async def stop(self) -> None:
        self._stopped = True
        if self._restart is not None:
            self._restart.cancel()
        ready, self._ready = self._ready, False
        if self._proc is not None:
            if ready:
                self._send(("stop",))
            await asyncio.to_thread(self._proc.join, 30)
            if self._proc.is_alive():
                self._proc.kill()  # it ignores SIGTERM (see `_child_main`)
                await asyncio.to_thread(self._proc.join, 5)
        self._fail_open("the server is shutting down")

    @property
    def ready(self) -> bool:
        return self._ready and self._proc is not None and self._proc.is_alive()

    @property
    def max_model_len(self) -> int:
        return self._limit

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt(prompt_token_ids, self._limit)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if not self.ready:
            raise EngineError("the engine is not running")
        self.check(prompt_token_ids, params)
        async for out in self.streams.generate(
            prompt_token_ids, params, request_id, submit=self._submit, abort=self.abort
        ):
            yield out

    def _submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        # The parameters travel pickled on their own: if the engine process cannot rebuild
        # them (a grammar), it fails this request, not the pipe.
        self._send(("add", request_id, prompt_token_ids, pickle.dumps(params)))

    def abort(self, request_id: str) -> None:
        if self._ready:
            self._send(("abort", request_id))

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    async def cache_stats(self) -> dict[str, Any]:
        return await self._call("cache_stats")

    async def clear_cache(self, tier: str | None = None) -> dict[str, int]:
        return await self._call("clear_cache", tier)

    @property
    def loras(self) -> dict[str, str]:
        return dict(self._loras.paths)

    async def add_lora(self, name: str, path: str) -> dict[str, Any]:
        return await self._loras.add(name, path)

    async def remove_lora(self, name: str) -> None:
        await self._loras.remove(name)

    async def sleep(self, tags: frozenset[str], abort: bool) -> None:
        # Its stats travel with outputs; none come while it sleeps.
        self._stats = await self._call("sleep", tags, abort)

    async def wake_up(self, tags: frozenset[str]) -> None:
        self._stats = await self._call("wake_up", tags)

    async def _reload_loras(self, wanted: dict[str, str]) -> None:
        for name, path in wanted.items():
            try:
                await self._loras.add(name, path)
            except EngineError as e:  # its files changed or went: it is no longer served
                log.error("the LoRA adapter '%s' could not be loaded again: %s", name, e)

    async def _call(self, name: str, *args: Any) -> Any:
        if not self.ready:
            raise EngineError("the engine is not running")
        assert self._loop is not None
        self._call_ids += 1
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._calls[self._call_ids] = fut
        self._send(("call", self._call_ids, name, args))
        return await fut

    def _send(self, msg: tuple[Any, ...]) -> None:
        assert self._pipe is not None
        self._pipe.send(msg)  # if the engine process is gone, the reader reports it

    # -- reader thread ----------------------------------------------------
    def _read(self) -> None:
        assert self._pipe is not None and self._loop is not None
        while True:
            try:
                msg = self._pipe.conn.recv()
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._lost)
                return
            if msg[0] == "outs":
                self._loop.call_soon_threadsafe(self._receive, *msg[1:])
            elif msg[0] == "result":
                self._loop.call_soon_threadsafe(self._result, *msg[1:])
            elif msg[0] == "exiting":  # why the engine process is about to end
                self._exit_reason = msg[1]

    def _receive(self, outs: list[RequestOutput], stats: dict[str, int], events: list) -> None:
        self._stats = stats
        for kind, a, b in events:
            if kind == "scheduled":  # a: prefilled request ids, b: whether any decodes
                prefills = [SimpleNamespace(seq=SimpleNamespace(request_id=r)) for r in a]
                self.observer.scheduled(SimpleNamespace(prefills=prefills, decodes=b))  # type: ignore[arg-type]
            else:
                self.observer.step_done(a)
        self.streams.dispatch(outs)

    def _result(self, n: int, ok: bool, value: Any) -> None:
        fut = self._calls.pop(n, None)
        if fut is None or fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(EngineError(value))

    def _lost(self) -> None:
        was_ready, self._ready = self._ready, False
        # Every open stream ends now, before anything else (no client waits on a restart).
        why, self._exit_reason = self._exit_reason, None
        why = why or _lost_rank(self._rank_pids)
        self._fail_open("the engine process exited" + (f": {why}" if why else ""))
        if was_ready:
            self._proc.join(0.1)  # it is gone (the pipe closed): only reaps it
            log.error("the engine process exited (code %s)", self._proc.exitcode)
            if not self._stopped:
                self._restart = asyncio.ensure_future(self._restart_engine())

    async def _restart_engine(self) -> None:
        failures = 0
        # The new process has none of the adapters until they are loaded again: meanwhile
        # `loras` does not list them, so a request for one loads it itself (the engine
        # takes the same adapter twice as once).
        wanted, self._loras.paths = self._loras.paths, {}
        while not self._stopped and failures < MAX_RESTARTS:
            await asyncio.sleep(RESTART_BACKOFF_S * 2**failures)
            log.info("restarting the engine process (attempt %d)", failures + 1)
            try:
                await self.start()
            except EngineError as e:
                failures += 1
                log.error("the engine process did not restart: %s", e)
                continue
            self.restarts += 1
            log.info("the engine process is back (%d restart(s) so far)", self.restarts)
            await self._reload_loras(wanted)
            return
        if failures:
            log.error("the engine process stays down after %d failed restarts", failures)

    def _fail_open(self, message: str) -> None:
        self.streams.fail_open(message)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(EngineError(message))
        self._calls.clear()


# -- the engine process ---------------------------------------------------


class _Recorder(EngineObserver):
    """Keeps the scheduler's and steps' events for the API process's metrics."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any, Any]] = []

    def scheduled(self, sched: Any) -> None:
        rids = [it.seq.request_id for it in sched.prefills]
        self.events.append(("scheduled", rids, bool(sched.decodes)))

    def step_done(self, seconds: float) -> None:
        self.events.append(("step", seconds, None))

    def take(self) -> list[tuple[str, Any, Any]]:
        out, self.events = self.events, []
        return out


class _Child:
    """The engine process: `EngineLoop` on the main thread, requests read from the pipe
    by a reader thread, outputs sent down it."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, conn: Connection) -> None:
        self.pipe = _Pipe(conn)
        self.recorder = _Recorder()
        self.engine = EngineLoop(loaded, config, self.recorder, self._deliver)
        self._stats: dict[str, int] = {}  # as last sent
        self.ready_info: dict[str, Any] = {}  # more for the API process, with "ready"

    def serve(self) -> None:
        threading.Thread(target=self._read, name="pippin-pipe-reader", daemon=True).start()
        self.engine.run(on_ready=self._ready)
        err = self.engine.start_error
        if err is not None:
            self._send(("failed", f"{type(err).__name__}: {err}"))

    def _ready(self, core: Any) -> None:
        self._send(("ready", core.max_model_len, core.stats(), self.ready_info))

    def _read(self) -> None:
        while True:
            try:
                msg = self.pipe.conn.recv()
            except (EOFError, OSError):  # the API process is gone
                msg = ("stop",)
            kind = msg[0]
            if kind == "add":
                rid, prompt, blob = msg[1:]
                try:
                    params = pickle.loads(blob)
                except Exception as e:
                    log.exception("a request's parameters could not be read")
                    err = f"engine error: {type(e).__name__}: {e}"
                    out = RequestOutput(rid, [], len(prompt), 0, True, error=err)
                    self._send(("outs", [out], self._stats, []))
                    continue
                self.engine.add(rid, prompt, params)
            elif kind == "abort":
                self.engine.abort(msg[1])
            elif kind == "call":
                n, name, args = msg[1:]
                self.engine.call(name, args, lambda ok, v, n=n: self._send(("result", n, ok, v)))
            else:
                self.engine.stop()
                return

    def _deliver(self, outs: list[RequestOutput]) -> None:
        core = self.engine.core
        assert core is not None
        if outs or self.recorder.events:
            self._stats = core.stats()
            self._send(("outs", outs, self._stats, self.recorder.take()))

    def _send(self, msg: tuple[Any, ...]) -> None:
        if not self.pipe.send(msg):
            self.engine.stop()  # the API process is gone


def start_child(on_start: OnStart | None) -> None:
    """What an engine process does first: the API process's hook, then signals."""
    if on_start is not None:
        on_start()
    # Ctrl-C, and a service manager's SIGTERM (systemd, `kill -- -PGID`), reach the whole
    # process group: the API process stops this one in order (its "stop" message, or the
    # pipe closing), after its streams end, and the SSD tier is written first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _child_main(
    conn: Connection,
    load_kwargs: dict[str, Any],
    config: EngineConfig,
    on_start: OnStart | None,
    on_loaded: OnLoaded | None,
) -> None:
    from pippin.store.loader import load_model, materialize

    start_child(on_start)
    try:
        loaded = materialize(load_model(**load_kwargs))
        if on_loaded is not None:
            on_loaded(loaded)
        child = _Child(loaded, config, conn)
    except BaseException as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    child.serve()
