"""A fake OpenAI-compatible server with known latencies, for testing `pippin bench`.

Every streamed request answers with `tokens` deltas: the first after `ttft` seconds, the
next ones `itl` seconds apart (on a fixed schedule from the request's arrival, so sleeps do
not add up). The first `reasoning` deltas carry `reasoning_content` instead of `content`.
`/metrics` counts prompt tokens and cached prompt tokens like pippin (a quarter cached).
`/_realised` lists, per streamed request in arrival order, when it arrived, when each delta
left and when its last byte did, on the machine's monotonic clock (`time.perf_counter`, the
same in every process): on a loaded machine a sleep overruns, so a test checks what a client
measured against these events, never against the schedule. Every content delta of request
`k` (in arrival order) starts with ``r{k}w{i}``, so a client's text names its request.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

PROMPT_TOKENS = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


CACHED_TOKENS = 25


@dataclass
class Timing:
    ttft: float = 0.15
    itl: float = 0.03
    reasoning: int = 0  # leading deltas that are reasoning


def make_app(timing: Timing) -> Starlette:
    counters = {"prompt": 0, "cached": 0, "requests": 0}
    realised: list[dict[str, object]] = []

    async def models(_: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def metrics(_: Request) -> PlainTextResponse:
        text = (
            "# TYPE pippin_prompt_tokens_total counter\n"
            f"pippin_prompt_tokens_total {counters['prompt']}\n"
            "# TYPE pippin_prompt_tokens_cached_total counter\n"
            f"pippin_prompt_tokens_cached_total {counters['cached']}\n"
        )
        return PlainTextResponse(text)

    async def sent(_: Request) -> JSONResponse:
        return JSONResponse(realised)

    async def generate(request: Request) -> StreamingResponse:
        t0 = time.perf_counter()
        body = await request.json()
        chat = "messages" in body
        n = body["max_tokens"]
        times: list[float] = []
        k = len(realised)
        event: dict[str, object] = {"arrival": t0, "sent": times, "done": None}
        realised.append(event)

        async def events() -> AsyncIterator[str]:
            for i in range(n):
                await asyncio.sleep(
                    max(0.0, t0 + timing.ttft + i * timing.itl - time.perf_counter())
                )
                times.append(time.perf_counter())
                if chat:
                    key = "reasoning_content" if i < timing.reasoning else "content"
                    delta = {key: f"r{k}w{i} "}
                    choice = {"index": 0, "delta": delta, "finish_reason": None}
                else:
                    choice = {"index": 0, "text": f"r{k}w{i} ", "finish_reason": None}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            last = {"index": 0, "finish_reason": "length"}
            last["delta" if chat else "text"] = {} if chat else ""
            yield f"data: {json.dumps({'choices': [last]})}\n\n"
            usage = {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": n,
                "prompt_tokens_details": {"cached_tokens": CACHED_TOKENS},
            }
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            event["done"] = time.perf_counter()  # the whole response handed to the socket
            counters["prompt"] += PROMPT_TOKENS
            counters["cached"] += CACHED_TOKENS
            counters["requests"] += 1

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/metrics", metrics),
            Route("/_realised", sent),
            Route("/v1/chat/completions", generate, methods=["POST"]),
            Route("/v1/completions", generate, methods=["POST"]),
        ]
    )


@contextmanager
def fake_server(timing: Timing) -> Iterator[str]:
    """Serve from a process of its own (so the client's work does not delay it); yields
    the base URL."""
    port = free_port()
    cmd = [sys.executable, __file__, str(port), str(timing.ttft), str(timing.itl)]
    proc = subprocess.Popen([*cmd, str(timing.reasoning)])
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(400):
            try:
                if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.025)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    port, ttft, itl, reasoning = sys.argv[1:5]
    app = make_app(Timing(float(ttft), float(itl), int(reasoning)))
    uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning")
