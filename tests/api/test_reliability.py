"""Under load and faults: what clients see and what the engine keeps (docs/reliability.md).

Real `pippin serve` processes on a tiny random model, over real HTTP: a storm of streams
killed mid-way, a client that stops reading, slowloris connections, --request-timeout,
--max-queue, --api-keys with their limits and prefix caches, and SIGTERM's drain. "No KV
leaked" is read from /v1/engine/stats: every block back on the free list once idle.

No check here depends on how fast the machine is: each waits for an event (the engine's
counters, a log line, a stream's end) under a generous limit that only guards against a
hang, and every request that must outlast a limit asks for far more tokens than any
machine generates before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from support.errors import assert_api_error
from support.server_utils import Server, engine_process_pid, run_server
from support.waiting import HANG_S, wait_for

MSG = [{"role": "user", "content": "Hello, how are you today?"}]
LONG = 30000  # tokens: more than any machine generates before a limit of seconds ends them


def stats(server: Server) -> dict[str, int]:
    return server.http().get("/v1/engine/stats").json()


def wait_idle(server: Server, timeout: float = HANG_S) -> dict[str, int]:
    """The engine's counters once nothing runs or waits and every block is free again (or
    as they are after `timeout`, a hang guard: the caller's assertions then fail)."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(server)
        idle = s["running"] == 0 and s["waiting"] == 0
        if idle and s["blocks_free"] == s["blocks_total"] or time.monotonic() > deadline:
            return s
        time.sleep(0.2)


def stream_body(max_tokens: int, model: str = "tiny") -> dict[str, Any]:
    return {
        "model": model,
        "messages": MSG,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }


def raw_stream(
    server: Server, body: dict[str, Any], key: str | None = None, rcvbuf: int | None = None
) -> socket.socket:
    """A streaming chat request on a plain socket (read or not by the caller)."""
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    auth = f"x-api-key: {key}\r\n" if key else ""
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n{auth}"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def serve_tiny(tiny_models: Callable[..., Path], *flags: str, **kw: Any) -> Any:
    """`pippin serve` of the tiny Llama, served as "tiny"."""
    return run_server(str(tiny_models("llama")), "--served-model-name", "tiny", *flags, **kw)


@pytest.fixture(scope="module")
def server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    with serve_tiny(
        tiny_models,
        "--max-model-len",
        "32768",
        "--block-size",
        "16",
    ) as s:
        yield s


def test_storm_of_killed_streams_leaks_no_blocks(server: Server) -> None:
    """Many streams whose clients vanish mid-stream (connections reset, tasks cancelled)."""
    before = wait_idle(server)
    killed = 0

    async def one(i: int) -> bool:
        client = server.async_client()
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"story {i} " * (i % 7 + 1)}],
            max_tokens=2000,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        n = 0
        async for _ in stream:
            n += 1
            if n >= 3 + i % 5:
                break
        await stream.close()  # the connection goes away mid-stream
        await client.close()
        return True

    async def storm() -> int:
        # Raw sockets too: closed without a word, some before any byte is read.
        socks = [raw_stream(server, stream_body(2000)) for _ in range(8)]
        done = await asyncio.gather(*(one(i) for i in range(24)))
        await asyncio.sleep(0.3)
        for i, s in enumerate(socks):
            if i % 2:
                s.recv(512)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            s.close()  # RST
        return sum(done) + len(socks)

    killed = asyncio.run(storm())
    after = wait_idle(server)
    assert killed == 32
    assert after["running"] == 0 and after["waiting"] == 0
    assert after["blocks_free"] == after["blocks_total"] == before["blocks_total"]
    # And the server still answers.
    r = server.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=4)
    assert r.choices[0].finish_reason == "length"


