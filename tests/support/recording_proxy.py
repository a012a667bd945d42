"""A reverse proxy that records every request a client sends to a server and the whole
response, and checks each stream's framing.

Several clients share one proxy: each gets its own path prefix (`proxy.base(name)`), which
is stripped before forwarding, so every exchange is known by its client. Responses are
passed on as they arrive (streams stay streams) and kept whole for the checks.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

# Hop-by-hop and length headers: the proxy frames each body itself.
_DROP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


@dataclass
class Exchange:
    client: str
    method: str
    path: str  # as the server saw it, without the client's prefix
    request: bytes
    status: int = 0
    content_type: str = ""
    response: bytes = b""
    complete: bool = False  # the whole response reached the client
    started: float = 0.0  # time.monotonic() when the request arrived
    seconds: float = 0.0  # until the response ended (or the client left)

    def request_json(self) -> dict[str, object]:
        try:
            body = json.loads(self.request)
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}

    def describe(self) -> str:
        """The request (path, the body's key fields and the end of its last message) and the
        response (status, time and an excerpt), for an assertion message."""
        body = self.request_json()
        keys = ("model", "stream", "max_tokens", "max_completion_tokens", "max_output_tokens")
        fields = {k: body[k] for k in keys if k in body}
        last = ""
        for k in ("messages", "input", "tools"):
            items = body.get(k)
            if isinstance(items, list):
                fields[f"len({k})"] = len(items)
                if k != "tools" and items:
                    last = json.dumps(items[-1])
            elif k == "input" and isinstance(items, str):
                last = items
        if last:
            last = f"\n  last {'message' if 'messages' in body else 'input'}: " + (
                repr(last) if len(last) <= 400 else repr(f"{last[:200]} ... {last[-200:]}")
            )
        text = self.response.decode(errors="replace")
        excerpt = text if len(text) <= 1200 else f"{text[:600]} ... {text[-600:]}"
        return (
            f"[{self.client}] {self.method} {self.path} {fields} other keys: "
            f"{sorted(set(body) - set(fields) - {'messages', 'input', 'tools'})}{last}\n"
            f"  -> {self.status} {self.content_type} after {self.seconds:.0f} s "
            f"{'' if self.complete else '(cut off) '}{excerpt!r}"
        )


def sse_events(body: str) -> list[tuple[str | None, str]]:
    """(event name, data) of each event of an SSE body; raises ValueError where the framing
    is broken (no blank line at the end, a line that is no field, an event without data)."""
    if not body.endswith("\n\n"):
        raise ValueError("the stream does not end with a blank line")
    events: list[tuple[str | None, str]] = []
    for block in body.replace("\r\n", "\n").split("\n\n")[:-1]:
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith(":"):  # a comment (keep-alive)
                continue
            key, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"not an SSE field: {line[:200]!r}")
            value = value.removeprefix(" ")
            if key == "event":
                name = value
            elif key == "data":
                data.append(value)
            elif key not in ("id", "retry"):
                raise ValueError(f"not an SSE field: {line[:200]!r}")
        if data:
            events.append((name, "\n".join(data)))
        elif name is not None:
            raise ValueError(f"event {name!r} without data")
    return events


# The streams whose last event `stream_problem` checks: each says how its API ends one.
_ENDED_PATHS = ("/chat/completions", "/completions", "/messages", "/responses")


def stream_problem(ex: Exchange) -> str | None:
    """What is wrong with a 200 response's body for its API, or None: a stream must be
    well framed, hold JSON events and end as its API ends one (`[DONE]` after a chunk
    with a `finish_reason`; `message_stop`; `response.completed` or `.incomplete`).

    A body the proxy did not relay to its end (`complete` False) is cut off, unless it is
    a stream of those APIs: their last event says whether the stream ended, and a client
    that leaves once it has it (Codex on `response.completed`) gets there before the
    proxy reads the upstream's end, or after, by the machine's speed."""
    path = ex.path.split("?")[0]
    ends_known = ex.content_type.startswith("text/event-stream") and path.endswith(_ENDED_PATHS)
    if not ex.complete and not ends_known:
        return "the response was cut off"
    text = ex.response.decode(errors="replace")
    if not ex.content_type.startswith("text/event-stream"):
        if ex.content_type.startswith("application/json"):
            try:
                json.loads(text)
            except ValueError:
                return "the body is not JSON"
        return None
    try:
        events = sse_events(text)
    except ValueError as e:
        return str(e)
    if not events:
        return "an empty stream"
    datas: list[dict[str, object]] = []
    for name, data in events:
        if data == "[DONE]":
            continue
        try:
            obj = json.loads(data)
        except ValueError:
            return f"event data is not JSON: {data[:200]!r}"
        if not isinstance(obj, dict):
            return f"event data is not an object: {data[:200]!r}"
        if name == "error" or obj.get("type") == "error" or "error" in obj:
            return f"an error event: {data[:500]}"
        if name is not None and "type" in obj and obj["type"] != name:
            return f"event {name!r} holds type {obj['type']!r}"
        datas.append(obj)
    if path.endswith(("/chat/completions", "/completions")):
        if events[-1][1] != "[DONE]" or sum(d == "[DONE]" for _, d in events) != 1:
            return "the stream does not end with one [DONE]"
        finished = [
            c
            for d in datas
            for c in d.get("choices") or []  # type: ignore[attr-defined]
            if isinstance(c, dict) and c.get("finish_reason")
        ]
        if not finished:
            return "no chunk has a finish_reason"
    elif path.endswith("/messages"):
        types = [d.get("type") for d in datas]
        if types[0] != "message_start" or types[-1] != "message_stop":
            return f"the stream runs {types[0]} ... {types[-1]}, not message_start ... stop"
        deltas = [d for d in datas if d.get("type") == "message_delta"]
        if not deltas or not deltas[-1].get("delta", {}).get("stop_reason"):  # type: ignore[union-attr]
            return "no message_delta with a stop_reason"
    elif path.endswith("/responses"):
        types = [d.get("type") for d in datas]
        if types[0] != "response.created":
            return f"the stream starts with {types[0]}, not response.created"
        if types[-1] not in ("response.completed", "response.incomplete"):
            return f"the stream ends with {types[-1]}, not response.completed"
        seq = [d.get("sequence_number") for d in datas]
        if seq != list(range(seq[0], seq[0] + len(seq))):  # type: ignore[arg-type]
            return "sequence_number does not count up by one"
    return None


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (its body was read whole before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@dataclass
class RecordingProxy:
    upstream: str  # http://127.0.0.1:PORT
    url: str = ""
    exchanges: list[Exchange] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def base(self, client: str) -> str:
        """The server's base URL as `client` should see it (append /v1 where it wants)."""
        return f"{self.url}/{client}"

    def of(self, client: str) -> list[Exchange]:
        with self._lock:
            return [e for e in self.exchanges if e.client == client]

    def problems(self, client: str, left_at: tuple[float, ...] = ()) -> list[str]:
        """Each exchange of `client` not answered 200 with a well-formed body, described;
        but not one cut off because its client was stopped (at a `time.monotonic()` time
        of `left_at`) while the answer was still coming: the client left, not the server."""
        out = []
        for ex in self.of(client):
            if not ex.complete and any(ex.started <= t <= ex.started + ex.seconds for t in left_at):
                continue
            if ex.status == 0:
                why: str | None = "the client left before the answer began"
            else:
                why = f"status {ex.status}" if ex.status != 200 else stream_problem(ex)
            if why:
                out.append(f"{why}: {ex.describe()}")
        return out

    def app(self) -> Starlette:
        upstream = httpx.AsyncClient(base_url=self.upstream, timeout=None)

        async def forward(request: Request) -> Response:
            client = request.path_params["client"]
            path = "/" + request.path_params["path"]
            if request.url.query:
                path += "?" + request.url.query
            body = await request.body()
            ex = Exchange(client, request.method, path, body, started=time.monotonic())
            with self._lock:
                self.exchanges.append(ex)
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
            headers["accept-encoding"] = "identity"
            req = upstream.build_request(request.method, path, headers=headers, content=body)
            # A client that gives up before the answer starts must be seen to: the
            # server then cancels the request instead of serving no one.
            sending = asyncio.ensure_future(upstream.send(req, stream=True))
            gone = asyncio.ensure_future(_disconnect(request))
            await asyncio.wait({sending, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not sending.done():
                sending.cancel()
                return Response(status_code=499)
            resp = sending.result()
            ex.status = resp.status_code
            ex.content_type = resp.headers.get("content-type", "")
            chunks: list[bytes] = []

            async def relay() -> AsyncIterator[bytes]:
                try:
                    async for chunk in resp.aiter_raw():
                        chunks.append(chunk)
                        yield chunk
                    ex.complete = True
                finally:  # also when the client leaves mid-stream
                    ex.response = b"".join(chunks)
                    ex.seconds = time.monotonic() - ex.started
                    await resp.aclose()

            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP}
            return StreamingResponse(relay(), status_code=resp.status_code, headers=out_headers)

        methods = ["GET", "POST", "HEAD", "DELETE", "PUT", "PATCH", "OPTIONS"]
        return Starlette(routes=[Route("/{client}/{path:path}", forward, methods=methods)])


@contextmanager
def recording_proxy(upstream: str) -> Iterator[RecordingProxy]:
    """A proxy to `upstream` serving from a thread of this process until the block ends."""
    proxy = RecordingProxy(upstream)
    # Listening before uvicorn starts: clients' connections wait in the backlog, so no
    # readiness poll is needed.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    proxy.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(proxy.app(), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        yield proxy
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
