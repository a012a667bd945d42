"""The event loop's side of an engine client: one output queue per open request.

Both clients compose it: the engine's outputs arrive (from a thread or a pipe reader)
through `dispatch`, scheduled on the loop with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from pippin.engine.observer import EngineObserver
from pippin.engine.types import EngineError, RequestOutput, SamplingParams


class OutputStreams:
    def __init__(self, observer: EngineObserver) -> None:
        self.observer = observer
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}

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
        submit(request_id, list(prompt_token_ids), params)
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
                abort(request_id)

    def dispatch(self, outs: list[RequestOutput]) -> None:
        """Hand outputs to their requests' streams (event loop)."""
        for out in outs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def fail_open(self, message: str) -> None:
        """Streams still open end with an error instead of waiting forever."""
        for rid, q in list(self._queues.items()):
            q.put_nowait(RequestOutput(rid, [], 0, 0, True, error=message))


def set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
