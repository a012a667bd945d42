"""The engine as the HTTP front sees it: submit a request, iterate its outputs.

One thread owns all MLX work (MLX streams are thread-affine); the event loop
only talks to it through a queue in and `call_soon_threadsafe` out, so a step
of the model never blocks the loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import mlx.core as mx

from pippin.engine.config import STREAM_BATCH, STREAM_INTERVAL_S, EngineConfig
from pippin.engine.core import EngineCore, EngineError, step_error
from pippin.engine.observer import EngineObserver
from pippin.engine.types import RequestOutput, SamplingParams
from pippin.store.loaded import LoadedModel

__all__ = ["AsyncEngine", "EngineError"]

log = logging.getLogger(__name__)

T = TypeVar("T")
# How long the engine thread sleeps when requests wait only for blocks read from disk
# (the reader wakes it sooner).
_PROMOTION_WAIT_S = 0.05


# The prefix cache's calls, by name (an engine process gets them by name over its pipe).
CACHE_CALLS: dict[str, Callable[..., Any]] = {
    "stats": lambda core: core.tiers.stats(),
    "clear": lambda core, tier: core.tiers.clear(tier),
}


def materialize(loaded: LoadedModel) -> LoadedModel:
    """Evaluate a lazily loaded model in the thread that loaded it.

    On CUDA each thread has its own streams, and the engine thread cannot evaluate
    work recorded on another thread's stream: the weights, and arrays models derive
    at construction (RoPE frequencies and the like), which one forward pass computes."""
    mx.eval(loaded.model.parameters())
    try:
        mx.eval(loaded.model(mx.array([[0]])))
    except Exception:  # a model that takes other inputs: its weights are evaluated
        pass
    return loaded


class AsyncEngine:
    """Interface (stable; the HTTP front relies on it):

    - ``AsyncEngine(loaded, config, observer=None)``; ``await start()``; ``await stop()``.
      ``observer`` (an ``EngineObserver``) is told of requests and steps (metrics, logs).
    - ``ready``: True once the model is loaded and the engine thread runs.
    - ``max_model_len``: the context limit in tokens.
    - ``generate(prompt_token_ids, params, request_id)``: async iterator of
      ``RequestOutput`` deltas; the last one has ``finished=True``. Leaving the
      iteration early (client gone, ``aclose()``, task cancelled) aborts the
      request; its KV blocks are freed at the next step. An engine failure ends
      the stream with an output whose ``error`` is set. A request the engine
      cannot take raises ``EngineError`` on the first iteration.
    - ``abort(request_id)``.
    - ``stats()``: dict with running, waiting, blocks_total, blocks_free, ...
    - ``cache_stats()``, ``clear_cache(tier)``: the prefix cache's tiers (engine thread).
    """

    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, observer: EngineObserver | None = None
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.observer = observer or EngineObserver()
        self.core: EngineCore | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        # Engine thread only: outputs held back by the stream interval, merged, and when
        # each request's last delivery left.
        self._held: dict[str, RequestOutput] = {}
        self._last_sent: dict[str, float] = {}

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="pippin-engine", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._started.wait)
        if self._start_error is not None:
            raise self._start_error

    async def stop(self) -> None:
        self._running = False
        self._inbox.put(("wake", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self._fail_open("the server is shutting down")

    def _fail_open(self, message: str) -> None:
        """Streams still open end with an error instead of waiting forever."""
        for rid, q in list(self._queues.items()):
            q.put_nowait(RequestOutput(rid, [], 0, 0, True, error=message))

    @property
    def ready(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return self._running and self.core is not None and alive

    @property
    def max_model_len(self) -> int:
        assert self.core is not None
        return self.core.max_model_len

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise EngineError if the engine cannot take this request."""
        assert self.core is not None
        self.core.check(prompt_token_ids, params)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if not self.ready:
            raise EngineError("the engine is not running")
        if request_id in self._queues:
            raise EngineError(f"request id {request_id!r} is already in use")
        self.check(prompt_token_ids, params)
        watch = self.observer.request(request_id, len(prompt_token_ids))
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = q
        self._submit(request_id, list(prompt_token_ids), params)
        finished = False
        try:
            while True:
                out = await q.get()
                # A reader that fell behind (a busy event loop under load) gets what
                # queued up as one delta: one chunk to frame and send, not one per step.
                while not out.finished and not q.empty():
                    out = out.then(q.get_nowait())
                watch.output(out)
                finished = out.finished
                yield out
                if finished:
                    break
        finally:
            self._queues.pop(request_id, None)
            watch.end(finished)
            if not finished:
                self.abort(request_id)

    def _submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._inbox.put(("add", (request_id, prompt_token_ids, params)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> dict[str, int]:
        return self.core.stats() if self.core is not None else {}

    async def call(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(core)` on the engine thread, between steps, and return its result."""
        if not self.ready:
            raise EngineError("the engine is not running")
        assert self._loop is not None
        fut: asyncio.Future[T] = self._loop.create_future()
        self._inbox.put(("call", (fn, fut)))
        return await fut

    async def cache_stats(self) -> dict[str, Any]:
        return await self._cache_call("stats")

    async def clear_cache(self, tier: str | None = None) -> dict[str, int]:
        return await self._cache_call("clear", tier)

    async def _cache_call(self, name: str, *args: Any) -> Any:
        return await self.call(lambda core: CACHE_CALLS[name](core, *args))

    # -- engine thread ----------------------------------------------------
    def _run(self) -> None:
        try:
            stream = mx.new_stream(mx.default_device())
            with mx.stream(stream):
                self.core = EngineCore(self.loaded, self.config)
                self.core.observer = self.observer
        except BaseException as e:  # reported to start()
            self._start_error = e
            self._running = False
            self._started.set()
            return
        if self.core.tiers.store is not None:
            self.core.tiers.store.on_read = lambda: self._inbox.put(("wake", None))
        self._started.set()
        with mx.stream(stream):
            self._loop_steps()
            try:
                # Cached blocks not yet on disk are written, so they survive the restart.
                self.core.tiers.close(flush=True)
            except Exception:
                log.exception("writing the prefix cache to disk failed")

    def _loop_steps(self) -> None:
        assert self.core is not None
        while self._running:
            core = self.core
            if not core.has_work() or core.steps % 512 == 0:
                # Batch shapes change every step; without this MLX's buffer cache
                # keeps growing with buffers of shapes that never come back.
                mx.clear_cache()
            self._drain(block=not core.has_work())
            if not self._running:
                break
            if not core.has_work():
                continue
            steps = core.steps
            try:
                t0 = time.perf_counter()
                outs = core.step()
                self.observer.step_done(time.perf_counter() - t0)
            except Exception as e:
                log.exception("engine step failed")
                try:
                    outs = core.recover(e)
                except Exception:  # e.g. no room for fresh pools: no request is left waiting
                    log.exception("recovering from the failed step failed")
                    outs = core.fail_all(step_error(e))
            self._pace(outs)
            if core.steps == steps and core.has_work():
                # Nothing could run: requests wait for blocks coming from disk.
                self._drain(block=True, timeout=_PROMOTION_WAIT_S)

    def _drain(self, block: bool, timeout: float | None = None) -> None:
        assert self.core is not None
        outs: list[RequestOutput] = []
        while True:
            try:
                kind, arg = self._inbox.get(block=block, timeout=timeout if block else 0)
            except queue.Empty:
                break
            block = False
            if kind == "add":
                rid, prompt, params = arg
                try:
                    self.core.add_request(rid, prompt, params)
                except EngineError as e:
                    outs.append(RequestOutput(rid, [], len(prompt), 0, True, error=str(e)))
                except Exception as e:  # a bug must fail this request, not the engine thread
                    log.exception("adding a request failed")
                    self.core.abort(rid)
                    msg = f"engine error: {type(e).__name__}: {e}"
                    outs.append(RequestOutput(rid, [], len(prompt), 0, True, error=msg))
            elif kind == "abort":
                out = self.core.abort(arg)
                if out is not None:
                    outs.append(out)
            elif kind == "call":
                fn, fut = arg
                self._resolve(fut, fn)
        # Ends (aborts, refusals) are never held back: they go out now, after anything
        # held back for their requests.
        self._pace(outs)

    def _resolve(self, fut: asyncio.Future[Any], fn: Callable[[EngineCore], Any]) -> None:
        assert self._loop is not None and self.core is not None
        try:
            result = fn(self.core)
        except Exception as e:
            self._loop.call_soon_threadsafe(_set_exception, fut, e)
        else:
            self._loop.call_soon_threadsafe(_set_result, fut, result)

    def _interval(self) -> float:
        if self.config.stream_interval_s is not None:
            return self.config.stream_interval_s
        assert self.core is not None
        return STREAM_INTERVAL_S if len(self.core.scheduler.running) >= STREAM_BATCH else 0.0

    def _pace(self, outs: list[RequestOutput]) -> None:
        """Deliver this step's outputs, holding back (and merging) those of requests that
        got a delivery less than the stream interval ago."""
        interval = self._interval()
        if not interval and not self._held:
            if self._last_sent:
                for out in outs:
                    if out.finished:
                        self._last_sent.pop(out.request_id, None)
            self._deliver(outs)
            return
        now = time.perf_counter()
        for out in outs:
            held = self._held.pop(out.request_id, None)
            self._held[out.request_id] = held.then(out) if held is not None else out
        ready = []
        for rid, out in list(self._held.items()):
            last = self._last_sent.get(rid)
            if out.finished or out.error or last is None or now - last >= interval:
                ready.append(out)
                del self._held[rid]
                if out.finished:
                    self._last_sent.pop(rid, None)
                else:
                    self._last_sent[rid] = now
        self._deliver(ready)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        if not outs:
            return
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, outs)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
