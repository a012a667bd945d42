"""Waiting on an event in a test: a condition polled until it holds.

The time limit only guards against a hang and fails loudly; it never decides an outcome,
so a test passes on a machine of any speed, however loaded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

HANG_S = 120.0  # far beyond any wait of a working server on a loaded machine


def wait_for(
    check: Callable[[], T], what: str, timeout: float = HANG_S, interval: float = 0.05
) -> T:
    """`check()`'s first truthy result; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not seen in {timeout:g} s (a hang)")
        time.sleep(interval)
