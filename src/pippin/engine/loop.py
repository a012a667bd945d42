"""The engine's own loop: one thread that owns all MLX work (MLX streams are
thread-affine) and runs `EngineCore` step after step.

Requests, aborts and named calls come in through a queue (`add`, `abort`, `call`,
`stop`: safe from any thread); outputs leave through the `deliver` callback given at
construction. The in-process client runs it on a thread of its own; the engine process
runs it on its main thread. Neither subclasses it.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from pippin import heap
from pippin.engine import sleep
from pippin.engine.config import STREAM_BATCH, STREAM_INTERVAL_S, EngineConfig
from pippin.engine.core import EngineCore, step_error
from pippin.engine.observer import EngineObserver
from pippin.engine.types import EngineError, RequestOutput, SamplingParams
from pippin.store.loaded import LoadedModel

log = logging.getLogger(__name__)

# How long the loop sleeps when requests wait only for blocks read from disk (the
# reader wakes it sooner).
_PROMOTION_WAIT_S = 0.05


@dataclass
class WithOutputs:
    """A call's result, and the outputs of requests it ended (delivered as any others)."""

    value: Any
    outputs: list[RequestOutput]


# What a client may run on the engine thread between steps, by name (an engine process
# gets them by name over its pipe).
CALLS: dict[str, Callable[..., Any]] = {
    "cache_stats": lambda core: core.tiers.stats(),
    "clear_cache": lambda core, tier: core.tiers.clear(tier),
    "add_lora": lambda core, name, path: core.add_lora(name, path),
    "remove_lora": lambda core, name: core.remove_lora(name),
    "sleep": lambda core, tags, abort: WithOutputs(*sleep.put_to_sleep(core, tags, abort)),
    "wake_up": lambda core, tags: sleep.wake(core, tags),
}

# reply(ok, value): a call's result, or its error message when not ok.
Reply = Callable[[bool, Any], None]


class LoraRecord:
    """A client's LoRA adapters (name → path) as its engine confirmed them, loaded and
    removed through the client's `call(name, *args)` of `CALLS`."""

    def __init__(self, call: Callable[..., Awaitable[Any]]) -> None:
        self.call = call
        self.paths: dict[str, str] = {}

    async def add(self, name: str, path: str) -> dict[str, Any]:
        info = await self.call("add_lora", name, path)
        self.paths[name] = path
        return info

    async def remove(self, name: str) -> None:
        await self.call("remove_lora", name)
        self.paths.pop(name, None)


class EngineLoop:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        observer: EngineObserver,
        deliver: Callable[[list[RequestOutput]], None],
    ) -> None:
        self.loaded = loaded
        self.config = config
        self.observer = observer
        self.deliver = deliver
        self.core: EngineCore | None = None
        self.running = False
        self.start_error: BaseException | None = None
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Outputs held back by the stream interval, merged, and when each request's last
        # delivery left.
        self._held: dict[str, RequestOutput] = {}
        self._last_sent: dict[str, float] = {}

    # -- any thread ---------------------------------------------------------
    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._inbox.put(("add", (request_id, prompt_token_ids, params)))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def call(self, name: str, args: tuple[Any, ...], reply: Reply) -> None:
        """Run ``CALLS[name](core, *args)`` between two steps; ``reply`` gets the result."""
        self._inbox.put(("call", (name, args, reply)))

    def stop(self) -> None:
        self.running = False
        self._inbox.put(("wake", None))

    # -- the engine thread --------------------------------------------------
    def run(self, on_ready: Callable[[EngineCore], None]) -> None:
        """Build the core, call ``on_ready``, then step until `stop`. A failure to build
        is kept in ``start_error`` (``on_ready`` is not called)."""
        self.running = True
        try:
            stream = mx.new_stream(mx.default_device())
            with mx.stream(stream):
                self.core = EngineCore(self.loaded, self.config)
                self.core.observer = self.observer
        except BaseException as e:
            self.start_error = e
            self.running = False
            return
        for store in self.core.tiers.stores():
            store.on_read = lambda: self._inbox.put(("wake", None))
        heap.freeze()  # the model and all else startup made: out of the collector's scans
        on_ready(self.core)
        with mx.stream(stream):
            self._steps()
            try:
                # Cached blocks not yet on disk are written, so they survive the restart.
                self.core.tiers.close(flush=True)
            except Exception:
                log.exception("writing the prefix cache to disk failed")

    def _steps(self) -> None:
        assert self.core is not None
        core = self.core
        while self.running:
            if not core.has_work() or core.steps % 512 == 0:
                # Batch shapes change every step; without this MLX's buffer cache
                # keeps growing with buffers of shapes that never come back.
                mx.clear_cache()
            self._drain(block=not core.has_work())
            if not self.running:
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
                name, args, reply = arg
                try:
                    result = CALLS[name](self.core, *args)
                except Exception as e:
                    reply(False, f"{type(e).__name__}: {e}")
                else:
                    if isinstance(result, WithOutputs):
                        outs.extend(result.outputs)
                        result = result.value
                    reply(True, result)
        # Ends (aborts, refusals) are never held back: they go out now, after anything
        # held back for their requests.
        self._pace(outs)

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
            self.deliver(outs)
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
        self.deliver(ready)
