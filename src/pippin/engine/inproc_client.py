"""`EngineClient` with the engine on a thread of this process.

The event loop only talks to the engine thread through `EngineLoop`'s queue in and
`call_soon_threadsafe` out, so a step of the model never blocks the loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from pippin.engine.config import EngineConfig
from pippin.engine.loop import EngineLoop, LoraRecord
from pippin.engine.observer import EngineObserver
from pippin.engine.streams import OutputStreams, set_exception, set_result
from pippin.engine.types import EngineError, RequestOutput, SamplingParams
from pippin.store.loaded import LoadedModel


class InprocClient:
    """``InprocClient(loaded, config, observer=None)``: ``loaded`` must be materialized
    (`pippin.store.loader.materialize`) in the thread that loaded it."""

    def __init__(
        self, loaded: LoadedModel, config: EngineConfig, observer: EngineObserver | None = None
    ) -> None:
        self.observer = observer or EngineObserver()
        self.streams = OutputStreams(self.observer, config.request_timeout_s)
        self.engine = EngineLoop(loaded, config, self.observer, self._deliver)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Event()
        self._loras = LoraRecord(self._call)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pippin-engine", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._started.wait)
        if self.engine.start_error is not None:
            raise self.engine.start_error

    def _run(self) -> None:
        self.engine.run(on_ready=lambda core: self._started.set())
        self._started.set()  # also when it failed to start

    async def stop(self) -> None:
        self.engine.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self.streams.fail_open("the server is shutting down")

    @property
    def ready(self) -> bool:
        alive = self._thread is not None and self._thread.is_alive()
        return self.engine.running and self.engine.core is not None and alive

    @property
    def max_model_len(self) -> int:
        assert self.engine.core is not None
        return self.engine.core.max_model_len

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        assert self.engine.core is not None
        self.engine.core.check(prompt_token_ids, params)

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if not self.ready:
            raise EngineError("the engine is not running")
        self.check(prompt_token_ids, params)
        async for out in self.streams.generate(
            prompt_token_ids, params, request_id, submit=self.engine.add, abort=self.abort
        ):
            yield out

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def stats(self) -> dict[str, int]:
        core = self.engine.core
        return core.stats() if core is not None else {}

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
        await self._call("sleep", tags, abort)

    async def wake_up(self, tags: frozenset[str]) -> None:
        await self._call("wake_up", tags)

    async def _call(self, name: str, *args: Any) -> Any:
        if not self.ready:
            raise EngineError("the engine is not running")
        loop = self._loop
        assert loop is not None
        fut: asyncio.Future[Any] = loop.create_future()

        def reply(ok: bool, value: Any) -> None:
            if ok:
                loop.call_soon_threadsafe(set_result, fut, value)
            else:
                loop.call_soon_threadsafe(set_exception, fut, EngineError(value))

        self.engine.call(name, args, reply)
        return await fut

    def _deliver(self, outs: list[RequestOutput]) -> None:  # engine thread
        if outs:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self.streams.dispatch, outs)
