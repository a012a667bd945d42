"""A progress bar on stderr, without dependencies: redrawn in place on a terminal, a line
per window elsewhere (CI logs)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.label = ""
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.t0 = time.monotonic()
        self._drawn = 0.0

    def start(self, label: str) -> None:
        self.label = label
        if self.enabled and not self.tty:
            print(f"[{self.done}/{self.total}] {label}", file=self.stream, flush=True)
        self._draw(force=True)

    def advance(self, n: int = 1) -> None:
        self.done += n
        self._draw()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.tty or (not force and now - self._drawn < 0.1 and self.done < self.total):
            return
        self._drawn = now
        frac = min(self.done / self.total, 1.0)
        width = 30
        bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
        elapsed = now - self.t0
        eta = elapsed / frac - elapsed if frac > 0 else 0.0
        line = f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f}s eta {eta:4.0f}s {self.label}"
        self.stream.write(line[:160].ljust(100))
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()
