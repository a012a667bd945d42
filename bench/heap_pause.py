"""The garbage collector's full collection with the default model served, before and after
`pippin.heap.freeze` (what a server does once its engine has started): the objects it
scans and the milliseconds each collection stops every thread of the process for.

    PYTHONPATH=src .venv/bin/python bench/heap_pause.py --repeat 3
"""

from __future__ import annotations

import argparse
import gc
import time

from pippin import heap
from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.store import loader


def full_collections(n: int) -> list[float]:
    """Milliseconds of `n` full collections, one after another."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t) * 1000)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3, help="full collections timed per row")
    args = ap.parse_args()
    core = EngineCore(loader.load_model(None), EngineConfig(max_model_len=2048))
    assert core.stats()["gc_frozen_objects"] == 0  # nothing froze yet: only a server does
    scanned = len(gc.get_objects())
    before = full_collections(args.repeat)
    frozen = heap.freeze()
    after = full_collections(args.repeat)
    print("| heap | objects scanned | full collection, ms |")
    print("|---|---|---|")
    print(f"| as loaded | {scanned:,} | {' / '.join(f'{x:.1f}' for x in before)} |")
    left = len(gc.get_objects())
    print(f"| frozen ({frozen:,}) | {left:,} | {' / '.join(f'{x:.1f}' for x in after)} |")


if __name__ == "__main__":
    main()
