"""One request's timings and token counts, fed to the metrics as its outputs arrive."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pippin.engine.observer import RequestWatch

if TYPE_CHECKING:
    from pippin.engine.types import RequestOutput
    from pippin.obs.metrics import Metrics


class RequestTiming(RequestWatch):
    """One request's timings (perf_counter seconds) and token counts."""

    def __init__(
        self,
        request_id: str,
        prompt_tokens: int,
        metrics: Metrics | None,
        live: dict[str, RequestTiming],
    ) -> None:
        self.metrics = metrics
        self.live = live  # the requests in flight, which this one leaves at its end
        self.request_id = request_id
        self.t_submit = time.perf_counter()
        self.t_scheduled: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.t_end: float | None = None
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        self.completion_tokens = 0  # all choices
        self.longest = 0  # tokens of the longest choice, for TPOT
        self.finish_reason: str | None = None
        self.cancelled = False

    def output(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        m = self.metrics
        self.prompt_tokens, self.cached_tokens = out.prompt_tokens, out.cached_tokens
        n = sum(len(c.token_ids) for c in out.outputs)
        step = max((len(c.token_ids) for c in out.outputs), default=0)
        for c in out.outputs:
            if c.finish_reason is not None:
                self.finish_reason = c.finish_reason
        if out.error is not None:
            self.finish_reason = "error"
        if not n:
            return
        self.completion_tokens += n
        self.longest += step
        if m is not None:
            m.generation_tokens.inc(n)
        if self.t_first is None:
            self.t_first = now
            if m is not None:
                m.ttft.observe(now - self.t_submit)
        elif m is not None and self.t_last is not None:
            # Tokens that arrive together share the gap since the previous delivery.
            gap = (now - self.t_last) / step
            for _ in range(step):
                m.itl.observe(gap)
        self.t_last = now

    def end(self, finished: bool) -> None:
        self.t_end = time.perf_counter()
        self.cancelled = not finished
        self.live.pop(self.request_id, None)
        m = self.metrics
        if m is None:
            return
        m.e2e.observe(self.t_end - self.t_submit)
        m.prompt_tokens.inc(self.prompt_tokens)
        m.cached_tokens.inc(self.cached_tokens)
        if self.tpot is not None:
            m.tpot.observe(self.tpot)
        if self.cancelled:
            m.cancellations.inc()
        elif self.finish_reason is not None:
            m.finished.labels(self.finish_reason).inc()

    @property
    def queue_s(self) -> float | None:
        return None if self.t_scheduled is None else self.t_scheduled - self.t_submit

    @property
    def ttft_s(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_submit

    @property
    def e2e_s(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_submit

    @property
    def tpot(self) -> float | None:
        if self.longest < 2 or self.t_first is None or self.t_last is None:
            return None
        return (self.t_last - self.t_first) / (self.longest - 1)
