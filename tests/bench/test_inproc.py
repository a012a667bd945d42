"""The in-process measurement (`pippin.bench.inproc`): what its timed part holds."""

from __future__ import annotations

import pytest
from support.engine_runs import loaded_model

from pippin.bench import inproc
from pippin.runner import decode_graph


def test_the_timed_decode_traces_no_new_shape(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the decode step compiled, `decode_rate`'s timed part takes only shapes its
    engine has traced already (a cost mlx-lm's uncompiled step never pays), and its untimed
    warm-up did trace (the same engine, the same lengths)."""
    monkeypatch.setenv("PIPPIN_COMPILE", "1")
    model = loaded_model(tiny_models("llama")).model
    traced: list[bool] = []  # per step call: whether the drive it is in is timed
    timing = False
    real_trace = decode_graph.DecodeGraph._step
    real_drive = inproc.drive

    def step(self, *args):  # type: ignore[no-untyped-def]
        traced.append(timing)
        return real_trace(self, *args)

    def drive(core, requests, untimed_prefill=False, keep=True):  # type: ignore[no-untyped-def]
        nonlocal timing
        requests = list(requests)
        timing = not requests[0][0].startswith("warm-")
        return real_drive(core, requests, untimed_prefill, keep)

    monkeypatch.setattr(decode_graph.DecodeGraph, "_step", step)
    monkeypatch.setattr(inproc, "drive", drive)
    prompts = [[5 + i % 90 for i in range(40)], [7 + i % 80 for i in range(70)]]
    assert inproc.decode_rate(model, prompts, 60) > 0
    assert traced and not any(traced)  # traces, all in the warm-up
