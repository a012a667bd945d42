"""The engine in a process of its own (`pippin serve --engine-process`).

In one process the engine thread and the event loop share the GIL: under hundreds of
streams the loop (framing, parsing, sending chunks) takes it from the engine between
steps. Here the model, the scheduler and detokenizing run in a child process, with its
own GIL; the API process keeps the tokenizer and templates, and talks to it over a pipe:

- API → engine: ``("add", id, prompt, params)``, ``("abort", id)``,
  ``("call", n, name, args)`` (the prefix cache's ``stats``/``clear``), ``("stop",)``.
- engine → API: ``("ready", max_model_len, stats)`` or ``("failed", message)`` once;
  then ``("outs", outputs, stats, events)`` per delivery (one pickle for a whole step's
  outputs; ``events`` replays the scheduler and step timings into the API side's
  metrics) and ``("result", n, ok, value)``.

`RemoteEngine` keeps `AsyncEngine`'s interface; the front does not know which it has.
A structured-output constraint crosses as its grammar and is compiled again in the
child (`Constraint.__reduce__`).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import pickle
import signal
import threading
from multiprocessing.connection import Connection
from types import SimpleNamespace
from typing import Any

from pippin.engine.async_engine import CACHE_CALLS, AsyncEngine, materialize
from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineError, check_prompt
from pippin.engine.observer import EngineObserver
from pippin.engine.types import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class _Pipe:
    """One end of the pipe; sends from several threads, one message at a time."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: tuple[Any, ...]) -> bool:
        """False if the other process is gone."""
        try:
            with self._lock:
                self.conn.send(msg)
        except (OSError, ValueError):
            return False
        return True


class RemoteEngine(AsyncEngine):
    """`AsyncEngine`'s interface over an engine process that loads the model itself from
    `load_kwargs` (the arguments of `pippin.store.loader.load_model`)."""

    def __init__(
        self,
        load_kwargs: dict[str, Any],
        config: EngineConfig,
        observer: EngineObserver | None = None,
    ) -> None:
        super().__init__(None, config, observer)  # type: ignore[arg-type]
        self.load_kwargs = load_kwargs
        self._proc: Any = None
        self._pipe: _Pipe | None = None
        self._remote_ready = False
        self._limit = 0
        self._stats: dict[str, int] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = 0

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        ctx = multiprocessing.get_context("spawn")
        conn, child = ctx.Pipe()
        from pippin.obs import logs

        self._proc = ctx.Process(
            target=_child_main,
            args=(child, self.load_kwargs, self.config, logs.CURRENT),
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
        _, self._limit, self._stats = msg
        self._remote_ready = True
        threading.Thread(target=self._read, name="pippin-engine-reader", daemon=True).start()

    async def stop(self) -> None:
        ready, self._remote_ready = self._remote_ready, False
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
        return self._remote_ready and self._proc is not None and self._proc.is_alive()

    @property
    def max_model_len(self) -> int:
        return self._limit

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_prompt(prompt_token_ids, self._limit)

    def _submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        # The parameters travel pickled on their own: if the engine process cannot rebuild
        # them (a grammar), it fails this request, not the pipe.
        self._send(("add", request_id, prompt_token_ids, pickle.dumps(params)))

    def abort(self, request_id: str) -> None:
        if self._remote_ready:
            self._send(("abort", request_id))

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    async def call(self, fn: Any) -> Any:
        raise NotImplementedError("an engine process runs only its named calls")

    async def _cache_call(self, name: str, *args: Any) -> Any:
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

    def _receive(self, outs: list[RequestOutput], stats: dict[str, int], events: list) -> None:
        self._stats = stats
        for kind, a, b in events:
            if kind == "scheduled":  # a: prefilled request ids, b: whether any decodes
                prefills = [SimpleNamespace(seq=SimpleNamespace(request_id=r)) for r in a]
                self.observer.scheduled(SimpleNamespace(prefills=prefills, decodes=b))  # type: ignore[arg-type]
            else:
                self.observer.step_done(a)
        self._dispatch(outs)

    def _result(self, n: int, ok: bool, value: Any) -> None:
        fut = self._calls.pop(n, None)
        if fut is None or fut.done():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(EngineError(value))

    def _lost(self) -> None:
        if self._remote_ready:
            log.error("the engine process exited (code %s)", self._proc.exitcode)
            self._remote_ready = False
        self._fail_open("the engine process exited")

    def _fail_open(self, message: str) -> None:
        super()._fail_open(message)
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


class _ChildEngine(AsyncEngine):
    """The engine loop of `AsyncEngine`, run on the process's main thread, with requests
    read from the pipe and outputs sent down it."""

    def __init__(self, loaded: Any, config: EngineConfig, conn: Connection) -> None:
        super().__init__(loaded, config, _Recorder())
        self.pipe = _Pipe(conn)
        self._stats: dict[str, int] = {}  # as last sent

    def serve(self) -> None:
        self._running = True
        threading.Thread(target=self._read, name="pippin-pipe-reader", daemon=True).start()
        self._run()
        if self._start_error is not None:
            self._send(("failed", f"{type(self._start_error).__name__}: {self._start_error}"))

    def _loop_steps(self) -> None:
        assert self.core is not None
        self._send(("ready", self.core.max_model_len, self.core.stats()))
        super()._loop_steps()

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
                    self._send(
                        (
                            "outs",
                            [RequestOutput(rid, [], len(prompt), 0, True, error=err)],
                            self._stats,
                            [],
                        )
                    )
                    continue
                self._inbox.put(("add", (rid, prompt, params)))
            elif kind == "abort":
                self._inbox.put(("abort", msg[1]))
            elif kind == "call":
                self._inbox.put(("call", ((msg[2], msg[3]), msg[1])))  # (fn, fut), as _drain reads
            else:
                self._running = False
                self._inbox.put(("wake", None))
                return

    def _resolve(self, fut: Any, fn: Any) -> None:
        n, (name, args) = fut, fn
        try:
            self._send(("result", n, True, CACHE_CALLS[name](self.core, *args)))
        except Exception as e:
            self._send(("result", n, False, f"{type(e).__name__}: {e}"))

    def _deliver(self, outs: list[RequestOutput]) -> None:
        assert self.core is not None and isinstance(self.observer, _Recorder)
        if outs or self.observer.events:
            self._stats = self.core.stats()
            self._send(("outs", outs, self._stats, self.observer.take()))

    def _send(self, msg: tuple[Any, ...]) -> None:
        if not self.pipe.send(msg):
            self._running = False  # the API process is gone


def _child_main(
    conn: Connection,
    load_kwargs: dict[str, Any],
    config: EngineConfig,
    log_setup: tuple[str, str] | None,
) -> None:
    from pippin.obs.logs import setup_logging
    from pippin.store.loader import load_model
    from pippin.structured import constraint
    from pippin.structured.compiler import GrammarCompiler
    from pippin.structured.spec import GrammarSpec

    setup_logging(*(log_setup or ("info", "text")))  # as the API process logs
    # Ctrl-C, and a service manager's SIGTERM (systemd, `kill -- -PGID`), reach the whole
    # process group: the API process stops this one in order (its "stop" message, or the
    # pipe closing), after its streams end, and the SSD tier is written first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        loaded = materialize(load_model(**load_kwargs))
        grammars = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
        constraint.MATCHER_BUILDER = lambda g: grammars.build(GrammarSpec(g, "", ""))
        engine = _ChildEngine(loaded, config, conn)
    except BaseException as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    engine.serve()
