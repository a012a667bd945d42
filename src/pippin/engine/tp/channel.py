"""Rank 0's plan channel to the other ranks, and its watchdog.

Each model call's plan is host data (positions, lengths, block tables) of a size that
changes every step, so it goes over a socket of its own (`multiprocessing.connection`,
pickled, with an auth key) rather than through collectives: sending it costs rank 0 no
device sync, and a closed socket tells at once that a rank is gone, which a collective
does not (NCCL's wait forever). The token ids travel in the model call itself (see
`runner/distributed.py`).

Each worker answers every model call with ``("done",)``. The watchdog takes the group
for lost when a worker's socket closes, a local rank's process exits, or a call has
gone unanswered for `timeout_s`; then `on_lost` runs once (rank 0 ends its engine
process, and the API process fails the requests in flight and restarts the group).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener
from typing import Any

log = logging.getLogger(__name__)


class Channel:
    def __init__(self, address: tuple[str, int], authkey: bytes, bind_all: bool) -> None:
        host = "0.0.0.0" if bind_all else address[0]
        self.listener = Listener((host, address[1]), authkey=authkey)
        self.conns: dict[int, Connection] = {}
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self._sent: dict[int, deque[float]] = {}
        # Sends hold `_lock` (a worker that stops reading can block one); the watchdog
        # never takes it, so it can still fire then.
        self._lock = threading.Lock()
        self._lost_lock = threading.Lock()
        self._lost: str | None = None
        self._on_lost: Callable[[str], None] | None = None
        self.timeout_s = 0.0

    def accept(self, ranks: int, deadline_s: float) -> None:
        """Wait for ranks 1..ranks-1 to connect (each says its rank first)."""
        result: list[BaseException] = []

        def run() -> None:
            try:
                while len(self.conns) < ranks - 1:
                    conn = self.listener.accept()
                    kind, rank = conn.recv()
                    assert kind == "hello"
                    self.conns[int(rank)] = conn
                    self._sent[int(rank)] = deque()
            except BaseException as e:  # the listener closed, a bad key
                result.append(e)

        t = threading.Thread(target=run, name="pippin-tp-accept", daemon=True)
        t.start()
        end = time.monotonic() + deadline_s
        while t.is_alive() and time.monotonic() < end:
            t.join(0.2)
            gone = self._exited()
            if gone:
                raise RuntimeError(gone)
        if t.is_alive():
            raise RuntimeError(f"the other ranks did not connect within {deadline_s:.0f} s")
        if result:
            raise RuntimeError(f"a rank could not connect: {result[0]}")

    def _exited(self) -> str | None:
        for rank, p in self.procs.items():
            code = p.poll()
            if code is not None:
                return f"rank {rank} exited (code {code})"
        return None

    def send(self, msg: tuple[Any, ...]) -> None:
        now = time.monotonic()
        with self._lock:
            for rank, conn in self.conns.items():
                try:
                    conn.send(msg)
                except (OSError, ValueError):
                    self.lost(f"rank {rank} is gone (its plan channel closed)")
                    return
                if msg[0] == "forward":
                    self._sent[rank].append(now)

    def watch(self, timeout_s: float, on_lost: Callable[[str], None]) -> None:
        """Start the watchdog: a reader per worker and a thread that checks the clock."""
        self.timeout_s = timeout_s
        self._on_lost = on_lost
        for rank, conn in self.conns.items():
            threading.Thread(
                target=self._read, args=(rank, conn), name=f"pippin-tp-rank{rank}", daemon=True
            ).start()
        threading.Thread(target=self._check, name="pippin-tp-watchdog", daemon=True).start()

    def _read(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                self.lost(f"rank {rank} is gone (its plan channel closed)")
                return
            if msg[0] == "done":
                try:
                    self._sent[rank].popleft()
                except IndexError:
                    pass

    def _check(self) -> None:
        while self._lost is None:
            time.sleep(0.5)
            gone = self._exited()
            if gone:
                self.lost(gone)
                return
            now = time.monotonic()
            late = [r for r, q in self._sent.items() if _oldest(q, now) > self.timeout_s]
            if late:
                self.lost(f"rank {late[0]} has not finished a model call in {self.timeout_s:.0f} s")
                return

    def lost(self, why: str) -> None:
        with self._lost_lock:
            if self._lost is not None:
                return
            self._lost = why
        log.error("tensor parallel: %s; the group stops", why)
        if self._on_lost is not None:
            self._on_lost(why)

    def close(self, grace_s: float = 5.0) -> None:
        """Tell the workers to stop, then end any that do not."""
        self._lost = self._lost or "closed"
        for conn in self.conns.values():
            try:
                conn.send(("stop",))
            except (OSError, ValueError):
                pass
        end = time.monotonic() + grace_s
        for p in self.procs.values():
            try:
                p.wait(max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        self.kill()

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for conn in self.conns.values():
            conn.close()
        self.listener.close()


def _oldest(sent: deque[float], now: float) -> float:
    """How long the oldest unanswered call has waited (0 when none); safe against the
    reader thread popping meanwhile."""
    try:
        return now - sent[0]
    except IndexError:
        return 0.0
