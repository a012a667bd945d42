"""Hooks the engine calls at its events; the base class does nothing.

The engine knows nothing about Prometheus or logs: it calls these methods, one line per
event, and `pippin.obs.observer.ServerObserver` implements them (metrics, log lines).
Methods marked "engine thread" run on the MLX thread and must be cheap and thread-safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pippin.engine.scheduler import SchedulerOutput
    from pippin.engine.types import RequestOutput


class RequestWatch:
    """Follows one request on the event loop, from submission to its end."""

    def output(self, out: RequestOutput) -> None:
        """Each output delta, as the front receives it."""

    def end(self, finished: bool) -> None:
        """The stream is over: `finished` False means it was left early (cancelled)."""


class EngineObserver:
    def request(self, request_id: str, prompt_tokens: int) -> RequestWatch:
        """A request was submitted (event loop)."""
        return _NULL_WATCH

    def scheduled(self, sched: SchedulerOutput) -> None:
        """The scheduler planned a step (engine thread)."""

    def step_done(self, seconds: float) -> None:
        """A step of the engine took this long, wall time (engine thread)."""


_NULL_WATCH = RequestWatch()
