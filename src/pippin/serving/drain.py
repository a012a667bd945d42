"""Stopping without losing requests: SIGTERM (or Ctrl-C) drains before uvicorn stops.

On the first signal the server keeps its socket open and turns draining: new requests get
503 with ``Retry-After`` (`pippin.serving.admission`) and /health answers 503, so a load
balancer moves on, while the requests in flight finish. Once none is left, or after
``--drain-timeout`` seconds, the engine is stopped (streams still open end with an error
event, the SSD tier's pending blocks are written) and uvicorn shuts down as usual. A second
signal stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from types import FrameType

import uvicorn

from pippin.serving.state import ServerState

log = logging.getLogger("pippin.server")

# After the engine is stopped, how long the requests it ended get to send their error.
_ERROR_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        state: ServerState,
        on_ready: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self.state = state
        self.on_ready = on_ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list | None = None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list | None = None) -> None:  # type: ignore[override]
        # After the lifespan (models loaded) and the bind: the moment requests are answered.
        await super().startup(sockets)
        if self.started and not self.should_exit and self.on_ready is not None:
            self.on_ready()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        a = self.state.admission
        if a.draining or self._loop is None or not self.started:
            super().handle_exit(sig, frame)  # a second signal, or not serving yet: now
            return
        a.draining = True
        self._loop.call_soon_threadsafe(self._start_drain, sig)

    def _start_drain(self, sig: int) -> None:
        assert self._loop is not None
        self._task = self._loop.create_task(self._drain(sig))

    async def _drain(self, sig: int) -> None:
        a, timeout = self.state.admission, self.state.settings.drain_timeout_s
        t0 = time.monotonic()
        log.info("draining: %d request(s) in flight, up to %gs", a.in_flight, timeout)
        while a.in_flight and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.05)
        if a.in_flight:
            log.warning("drain timeout: ending %d request(s) with an error", a.in_flight)
        if self.state.registry is not None:
            # Every loaded model's engine: ends what is left with an error and writes the
            # SSD tier (stop is idempotent: the lifespan's stop later finds nothing to do).
            await self.state.registry.stop()
        t1 = time.monotonic()
        while a.in_flight and time.monotonic() - t1 < _ERROR_GRACE_S:
            await asyncio.sleep(0.05)
        log.info("drained in %.1fs", time.monotonic() - t0)
        super().handle_exit(sig, None)


def serve(
    app: object,
    state: ServerState,
    on_ready: Callable[[], None] | None = None,
    **config: object,
) -> bool:
    """Run `app` under uvicorn with draining on SIGTERM/SIGINT; False if it never started.
    `on_ready` is called once it listens, its models loaded."""
    server = DrainingServer(uvicorn.Config(app, **config), state, on_ready)  # type: ignore[arg-type]
    server.run()
    return server.started
