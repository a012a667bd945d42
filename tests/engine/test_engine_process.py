"""`pippin serve --engine-process`: the engine in a process of its own, over real HTTP.

The same front as in one process; what crosses the pipe is checked here: requests and
their outputs (streamed and not, n > 1, logprobs), a structured-output constraint
(compiled again in the engine process), refusals before anything is sent, aborts of
streams left early, the prefix cache's calls, the metrics the engine process reports,
and what a client sees when the engine process dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support.server_utils import Server, engine_process_pid, run_server

from pippin.bench.scrape import parse_metrics, total

MSG = [{"role": "user", "content": "Hello, how are you today?"}]


@pytest.fixture(scope="module")
def server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    model = tiny_models("llama")
    with run_server(
        str(model), "--served-model-name", "tiny", "--max-model-len", "512", "--engine-process"
    ) as s:
        yield s


def _metric(server: Server, name: str, **labels: str) -> float | None:
    return total(parse_metrics(server.http().get("/metrics").text), name, **labels)


def test_outputs_cross_the_pipe(server: Server) -> None:
    client = server.client()
    kw = dict(
        model="tiny", messages=MSG, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2)  # type: ignore[call-overload]
    assert whole.usage.completion_tokens == 12
    assert len(whole.choices[0].logprobs.content) == 12
    assert all(len(t.top_logprobs) == 2 for t in whole.choices[0].logprobs.content)

    pieces = []
    for chunk in client.chat.completions.create(**kw, stream=True):  # type: ignore[call-overload]
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
    assert "".join(pieces) == whole.choices[0].message.content  # greedy: the same text

    two = client.chat.completions.create(**{**kw, "temperature": 1.0, "seed": 7}, n=2)  # type: ignore[call-overload]
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 24


def test_structured_output_is_compiled_again_in_the_engine(server: Server) -> None:
    schema = {
        "type": "object",
        # Bounded lengths: a random model writing an unbounded number could run past
        # max_tokens.
        "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    }
    r = server.client().chat.completions.create(
        model="tiny",
        messages=MSG,
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": schema, "strict": True},
        },
    )
    assert r.choices[0].finish_reason == "stop"
    data = json.loads(r.choices[0].message.content or "")
    assert set(data) == {"name", "ok"} and isinstance(data["ok"], bool)


def test_refusal_and_abort(server: Server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * 600}], max_tokens=4
        )
    assert "context" in str(err.value)

    stream = client.chat.completions.create(
        model="tiny", messages=MSG, max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    got = 0
    for chunk in stream:
        got += bool(chunk.choices and chunk.choices[0].delta.content)
        if got >= 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while _metric(server, "pippin_requests_running") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metric(server, "pippin_requests_running") == 0  # the engine process aborted it
    stats = server.http().get("/v1/cache/stats").json()
    assert stats["memory"]["capacity_blocks"] > 0
    assert server.http().delete("/v1/cache").status_code == 200
    # Step timings and queue times come over from the engine process.
    decode_steps = _metric(server, "pippin_engine_step_duration_seconds_count", phase="decode")
    assert decode_steps is not None and decode_steps > 0
    queued = _metric(server, "pippin_request_queue_time_seconds_count")
    assert queued is not None and queued >= 4


def test_engine_process_death_ends_streams_with_an_error(
    tiny_models: Callable[..., Path],
) -> None:
    model = str(tiny_models("llama"))
    with run_server(
        model, "--served-model-name", "x", "--max-model-len", "8192", "--engine-process"
    ) as s:
        child = engine_process_pid(s)
        with httpx.stream(
            "POST",
            f"{s.url}/v1/chat/completions",
            json={
                "model": "x",
                "messages": MSG,
                "max_tokens": 8000,
                "stream": True,
                "ignore_eos": True,
            },
            timeout=60,
        ) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data:")
            os.kill(child, signal.SIGKILL)
            rest = list(lines)
        # Ended early, with an error event rather than a finish reason.
        events = [json.loads(line[5:]) for line in rest if line.startswith("data: {")]
        assert "engine process exited" in str(events[-1].get("error")), (len(events), events[-2:])
        assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))
        assert s.http().get("/health").status_code == 503


def test_engine_process_is_the_default_on_cuda_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from pippin.cli.main import build_parser
    from pippin.cli.settings import settings_from_args
    from pippin.kernels import device

    def settings(*flags: str) -> bool:
        args = build_parser().parse_args(["serve", "--offline", *flags])
        return settings_from_args(args).engine_process

    for cuda in (False, True):
        monkeypatch.setattr(device, "on_cuda", lambda cuda=cuda: cuda)
        assert settings() is cuda
        assert settings("--engine-process") is True
        assert settings("--no-engine-process") is False


def test_sigterm_to_the_process_group_stops_in_order(
    tiny_models: Callable[..., Path], tmp_path: Path
) -> None:
    """systemd's stop (or `kill -- -PGID`) sends SIGTERM to both processes at once: the
    engine process waits for the API process to stop it, so nothing is logged as lost
    and the SSD tier is written before it exits."""
    args = (
        str(tiny_models("llama")),
        "--served-model-name",
        "x",
        "--max-model-len",
        "512",
        "--block-size",
        "16",
        "--engine-process",
        "--ssd-cache-dir",
        str(tmp_path / "ssd"),
    )
    prompt = "Hello there, how are you today? " * 12
    with run_server(*args) as s:
        s.client().completions.create(model="x", prompt=prompt, max_tokens=2)
        os.kill(engine_process_pid(s), signal.SIGTERM)
        os.kill(s.proc.pid, signal.SIGTERM)
        s.proc.wait(timeout=60)  # uvicorn exits by the signal again once shut down
        assert "Application shutdown complete" in s.log()
        assert "engine process exited" not in s.log()
    with run_server(*args) as s:
        r = s.client().completions.create(model="x", prompt=prompt, max_tokens=2)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        assert (r.usage.prompt_tokens_details.cached_tokens or 0) >= 64  # read back from disk


def test_a_lost_rank_is_named_after_the_engine_process_ended() -> None:
    """When a tensor-parallel engine process dies without saying why (a collective that
    failed aborts it), the first of its other ranks whose process ended is named."""
    from pippin.engine.process_client import _lost_rank

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # ends; not reaped yet
    try:
        deadline = time.monotonic() + 30
        while open(f"/proc/{zombie.pid}/stat", "rb").read().rsplit(b")", 1)[1].split()[0] != b"Z":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert _lost_rank({1: alive.pid}) is None
        assert _lost_rank({1: alive.pid, 2: zombie.pid}) == (
            "tensor parallel: rank 2 is gone (its process ended)"
        )
        zombie.wait()  # reaped: no process at all
        assert _lost_rank({3: zombie.pid, 1: alive.pid}) == (
            "tensor parallel: rank 3 is gone (its process ended)"
        )
        assert _lost_rank({}) is None
    finally:
        alive.kill()
        alive.wait()
