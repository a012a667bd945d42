"""The SSD tier after a writer killed mid-write: never wrong KV after the restart.

A child process writes large blocks through `SsdStore` as fast as it can and is
SIGKILLed at random moments (inside a file write, between the rename and the index
commit, ...). After each kill the store is opened again, as a restarted server would:
every block its index lists must read back byte for byte, and no temporary file is left.
(Corrupt and truncated files: tests/engine/test_ssd_cache.py.)
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from pippin.engine.ssd_store import SsdStore

FP = "crash-test"
BLOCK = 2 * 1024 * 1024  # large enough that a kill often lands inside a write

WRITER = f"""
import sys
import numpy as np
from pippin.engine.ssd_store import SsdStore

store = SsdStore(sys.argv[1], {FP!r}, {BLOCK}, 1 << 40, queue_blocks=4)
key = int(sys.argv[2])
print("ready", flush=True)
while True:
    payload = np.random.default_rng(key).integers(0, 255, {BLOCK}, dtype=np.uint8)
    store.put(key, (key, key + 1), [payload], block=True)
    key += 1
"""


def expected(key: int) -> bytes:
    return np.random.default_rng(key).integers(0, 255, BLOCK, dtype=np.uint8).tobytes()


def test_killed_writer_never_leaves_wrong_blocks(tmp_path: Path) -> None:
    root = tmp_path / "ssd"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    rng = random.Random(0)
    start, verified = 0, 0
    for _ in range(4):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root), str(start)],
            stdout=subprocess.PIPE,
            env=env,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.3, 1.2))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        store = SsdStore(root, FP, BLOCK, 1 << 40)
        try:
            assert not list((root / FP).glob("*/*.tmp"))  # cleaned at open
            keys = sorted(store.keys)
            store.request([(k, (k, k + 1)) for k in keys])
            results: list = []
            deadline = time.monotonic() + 60
            while len(results) < len(keys) and time.monotonic() < deadline:
                results += store.completed()
                time.sleep(0.01)
            assert len(results) == len(keys)
            for r in results:
                assert r.payload == expected(r.key), r.key
            assert store.corrupt == 0
            verified += len(keys)
            start = (max(keys) + 1 if keys else start) + 1000
        finally:
            store.close()
    assert verified > 0
