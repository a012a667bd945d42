"""How streams end when the engine fails: an error event, then [DONE].

A real engine failure cannot be provoked on demand, so these feed hand-made engine
outputs to the response writers (the real-server tests cover the engine itself).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from pippin.api.openai.chat import ChatRun
from pippin.api.openai.completions import CompletionRun, Prompt
from pippin.chat.output import OutputParser
from pippin.engine.client import EngineError
from pippin.engine.types import CompletionOutput, RequestOutput, SamplingParams
from pippin.serving.job import ChatJob, PreparedJob
from pippin.serving.tool_loop import ToolLoop, Turn


class ScriptedEngine:
    """Yields the given outputs (an exception instance is raised instead)."""

    def __init__(self, *script: RequestOutput | Exception) -> None:
        self.script = script

    async def generate(
        self, prompt: list[int], params: SamplingParams, rid: str
    ) -> AsyncIterator[RequestOutput]:
        for item in self.script:
            if isinstance(item, Exception):
                raise item
            yield item


def out(text: str, finish: str | None = None, error: str | None = None) -> RequestOutput:
    c = CompletionOutput(0, [1], text, None, finish)  # type: ignore[arg-type]
    return RequestOutput("r", [c], 3, 0, finish is not None, error)


def events(gen: AsyncIterator[str]) -> list[Any]:
    async def drain() -> list[str]:
        return [x async for x in gen]

    lines = asyncio.run(drain())
    assert all(x.startswith("data: ") and x.endswith("\n\n") for x in lines)
    payloads = [x[len("data: ") : -2] for x in lines]
    return [p if p == "[DONE]" else json.loads(p) for p in payloads]


def chat_run(engine: Any, **kw: Any) -> ChatRun:
    """A chat request prepared for `engine` (no model: the run only formats its outputs)."""
    params, prompt = SamplingParams(), [1, 2, 3]

    def new_parser(whole: bool = False) -> OutputParser:
        return OutputParser(None, None)

    job = ChatJob(model="m", request_id="chatcmpl-x", messages=[])
    loop = ToolLoop(engine, job.request_id, [], Turn(prompt, params, new_parser), None)
    prepared = PreparedJob(job, None, engine, prompt, params, new_parser, loop)  # type: ignore[arg-type]
    return ChatRun(prepared, "m", "fp", lambda t: ("t", [116]), **kw)  # type: ignore[arg-type]


def test_engine_error_mid_stream_is_an_error_event() -> None:
    engine = ScriptedEngine(out("Hel"), out("", "error", error="boom"))
    ev = events(chat_run(engine, include_usage=True).stream())
    assert ev[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ev[1]["choices"][0]["delta"] == {"content": "Hel"}
    assert ev[-2]["error"]["type"] == "server_error" and "boom" in ev[-2]["error"]["message"]
    assert ev[-1] == "[DONE]"


def test_engine_refusal_mid_stream_is_an_error_event() -> None:
    ev = events(chat_run(ScriptedEngine(EngineError("no room"))).stream())
    assert "no room" in ev[-2]["error"]["message"] and ev[-1] == "[DONE]"


def test_unexpected_exception_still_ends_the_stream() -> None:
    ev = events(chat_run(ScriptedEngine(out("a"), RuntimeError("bug"))).stream())
    assert ev[-2]["error"]["message"] == "Internal server error (RuntimeError)."
    assert ev[-1] == "[DONE]"


def test_server_abort_is_reported() -> None:
    ev = events(chat_run(ScriptedEngine(out("a"), out("", "abort"))).stream())
    assert ev[-2]["error"]["code"] == "request_aborted" and ev[-1] == "[DONE]"


def test_normal_stream_with_usage() -> None:
    ev = events(chat_run(ScriptedEngine(out("a"), out("b", "stop")), include_usage=True).stream())
    assert ev[-3]["choices"][0]["finish_reason"] == "stop"
    assert ev[-2]["choices"] == [] and ev[-2]["usage"]["completion_tokens"] == 2
    assert ev[-2]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all(e["usage"] is None for e in ev[:-2])


def completion_run(engine: Any) -> CompletionRun:
    return CompletionRun(
        engine,
        [Prompt([1, 2], "p")],
        [SamplingParams(max_tokens=4)],
        "cmpl-x",
        "m",
        "fp",
        lambda t: ("t", [116]),  # type: ignore[arg-type]
    )


def test_completion_stream_error_event() -> None:
    run = completion_run(ScriptedEngine(out("x"), out("", "error", error="kaput")))
    ev = events(run.stream())
    assert ev[0]["choices"][0]["text"] == "x"
    assert "kaput" in ev[-2]["error"]["message"] and ev[-1] == "[DONE]"
