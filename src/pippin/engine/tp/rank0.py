"""Rank 0 of a tensor-parallel group: the engine process of `pippin serve
--tensor-parallel N`.

`ProcessClient` starts it in place of the one-device engine process, with the same pipe
to the API process. It starts the other ranks (`tp/launch.py`), joins the group
(`mx.distributed.init`), loads its shard of the model, waits for the others on the plan
channel, and then serves exactly as the one-device engine process does (`_Child`: the
same `EngineLoop`, scheduler, block manager and prefix cache), except that its model
runner is a `DistributedRunner`, which sends every model call's plan to the other ranks.

When the group is lost (a rank exits, its socket closes, or a model call goes unanswered
for the timeout), this process ends at once: a rank blocked in a collective may never
return, so nothing here waits for one. The API process sees the pipe close, ends every
request in flight with an error, answers /health with 503, and starts the group again
(`ProcessClient`'s restarts).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from functools import partial
from multiprocessing.connection import Connection
from typing import Any

from pippin.engine.config import EngineConfig
from pippin.engine.process_client import OnLoaded, OnStart, _Child, start_child
from pippin.engine.tp import launch
from pippin.engine.tp.channel import Channel

log = logging.getLogger(__name__)

# How long rank 0 waits for the other ranks to load their shards and connect.
CONNECT_TIMEOUT_S = 600.0


def _init_group(backend: str) -> Any:
    import mlx.core as mx

    return mx.distributed.init(strict=True, backend=backend)


def load_shard(load_kwargs: dict[str, Any], group: Any) -> Any:
    """This rank's shard of the model, read lazily so only the shard is materialised.
    Every rank runs this in the same order: materialising runs a forward pass, whose
    collectives must meet."""
    from pippin.runner.distributed import shard_model
    from pippin.store.loader import load_model, materialize

    loaded = load_model(**load_kwargs, weights=False)
    shard_model(loaded.model, loaded.config, group)
    return materialize(loaded)


def child_main(
    conn: Connection,
    load_kwargs: dict[str, Any],
    config: EngineConfig,
    on_start: OnStart | None,
    on_loaded: OnLoaded | None,
) -> None:
    from pippin.runner.distributed import DistributedRunner

    start_child(on_start)
    tp = config.tensor_parallel
    assert tp is not None
    channel: Channel | None = None
    try:
        p = launch.plan(tp)
        channel = Channel(p.channel, p.authkey, bind_all=not all(h.local for h in p.hosts))
        spec = {"load_kwargs": load_kwargs, "config": config}
        for rank in range(1, tp.size):
            channel.procs[rank] = launch.start_worker(p, rank, spec)
        launch.apply_here(p, 0)
        log.info("tensor parallel: %d ranks over %s", tp.size, p.backend)
        group = _init_group(p.backend)
        if group.size() != tp.size:
            raise RuntimeError(f"the group has {group.size()} ranks, not {tp.size}")
        loaded = load_shard(load_kwargs, group)
        if on_loaded is not None:
            on_loaded(loaded)
        channel.accept(tp.size, CONNECT_TIMEOUT_S)
        runner = partial(DistributedRunner, group=group, send=channel.send)
        child = _Child(loaded, replace(config, make_runner=runner), conn)
        child.ready_info["rank_pids"] = {r: proc.pid for r, proc in channel.procs.items()}
    except BaseException as e:
        if channel is not None:
            channel.kill()
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return

    def lost(why: str) -> None:
        # This process ends at once (see the module's docstring); the API process is
        # told why first, unless the pipe is busy (then it only sees the pipe close).
        child.pipe.send(("exiting", f"tensor parallel: {why}"), timeout=1.0)
        channel.kill()
        os._exit(1)

    channel.watch(tp.timeout_s, lost)
    child.serve()
    channel.close()
