"""The engine observer of the server: times each request and each step, feeds the
metrics (when on) and the request's log record (always)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pippin.engine.observer import EngineObserver
from pippin.obs.http import current_record
from pippin.obs.timing import RequestTiming

if TYPE_CHECKING:
    from pippin.engine.scheduler import SchedulerOutput
    from pippin.obs.metrics import Metrics


class ServerObserver(EngineObserver):
    def __init__(self, metrics: Metrics | None) -> None:
        self.metrics = metrics
        self.live: dict[str, RequestTiming] = {}
        self._phase: str | None = None

    def request(self, request_id: str, prompt_tokens: int) -> RequestTiming:
        timing = RequestTiming(request_id, prompt_tokens, self.metrics, self.live)
        self.live[request_id] = timing
        record = current_record()
        if record is not None:
            record.timing = timing
        return timing

    def scheduled(self, sched: SchedulerOutput) -> None:
        self._phase = "prefill" if sched.prefills else "decode" if sched.decodes else None
        for it in sched.prefills:
            timing = self.live.get(it.seq.request_id)
            if timing is not None and timing.t_scheduled is None:
                timing.t_scheduled = time.perf_counter()
                if self.metrics is not None:
                    self.metrics.queue_time.observe(timing.t_scheduled - timing.t_submit)

    def step_done(self, seconds: float) -> None:
        if self.metrics is not None and self._phase is not None:
            self.metrics.step.labels(self._phase).observe(seconds)