def test_slowloris_and_a_stalled_reader_do_not_stall_other_streams(server: Server) -> None:
    # Slowloris: connections that send half a request and then trickle a byte now and then.
    host, port = server.url.removeprefix("http://").split(":")
    loris = []
    for _ in range(40):
        s = socket.create_connection((host, int(port)))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-a: ")
        loris.append(s)
    # A client that asks for a long stream and never reads it, with a tiny receive window;
    # large chunks (20 alternatives per token) fill the socket buffers sooner.
    body = {**stream_body(30000), "logprobs": True, "top_logprobs": 20}
    stalled = raw_stream(server, body, rcvbuf=4096)
    try:
        wait_for(lambda: stats(server)["running"], "the unread stream running")
        for s in loris:
            s.sendall(b"b")
        # Other streams run to the end meanwhile; a stall would hang them (the client's
        # timeout is the hang guard: it raises).
        client = server.client(timeout=HANG_S)
        for _ in range(3):
            chunks = list(
                client.chat.completions.create(
                    model="tiny",
                    messages=MSG,
                    max_tokens=64,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
            assert chunks[-1].choices[0].finish_reason == "length"
        # The stalled stream is ended once its buffer is full: its blocks come back
        # although its client still holds the connection open without reading.
        after = wait_idle(server, timeout=2 * HANG_S)
        assert after["running"] == 0, after
        assert after["blocks_free"] == after["blocks_total"]
    finally:
        stalled.close()
        for s in loris:
            s.close()
    assert "outputs unread" in server.log()  # ended by the buffer cap, not by its length


@pytest.fixture(scope="module")
def limited(
    tiny_models: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys.write_text(
        "keys:\n"
        "  - {key: sk-rpm, name: rpm, requests_per_minute: 3}\n"
        "  - {key: sk-conc, name: conc, concurrent_requests: 1}\n"
        "  - {key: sk-tpm, name: tpm, tokens_per_minute: 50}\n"
        "  - {key: sk-free, name: free}\n"
    )
    with serve_tiny(
        tiny_models,
        "--max-model-len",
        "32768",
        "--block-size",
        "16",
        "--max-num-seqs",
        "1",
        "--max-queue",
        "1",
        "--request-timeout",
        "4",
        "--api-keys",
        str(keys),
        api_key="sk-admin",
    ) as s:
        yield s


def _post(server: Server, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"x-api-key": key}, timeout=120)


def test_requests_per_minute_limit(limited: Server) -> None:
    body = {"model": "tiny", "messages": MSG, "max_tokens": 2}
    codes = [_post(limited, "sk-rpm", "/v1/chat/completions", body).status_code for _ in range(3)]
    assert codes == [200, 200, 200]
    r = _post(limited, "sk-rpm", "/v1/chat/completions", body)
    assert r.status_code == 429
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    a = _post(limited, "sk-rpm", "/v1/messages", body)
    assert a.status_code == 429
    assert a.json()["error"]["type"] == "rate_limit_error"
    assert "retry-after" in a.headers
    # Other keys are not affected; unknown keys are refused; secrets are never logged.
    assert _post(limited, "sk-free", "/v1/chat/completions", body).status_code == 200
    assert _post(limited, "sk-admin", "/v1/chat/completions", body).status_code == 200
    assert _post(limited, "sk-nope", "/v1/chat/completions", body).status_code == 401
    log = limited.log()
    assert "sk-rpm" not in log and "sk-free" not in log and "rpm" in log


def test_tokens_per_minute_limit(limited: Server) -> None:
    body = {"model": "tiny", "messages": MSG, "max_tokens": 40, "ignore_eos": True}
    assert _post(limited, "sk-tpm", "/v1/chat/completions", body).status_code == 200
    r = _post(limited, "sk-tpm", "/v1/chat/completions", body)
    assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"
    assert int(r.headers["retry-after"]) >= 1


def test_concurrency_limit_and_queue_limit(limited: Server) -> None:
    """One running (max-num-seqs 1), one queued (max-queue 1): the next is refused."""
    long = stream_body(LONG)
    first = raw_stream(limited, long, "sk-admin")
    # Read to the end (in the background), so the running stream is never ended as a
    # stalled reader's: it runs until closed, whatever the machine's speed.
    started = threading.Event()
    reader = threading.Thread(target=_read_all, args=(first, started), daemon=True)
    reader.start()
    try:
        assert started.wait(HANG_S), "the first stream has no output"
        # The concurrency limit of a key.
        c1 = raw_stream(limited, long, "sk-conc")
        wait_for(lambda: stats(limited)["waiting"], "the second request queued")
        r = _post(limited, "sk-conc", "/v1/chat/completions", {**long, "stream": False})
        assert r.status_code == 429 and "concurrent" in r.json()["error"]["message"]
        # c1 waits in the queue (one request running): the queue is full.
        r = _post(limited, "sk-free", "/v1/chat/completions", {**long, "stream": False})
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "queue_full"
        assert r.headers["retry-after"] == "1"
        a = anthropic.Anthropic(base_url=limited.url, api_key="sk-free", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as exc:
            a.messages.create(model="tiny", max_tokens=4, messages=MSG)  # type: ignore[arg-type]
        assert exc.value.status_code == 529
        assert exc.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
        c1.close()
    finally:
        with contextlib.suppress(OSError):
            first.shutdown(socket.SHUT_RDWR)  # wakes the reader
        first.close()
        reader.join(HANG_S)
    wait_idle(limited)


def _read_all(sock: socket.socket, started: threading.Event) -> None:
    """Read `sock` until it closes; `started` once three events have come."""
    seen = 0
    try:
        while data := sock.recv(65536):
            seen += data.count(b"data:")
            if seen >= 3:
                started.set()
    except OSError:
        pass


def test_request_timeout_ends_requests_with_the_apis_error(limited: Server) -> None:
    """Each request asks for far more tokens than any machine makes in the 4 s limit: the
    timeout, not the machine's speed, ends it."""
    long = {"model": "tiny", "messages": MSG, "max_tokens": LONG, "ignore_eos": True}
    r = _post(limited, "sk-free", "/v1/chat/completions", long)
    assert_api_error(r, 504, code="request_timeout")
    # Anthropic has no ignore_eos; greedy, this model does not write its end token in 30k
    # tokens (sampled, it can end after ~2k).
    body = {k: v for k, v in long.items() if k != "ignore_eos"} | {"temperature": 0}
    assert_api_error(_post(limited, "sk-free", "/v1/messages", body), 504)
    # In a stream: an error event, no finish reason.
    client = openai.OpenAI(base_url=f"{limited.url}/v1", api_key="sk-free", max_retries=0)
    with pytest.raises(openai.APIError) as exc:
        for _ in client.chat.completions.create(
            model="tiny",
            messages=MSG,
            max_tokens=LONG,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            pass
    assert "timed out" in str(exc.value)
    s = wait_idle(limited)
    assert s["blocks_free"] == s["blocks_total"]


def test_each_key_has_its_own_prefix_cache(limited: Server) -> None:
    prompt = "A long shared system prompt about the weather in spring. " * 12

    def cached(key: str) -> int:
        r = _post(
            limited, key, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        )
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("sk-free") == 0
    assert cached("sk-free") >= 64  # its own second request hits
    assert cached("sk-admin") == 0  # another key never sees its blocks
    assert cached("sk-admin") >= 64


def test_drain_finishes_in_flight_requests_and_refuses_new_ones(
    tiny_models: Callable[..., Path], tmp_path: Path
) -> None:
    with serve_tiny(
        tiny_models,
        "--max-model-len",
        "4096",
        "--drain-timeout",
        str(int(5 * HANG_S)),  # a hang guard: the streams end by themselves
        "--ssd-cache-dir",
        str(tmp_path / "ssd"),
    ) as s:
        results: list[Any] = []
        started = threading.Semaphore(0)

        def streamer(n: int) -> None:
            chunks = []
            for chunk in s.client().chat.completions.create(
                model="tiny",
                messages=MSG,
                max_tokens=n,
                stream=True,
                extra_body={"ignore_eos": True},
            ):
                if not chunks:
                    started.release()
                chunks.append(chunk)
            results.append(chunks[-1].choices[0].finish_reason)

        # Long enough to be in flight after SIGTERM on a fast machine (~1k tokens/s here).
        threads = [threading.Thread(target=streamer, args=(3000 + 50 * i,)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=HANG_S)
        os.kill(s.proc.pid, signal.SIGTERM)
        wait_for(lambda: s.http().get("/health").status_code == 503, "/health saying 503")
        r = s.http().post("/v1/chat/completions", json={"model": "tiny", "messages": MSG})
        assert r.status_code == 503 and "retry-after" in r.headers
        a = s.http().post("/v1/messages", json={"model": "tiny", "messages": MSG, "max_tokens": 2})
        assert a.status_code == 529 and a.json()["error"]["type"] == "overloaded_error"
        for t in threads:
            t.join(5 * HANG_S)
            assert not t.is_alive(), "a stream did not end (hang)"
        s.proc.wait(HANG_S)
        assert results == ["length"] * 4  # none lost
        lost = len(threads) - results.count("length")
        print(f"drain: {len(threads)} streams in flight at SIGTERM, {lost} lost")
        # All four were still running when the drain began, and it ended by itself.
        assert "draining: 4 request(s) in flight" in s.log()
        assert "drained in" in s.log() and "drain timeout" not in s.log()


def test_drain_timeout_ends_what_is_left_with_an_error(tiny_models: Callable[..., Path]) -> None:
    with serve_tiny(
        tiny_models,
        "--max-model-len",
        "32768",
        "--drain-timeout",
        "1",
    ) as s:
        # 30k tokens: no machine finishes them in the 1 s the drain waits. The read timeout
        # is the hang guard.
        with httpx.stream(
            "POST", f"{s.url}/v1/chat/completions", json=stream_body(LONG), timeout=HANG_S
        ) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data:")
            os.kill(s.proc.pid, signal.SIGTERM)
            rest = [line for line in lines if line.startswith("data: {")]
        assert "shutting down" in rest[-1]
        s.proc.wait(HANG_S)
        # Ended by the drain's limit, not by its length.
        assert "drain timeout: ending 1 request(s) with an error" in s.log()


BACK = "the engine process is back"  # logged once a restarted engine is ready


def _cmdline(pid: int) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def test_engine_process_crash_errors_every_client_at_once_and_restarts(
    tiny_models: Callable[..., Path],
) -> None:
    """Streams running, requests queued behind them, and non-streamed ones: all get an
    error right after the engine process dies; /health says 503 until it is back."""
    with serve_tiny(
        tiny_models,
        "--max-model-len",
        "32768",
        "--max-num-seqs",
        "4",
        "--engine-process",
    ) as s:
        child = engine_process_pid(s)
        ended: list[float] = []
        errors: list[str] = []

        def client(i: int) -> None:
            try:
                if i % 2:
                    r = s.http().post(
                        "/v1/chat/completions", json={**stream_body(30000), "stream": False}
                    )
                    errors.append(r.json()["error"]["message"])
                else:
                    with s.http().stream(
                        "POST", "/v1/chat/completions", json=stream_body(30000)
                    ) as resp:
                        lines = [x for x in resp.iter_lines() if x.startswith("data: {")]
                    errors.append(json.loads(lines[-1][6:])["error"]["message"])
            finally:
                ended.append(time.monotonic())

        threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        # 4 running, the rest queued.
        wait_for(lambda: stats(s)["waiting"] >= 6, "six requests queued")
        time.sleep(0.5)
        killed = time.monotonic()
        os.kill(child, signal.SIGKILL)
        for t in threads:
            t.join(HANG_S)
        assert len(ended) == 10
        assert all("engine process exited" in e for e in errors), errors
        print(f"crash to error at every client: max {(max(ended) - killed) * 1000:.0f} ms")
        # Health answers 200 only once the "back" line is logged (the same step of the
        # event loop): a 503 seen before that line is a 503 while the engine was down.
        code = s.http().get("/health").status_code
        if BACK not in s.log():
            assert code == 503
        wait_for(lambda: BACK in s.log(), "the engine process restarted", 2 * HANG_S)
        # "At once": every client had its error before the restart, never after (each
        # request's log line is written once its response is sent).
        log = s.log()
        answered = re.findall(r"endpoint=/v1/chat/completions status=\d+", log[: log.index(BACK)])
        assert len(answered) == 10, log[-3000:]
        wait_for(lambda: s.http().get("/health").status_code == 200, "/health saying 200")
        print(f"crash to healthy again: {time.monotonic() - killed:.1f} s")
        assert engine_process_pid(s) != child
        r = s.client().chat.completions.create(model="tiny", messages=MSG, max_tokens=4)
        assert r.choices[0].finish_reason is not None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("[]", "non-empty list"),
        ("- {name: a}", "non-empty string 'key'"),
        ("- {key: k, requests_per_minute: 0}", "positive integer"),
        ("- {key: k, rpm: 3}", "unknown field"),
        ("- {key: k}\n- {key: k}", "same key twice"),
        ("[{", "not valid JSON or YAML"),
    ],
)
def test_bad_api_keys_files_are_refused_without_echoing_secrets(
    tmp_path: Path, text: str, error: str
) -> None:
    from pippin.serving.admission import KeyFileError, load_keys

    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(KeyFileError, match=error) as exc:
        load_keys(path)
    assert "k," not in str(exc.value)


def test_api_keys_file_in_json(tmp_path: Path) -> None:
    from pippin.serving.admission import load_keys

    path = tmp_path / "keys.json"
    path.write_text(
        '{"keys": [{"key": "sk-1", "name": "a", "tokens_per_minute": 10}, {"key": "sk-2"}]}'
    )
    a, b = load_keys(path)
    assert (a.name, a.tokens_per_minute, b.name) == ("a", 10, "key-2")
    assert a.salt != b.salt and "sk-1" not in repr(a)
