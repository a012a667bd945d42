"""Rank 0's plan channel and its watchdog (`engine/tp/channel.py`), with fake workers on
real sockets: a worker that stops answering, or whose socket closes, takes the group
for lost, once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Client

import pytest

from pippin.engine.tp.channel import Channel
from pippin.engine.tp.launch import free_port


def _group(answer: bool) -> Channel:
    address = ("127.0.0.1", free_port())
    channel = Channel(address, b"key", bind_all=False)

    def worker() -> None:
        c = Client(address, authkey=b"key")
        c.send(("hello", 1))
        while True:
            try:
                msg = c.recv()
            except (EOFError, OSError):
                return
            if msg[0] == "forward" and answer:
                c.send(("done",))
            elif msg[0] == "quit":  # as a process that dies: its socket closes
                c.close()
                return

    threading.Thread(target=worker, daemon=True).start()
    channel.accept(2, deadline_s=10)
    return channel


def _recorder() -> tuple[list[str], threading.Event, Callable[[str], None]]:
    lost: list[str] = []
    event = threading.Event()

    def on_lost(why: str) -> None:
        lost.append(why)
        event.set()

    return lost, event, on_lost


def test_answered_calls_keep_the_group() -> None:
    channel = _group(answer=True)
    lost, event, on_lost = _recorder()
    # A timeout well above a loaded machine's thread scheduling delays.
    channel.watch(timeout_s=10.0, on_lost=on_lost)
    for _ in range(20):
        channel.send(("forward", []))
        time.sleep(0.1)
    assert not event.wait(1.5), lost
    channel.kill()


def test_an_unanswered_call_loses_the_group_after_the_timeout() -> None:
    channel = _group(answer=False)
    lost, event, on_lost = _recorder()
    channel.watch(timeout_s=1.0, on_lost=on_lost)
    t0 = time.monotonic()
    channel.send(("forward", []))
    assert event.wait(10)
    assert 1.0 <= time.monotonic() - t0 < 5
    assert lost == ["rank 1 has not finished a model call in 1 s"]
    channel.kill()


def test_a_closed_socket_loses_the_group_at_once() -> None:
    channel = _group(answer=True)
    lost, event, on_lost = _recorder()
    channel.watch(timeout_s=60, on_lost=on_lost)
    channel.send(("quit",))
    assert event.wait(5)
    assert lost == ["rank 1 is gone (its plan channel closed)"]
    channel.lost("again")  # reported once
    assert len(lost) == 1
    channel.kill()


def test_a_rank_that_never_connects_fails_the_start() -> None:
    channel = Channel(("127.0.0.1", free_port()), b"key", bind_all=False)
    with pytest.raises(RuntimeError, match="did not connect"):
        channel.accept(2, deadline_s=0.5)
    channel.kill()
