"""Sleep mode on the engine thread (vLLM's /sleep and /wake_up, by their tags).

"kv_cache": the KV pools are let go (the prefix cache in memory empties with them; the
SSD tier keeps its files) and made anew, zeroed, on waking. "weights": on a GPU the
weights are copied to host memory (numpy) and their device arrays let go, then copied
back on waking; on the CPU they already are in host memory and stay. A sleeping engine
takes no requests. What is dropped outright (vLLM's level 2) is the registry's: it
unloads the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from pippin import heap
from pippin.engine.client import SLEEP_TAGS as TAGS
from pippin.engine.types import EngineError, RequestOutput
from pippin.kernels.fused_proj import Part, Shared

if TYPE_CHECKING:
    from pippin.engine.core import EngineCore

ASLEEP = "the server was put to sleep"

# numpy has no bfloat16: such weights travel as their bits.
_BITS = {mx.bfloat16: mx.uint16}

HostWeights = list[tuple[str, np.ndarray, mx.Dtype]]


def _fused(model: Any) -> list[Shared]:
    """The fused projections' shared state (`pippin.kernels.fused_proj`): their parts keep
    views of the fused arrays outside the model's parameters."""
    found = {id(m.shared): m.shared for m in model.modules() if isinstance(m, Part)}
    return list(found.values())


def to_host(model: Any) -> HostWeights:
    """Copy `model`'s parameters to numpy and put empty arrays in their place."""
    host: HostWeights = []
    for name, a in tree_flatten(model.parameters()):
        bits = _BITS.get(a.dtype)
        host.append((name, np.array(a.view(bits) if bits else a), a.dtype))
    model.update(tree_unflatten([(n, mx.zeros((0,), dt)) for n, _, dt in host]))
    for shared in _fused(model):
        shared.rebind()  # views of the empty arrays: the old buffers go
    return host


def from_host(model: Any, host: HostWeights) -> None:
    arrays = []
    for name, a, dt in host:
        x = mx.array(a)
        arrays.append((name, x.view(dt) if dt in _BITS else x))
    model.update(tree_unflatten(arrays))
    mx.eval([a for _, a in arrays])
    for shared in _fused(model):
        shared.rebind()


def _release() -> None:
    heap.collect()
    mx.clear_cache()


def put_to_sleep(
    core: EngineCore, tags: frozenset[str], abort: bool, offload: bool | None = None
) -> tuple[dict[str, int], list[RequestOutput]]:
    """Put `tags` to sleep; with `abort`, the running requests end first (their outputs
    are returned), else EngineError while any runs. `offload` (None: on a GPU) moves the
    weights to the host for "weights". Returns the stats after it."""
    if not tags <= TAGS:
        raise EngineError(f"unknown sleep tags {sorted(tags - TAGS)}; known: {sorted(TAGS)}")
    if core.spec is not None or core.config.tensor_parallel is not None:
        raise EngineError(
            "sleep mode is not available with speculative decoding or tensor parallel"
        )
    outs: list[RequestOutput] = []
    if core.has_work():
        if not abort:
            raise EngineError("requests are running")
        outs = core.fail_all(ASLEEP)
    if "kv_cache" in tags and "kv_cache" not in core.asleep:
        core.tiers.pools_reset()  # the cached blocks' KV goes with the pools
        core.runner.pools = {}
        core.runner.graph = None  # the compiled step holds the pools too
        core.kv_bytes = 0
    if offload is None:
        offload = mx.default_device().type == mx.gpu
    if "weights" in tags and offload and core.host_weights is None:
        core.host_weights = to_host(core.loaded.model)
    core.asleep = core.asleep | tags
    _release()
    return core.stats(), outs


def wake(core: EngineCore, tags: frozenset[str]) -> dict[str, int]:
    """Bring `tags` back (weights first: the pools' compiled step reads them)."""
    if not tags <= TAGS:
        raise EngineError(f"unknown wake-up tags {sorted(tags - TAGS)}; known: {sorted(TAGS)}")
    if "weights" in tags and core.host_weights is not None:
        from_host(core.loaded.model, core.host_weights)
        core.host_weights = None
    if "kv_cache" in tags and "kv_cache" in core.asleep:
        core.runner.allocate(core.num_blocks)
        core.kv_bytes = core.runner.pool_bytes + (
            core.snapshots.max_bytes if core.snapshots is not None else 0
        )
    core.asleep = core.asleep - tags
    return core.stats()
