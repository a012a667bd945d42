"""The request timings follow the engine's deliveries, not how its reader takes them."""

from __future__ import annotations

import asyncio

from pippin.engine.streams import OutputStreams
from pippin.engine.types import CompletionOutput, RequestOutput, SamplingParams
from pippin.obs.metrics import Metrics
from pippin.obs.observer import ServerObserver


def _sample(m: Metrics, name: str) -> float:
    for metric in m.registry.collect():
        for s in metric.samples:
            if s.name == name:
                return s.value
    raise AssertionError(name)


def test_a_reader_that_fell_behind_still_counts_every_gap() -> None:
    """Four single-token deliveries reach the front before its reader wakes: the reader
    takes them as one delta, yet the ITL histogram gets one gap per token after the
    first, as when the reader keeps up (CI saw 22 gaps for 24 tokens before)."""
    metrics = Metrics(stats=dict)
    streams = OutputStreams(ServerObserver(metrics.for_model("m")))

    def out(token: int, last: bool) -> RequestOutput:
        choice = CompletionOutput(0, [token], str(token), None, "length" if last else None)
        return RequestOutput("r", [choice], 3, 0, last)

    async def main() -> list[RequestOutput]:
        def submit(rid: str, ids: list[int], params: SamplingParams) -> None:
            # The engine delivers everything before the reader's first turn.
            streams.dispatch([out(1, False)])
            streams.dispatch([out(2, False)])
            streams.dispatch([out(3, False)])
            streams.dispatch([out(4, True)])

        gen = streams.generate(
            [5, 6, 7], SamplingParams(max_tokens=4), "r", submit=submit, abort=lambda rid: None
        )
        return [o async for o in gen]

    got = asyncio.run(main())
    assert [c.token_ids for o in got for c in o.outputs] == [[1, 2, 3, 4]]
    assert _sample(metrics, "pippin_time_to_first_token_seconds_count") == 1
    assert _sample(metrics, "pippin_inter_token_latency_seconds_count") == 3
    assert _sample(metrics, "pippin_generation_tokens_total") == 4
    assert _sample(metrics, "pippin_requests_finished_total") == 1
