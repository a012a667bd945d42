"""`pippin.heap`: a started server's objects leave the garbage collector's scans, and what
gives memory back (unload, sleep, a replaced pool) still reaches their cycles."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.server_utils import run_server

from pippin import heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only a collection frees it


@pytest.fixture
def freeze(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], int]]:
    """The real `heap.freeze` (conftest.py stands in for it in this process), the heap
    thawed again after the test and its recorded count put back."""
    monkeypatch.setattr(heap, "_frozen", heap.frozen())
    yield heap.freeze.__wrapped__  # type: ignore[attr-defined]
    gc.unfreeze()


def test_freeze_keeps_cycles_from_plain_collections_until_collect(
    freeze: Callable[[], int],
) -> None:
    node = _Node()
    ref = weakref.ref(node)
    assert freeze() > 0 and heap.frozen() > 0
    del node
    gc.collect()
    assert ref() is not None  # frozen: a full collection does not scan it
    heap.collect()
    assert ref() is None and heap.frozen() > 0  # thawed, collected, the rest frozen again


def test_the_count_is_kept_not_walked(
    freeze: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine stats report `frozen`, and an engine process sends them with every step's
    outputs: CPython counts the permanent generation by walking it (20 ms over a served
    model's 300,000 objects on a 2-core CPU), so the count is the one taken at the freeze."""
    n = freeze()

    def walk() -> int:
        raise AssertionError("walked the frozen heap")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    assert heap.frozen() == n > 0


def test_the_switch_turns_it_off(
    freeze: Callable[[], int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPPIN_FREEZE_HEAP", "0")
    assert freeze() == 0 == heap.frozen()
    heap.collect()  # nothing frozen: a plain full collection, and nothing frozen after
    assert heap.frozen() == 0


def test_a_started_server_has_frozen_its_heap(tiny_models: Callable[..., Path]) -> None:
    """The engine reports its process's frozen objects (the model, tokenizer and imports:
    tens of thousands), and the server keeps serving."""
    with run_server(str(tiny_models("llama")), "--served-model-name", "tiny") as server:
        with server.http() as h:
            stats = h.get("/v1/engine/stats").json()
        assert stats["gc_frozen_objects"] > 10_000
        r = server.client().completions.create(model="tiny", prompt="hello", max_tokens=3)
        assert r.usage is not None and r.usage.completion_tokens == 3
