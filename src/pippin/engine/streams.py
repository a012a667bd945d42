"""The event loop's side of an engine client: one output queue per open request.

Both clients compose it: the engine's outputs arrive (from a thread or a pipe reader)
through `dispatch`, scheduled on the loop with `call_soon_threadsafe`.

Two limits end a request from here, with an error output, and abort it in the engine
(its KV blocks are freed at the next step):

- ``request_timeout_s``: the request has run (queued or generating) longer than this.
- ``max_buffered``: its reader has left this many deliveries unread (a client that
  stopped reading its stream: the HTTP send waits, so outputs pile up here). Without
  the cap one stalled client would pin memory that grows with every step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

from pippin.engine.observer import EngineObserver, RequestWatch
from pippin.engine.types import EngineError, RequestOutput, SamplingParams

log = logging.getLogger(__name__)

# Deliveries a stream may leave unread before it is ended (about as many tokens: one
# delivery is a step's tokens, merged when the reader is only slow).
MAX_BUFFERED = 1024


class OutputStreams:
    def __init__(
        self,
        observer: EngineObserver,
        request_timeout_s: float | None = None,
        max_buffered: int = MAX_BUFFERED,
    ) -> None:
        self.observer = observer
        self.request_timeout_s = request_timeout_s
        self.max_buffered = max_buffered
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._abort: dict[str, Callable[[str], None]] = {}
        # Watched as each delivery arrives, not as its reader takes it: a reader that
        # fell behind takes several merged, which would hide their gaps from the ITL.
        self._watches: dict[str, RequestWatch] = {}
        # Requests submitted that have had no output yet: queued, or in their prefill.
        self.unstarted: set[str] = set()

    @property
    def open(self) -> int:
        return len(self._queues)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        submit: Callable[[str, list[int], SamplingParams], None],
        abort: Callable[[str], None],
    ) -> AsyncIterator[RequestOutput]:
        """`EngineClient.generate`, once the client has checked the request: `submit`
        hands it to the engine, `abort` ends it if the iteration is left early."""
        if request_id in self._queues:
            raise EngineError(f"request id {request_id!r} is already in use")
        watch = self.observer.request(request_id, len(prompt_token_ids))
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = q
        self._abort[request_id] = abort
        self._watches[request_id] = watch
        self.unstarted.add(request_id)
        submit(request_id, list(prompt_token_ids), params)
        deadline = (
            None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        )
        finished = False
        try:
            while True:
                out = await self._next(q, request_id, deadline, len(prompt_token_ids))
                self.unstarted.discard(request_id)
                # A reader that fell behind (a busy event loop under load) gets what
                # queued up as one delta: one chunk to frame and send, not one per step.
                while not out.finished and not q.empty():
                    out = out.then(q.get_nowait())
                finished = out.finished
                yield out
                if finished:
                    break
        finally:
            self._queues.pop(request_id, None)
            self._abort.pop(request_id, None)
            self._watches.pop(request_id, None)
            self.unstarted.discard(request_id)
            watch.end(finished)
            if not finished:
                abort(request_id)

    async def _next(
        self, q: asyncio.Queue[RequestOutput], rid: str, deadline: float | None, prompt: int
    ) -> RequestOutput:
        if deadline is None:
            return await q.get()
        try:
            return await asyncio.wait_for(q.get(), max(deadline - time.monotonic(), 0))
        except TimeoutError:
            self._abort[rid](rid)
            self._queues.pop(rid, None)  # nothing more is read: later outputs are dropped
            msg = f"the request ran longer than the server's limit ({self.request_timeout_s:g}s)"
            log.info("request %s ended: %s", rid, msg)
            out = RequestOutput(rid, [], prompt, 0, True, error=msg, error_kind="timeout")
            self._watch(out)
            return out

    def dispatch(self, outs: list[RequestOutput]) -> None:
        """Hand outputs to their requests' streams (event loop)."""
        for out in outs:
            q = self._queues.get(out.request_id)
            if q is None:
                continue
            if q.qsize() >= self.max_buffered and not out.finished:
                # Its client stopped reading: end it here rather than hold more.
                rid = out.request_id
                self._abort[rid](rid)
                del self._queues[rid]
                msg = f"the client left more than {self.max_buffered} outputs unread"
                log.warning("request %s ended: %s", rid, msg)
                out = RequestOutput(rid, [], out.prompt_tokens, 0, True, msg, "slow_reader")
            self._watch(out)
            q.put_nowait(out)

    def fail_open(self, message: str) -> None:
        """Streams still open end with an error instead of waiting forever."""
        for rid, q in list(self._queues.items()):
            out = RequestOutput(rid, [], 0, 0, True, error=message)
            self._watch(out)
            q.put_nowait(out)

    def _watch(self, out: RequestOutput) -> None:
        watch = self._watches.get(out.request_id)
        if watch is not None:
            watch.output(out)


def set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
