"""A worker rank of a tensor-parallel group (`python -m pippin.engine.tp.worker`).

Started by rank 0 (`tp/launch.py`) with its rank's environment. It joins the group,
loads its shard of the model, connects to rank 0's plan channel, and runs every model
call rank 0 sends (`runner.distributed.run_worker`). It has no scheduler, no HTTP and no
sampler. When rank 0 is gone (its socket closes) it ends at once, even in the middle
of a collective that would never return.
"""

from __future__ import annotations

import argparse
import base64
import logging
import os
import pickle
import queue
import threading
from multiprocessing.connection import Client, Connection
from typing import Any

log = logging.getLogger("pippin.engine.tp.worker")


def _reader(conn: Connection, inbox: queue.SimpleQueue[tuple[Any, ...]]) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            os._exit(0)  # rank 0 is gone: nothing is left to do, and a collective may hang
        inbox.put(msg)
        if msg[0] == "stop":
            return


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="pippin.engine.tp.worker")
    ap.add_argument("--channel", required=True)
    ap.add_argument("--authkey", required=True)
    ap.add_argument("--backend", required=True)
    ap.add_argument("--spec", required=True)
    args = ap.parse_args(argv)
    spec = pickle.loads(base64.b64decode(args.spec))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    from pippin.engine.tp.rank0 import _init_group, load_shard
    from pippin.runner.distributed import WorkerRunner, run_worker

    config = spec["config"]
    group = _init_group(args.backend)
    rank = group.rank()
    loaded = load_shard(spec["load_kwargs"], group)
    host, port = args.channel.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=args.authkey.encode())
    conn.send(("hello", rank))
    inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
    threading.Thread(target=_reader, args=(conn, inbox), daemon=True).start()
    runner = WorkerRunner(
        loaded.model,
        config.block_size,
        config.kv_bits,
        config.kv_group_size,
        config.kernels,
        group=group,
    )
    log.info("rank %d of %d ready", rank, group.size())
    try:
        run_worker(runner, inbox.get, lambda: conn.send(("done",)))
    except Exception:
        log.exception("rank %d failed", rank)
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
