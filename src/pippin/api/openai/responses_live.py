"""Responses whose run goes on apart from the HTTP request that made them.

A background response (`background: true`) and every streamed response run as a task
that records the stream's events (with their sequence numbers) in a `LiveResponse`; a
stream is one reader of that record. So `POST /v1/responses/{id}/cancel` can stop either
(the task is cancelled, which closes the engine's stream: the request is aborted and its
KV blocks freed; the stream ends with `response.incomplete` saying `cancelled`), `GET`
polls a background response while it runs, and `GET ?stream=true&starting_after=n` reads
a background response's events again from event n + 1. A client leaving a background
stream leaves the run going; leaving any other stream stops it, as before.

Finished runs leave the live table at once, but for the last few background ones, kept
so that a stream that lost its connection near the end can still be resumed.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from fastapi import Request

from pippin.api.common import obfuscation, typed_sse
from pippin.api.openai.responses_store import app_object
from pippin.serving.errors import ApiError
from pippin.serving.streams import guarded


class ResponseRun(Protocol):
    """What runs here (`responses.ResponseRun`; named by shape, as that module uses
    this one)."""

    conversation: list[Any]

    @property
    def id(self) -> str: ...

    def body(self, status: str, **extra: Any) -> dict[str, Any]: ...

    def events(self, whole: bool = False) -> AsyncIterator[dict[str, Any]]: ...

    def cancelled(self) -> list[dict[str, Any]]: ...

    def save(self, body: dict[str, Any]) -> None: ...


_ENDED = frozenset({"completed", "incomplete", "failed", "cancelled"})

# Finished background runs whose events stay readable (`starting_after`).
KEEP_FINISHED = 16


@dataclass(eq=False)
class LiveResponse:
    run: ResponseRun
    background: bool
    # Every event so far, numbered (`sequence_number` is its index).
    events: list[dict[str, Any]] = field(default_factory=list)
    status: str = "queued"
    # The response of the event that ended the run, once one has: from then on GET answers
    # it (with its `incomplete_details` or `error`), before the run's task has wound up.
    final: dict[str, Any] | None = None
    done: bool = False
    # Set by `cancel`: the run's end is a cancellation to record, not a client gone.
    cancelling: bool = False
    task: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def id(self) -> str:
        return self.run.id

    def snapshot(self) -> dict[str, Any]:
        """The response as it stands (what GET answers while it runs)."""
        if self.final is not None:
            return self.final
        if self.done and self.events and "response" in self.events[-1]:
            return self.events[-1]["response"]
        return self.run.body(self.status)

    def _add(self, event: dict[str, Any]) -> None:
        event["sequence_number"] = len(self.events)
        if "response" in event:
            self.status = event["response"]["status"]
            if self.status in _ENDED:
                self.final = event["response"]
        self.events.append(event)
        self._changed.set()

    async def _drive(self, whole: bool) -> None:
        def failed(err: ApiError) -> dict[str, Any]:
            error = {"code": "server_error", "message": err.message}
            body = self.run.body("failed", error=error)
            if self.background:  # polled: kept, as OpenAI keeps it
                self.run.save(body)
            return {"type": "response.failed", "response": body}

        async for event in guarded(self.run.events(whole), failed):
            self._add(event)

    def _finish(self, task: asyncio.Task[None]) -> None:
        """The run's end, however it came (a task cancelled before it began never ran
        `_drive` at all)."""
        if self.done:
            return
        if task.cancelled() and self.cancelling:
            # The engine request is aborted: the run's generators were closed.
            for event in self.run.cancelled():
                self._add(event)
        self.done = True
        self._changed.set()

    def start(self, whole: bool = False) -> None:
        task = self.task = asyncio.create_task(self._drive(whole), name=f"response {self.id}")
        task.add_done_callback(self._finish)

    async def cancel(self) -> dict[str, Any]:
        """Stop the run; the response as it ended (cancelled, unless it ended first)."""
        task = self.task
        if task is not None and not self.done:
            self.cancelling = True
            task.cancel()
            await asyncio.wait({task})  # its end, without taking on its cancellation
            self._finish(task)
        return self.snapshot()

    async def follow(self, after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """The events after number `after`, as they come, to the last."""
        i = after + 1
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            self._changed.clear()
            await self._changed.wait()

    async def sse(self, after: int = -1, obfuscate: bool = False) -> AsyncIterator[str]:
        """Server-sent events of `follow`. A reader that leaves stops the run unless it
        runs in the background."""
        try:
            async for event in self.follow(after):
                if obfuscate and event["type"].endswith(".delta"):
                    event = {**event, "obfuscation": obfuscation()}
                yield typed_sse(event)
        finally:
            if not self.background and not self.done and self.task is not None:
                self.task.cancel()


class LiveResponses:
    """The runs in flight by id, and the last few finished background ones."""

    def __init__(self, keep: int = KEEP_FINISHED) -> None:
        self.keep = keep
        self._running: dict[str, LiveResponse] = {}
        self._finished: OrderedDict[str, LiveResponse] = OrderedDict()

    def get(self, response_id: str) -> LiveResponse | None:
        return self._running.get(response_id) or self._finished.get(response_id)

    def start(self, live: LiveResponse, whole: bool = False) -> None:
        self._running[live.id] = live
        live.start(whole)
        assert live.task is not None
        live.task.add_done_callback(lambda _: self._ended(live))

    def _ended(self, live: LiveResponse) -> None:
        self._running.pop(live.id, None)
        if live.background:
            self._finished[live.id] = live
            while len(self._finished) > self.keep:
                self._finished.popitem(last=False)

    def forget(self, response_id: str) -> None:
        self._finished.pop(response_id, None)


def get_live(request: Request) -> LiveResponses:
    return app_object(request, "responses_live", LiveResponses)
