"""One streaming request, timed from its SSE events.

TTFT is the time to the first event that carries generated text: `content`, or reasoning
(`reasoning_content` or `reasoning`, as reasoning models stream it), or a tool call; for
the completions API, `text`. The inter-token latencies are the gaps between such events;
TPOT is (end to end - TTFT) / (output tokens - 1). Output tokens come from the usage the
server sends at the end (`stream_options.include_usage`), else one per event.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)


@dataclass
class RequestResult:
    ok: bool
    start: float  # perf_counter
    ttft: float | None = None
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)
    chunks: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    connect_retries: int = 0
    error: str | None = None
    text: str = ""  # the answer's content (multi-turn sessions send it back)
    turn: int = 0  # its place in its session, from 0

    @property
    def output_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else self.chunks

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _delta_text(choice: dict[str, Any], chat: bool) -> tuple[str, str]:
    """(text that counts as generated, the part that is the answer's content)."""
    if not chat:
        text = choice.get("text") or ""
        return text, text
    delta = choice.get("delta") or {}
    content = delta.get("content") or ""
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    tools = "tool" if delta.get("tool_calls") else ""
    return content + reasoning + tools, content


def _read_event(
    res: RequestResult, obj: dict[str, Any], chat: bool, now: float, last: float | None
) -> float | None:
    if obj.get("error"):
        res.error = f"stream error: {str(obj['error'])[:200]}"
        return last
    usage = obj.get("usage")
    if usage:
        res.usage_tokens = usage.get("completion_tokens")
        res.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        res.cached_tokens = details.get("cached_tokens")
    for c in obj.get("choices") or []:
        if c.get("index", 0) != 0:
            continue
        generated, content = _delta_text(c, chat)
        res.text += content
        if generated:
            res.chunks += 1
            if last is None:
                res.ttft = now - res.start
            else:
                res.itls.append(now - last)
            last = now
        if c.get("finish_reason"):
            res.finish_reason = c["finish_reason"]
    return last


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    max_retries: int = 3,
) -> RequestResult:
    """POST `body` (with ``stream: true``) and time its events.

    A request is retried only if nothing was received yet (a refused or reset connect,
    as small servers with short listen backlogs give under bursts); the retry counts in
    its latency."""
    chat = "messages" in body
    payload = json.dumps(body).encode()
    hdrs = {"content-type": "application/json", "accept": "text/event-stream", **(headers or {})}
    perf = time.perf_counter
    res = RequestResult(ok=False, start=perf())
    attempt = 0
    while True:
        got_bytes = False
        try:
            async with client.stream("POST", url, content=payload, headers=hdrs) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread())[:300].decode(errors="replace")
                    res.error = f"HTTP {resp.status_code}: {text}"
                    res.e2e = perf() - res.start
                    return res
                last: float | None = None
                buf = b""
                done = False
                async for raw in resp.aiter_raw():
                    now = perf()
                    got_bytes = True
                    buf += raw
                    if b"\n" not in raw:
                        continue
                    lines = buf.split(b"\n")
                    buf = lines.pop()
                    for line in lines:
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                        else:
                            last = _read_event(res, json.loads(data), chat, now, last)
                res.e2e = perf() - res.start
                res.ok = res.error is None and (done or res.finish_reason is not None)
                if not res.ok and res.error is None:
                    res.error = "stream ended without [DONE] or finish_reason"
                return res
        except RETRYABLE as e:
            if got_bytes or attempt >= max_retries:
                res.error = f"{type(e).__name__}: {e}"
                res.e2e = perf() - res.start
                return res
            attempt += 1
            res.connect_retries += 1
            await asyncio.sleep(min(0.005 * attempt, 0.1))
        except (httpx.HTTPError, ValueError) as e:
            res.error = f"{type(e).__name__}: {e}"
            res.e2e = perf() - res.start
            return res
