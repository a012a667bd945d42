"""The prefix cache's tiers, kept in step with the scheduler on the engine thread.

Memory is the block manager's pool (full precision or quantised KV). Below it, an
optional SSD tier (`SsdStore`):

- **Spill**: cached blocks the allocator takes for reuse are copied out of the pool
  (one gather per pool part, launched before the step that overwrites them) and handed
  to the store's writer at the next step, once the copy is done. Blocks already on disk
  are not written again. At shutdown every cached block not yet on disk is written.
- **Promote**: when a request arrives, the keys of its prompt's full blocks are looked up;
  those neither in memory nor already on their way, but on disk, are read by the store's
  reader thread. The request is not admitted until they are back; at the start of a
  scheduler step, finished reads are installed into free blocks of the pool (as cached,
  unreferenced blocks) so the request's admission finds them like any memory hit. Disk
  is never read on the engine thread, so never inside a decode step.

Models with recurrent layers keep per-sequence state that KV blocks cannot rebuild;
they share no prefixes and have no SSD tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from pippin.engine.block_manager import BlockManager
from pippin.engine.kv_fingerprint import kv_fingerprint, raw_view
from pippin.engine.ssd_store import SsdStore
from pippin.runner.model_runner import ModelRunner
from pippin.runner.paged_cache import bytes_per_block

if TYPE_CHECKING:
    from pippin.engine.config import EngineConfig
    from pippin.engine.sequence import Sequence
    from pippin.store.loaded import LoadedModel

log = logging.getLogger(__name__)

GIB = 1024**3
TIERS = ("memory", "ssd")


class CacheTiers:
    def __init__(self, bm: BlockManager, runner: ModelRunner, store: SsdStore | None) -> None:
        self.bm = bm
        self.runner = runner
        self.store = store
        self.ssd_disabled_reason: str | None = None
        bs = bm.block_size
        # (heads, width, numpy dtype of the raw bytes, real dtype) of each pool part, in
        # the order ModelRunner.read_blocks returns them; a block's payload is these
        # parts, [heads, block_size, width] each, back to back.
        self.parts: list[tuple[int, int, np.dtype, mx.Dtype]] = []
        for i in sorted(runner.specs):
            spec = runner.specs[i]
            for width, dtype in spec.part_shapes():
                raw = np.dtype(f"<u{dtype.size}")
                self.parts.append((spec.n_kv_heads, width, raw, dtype))
        self.block_bytes = sum(h * bs * w * raw.itemsize for h, w, raw, _ in self.parts)
        self._spilling: list[tuple[list[tuple[int, int, tuple[int, ...]]], list[mx.array]]] = []
        self._pending: set[int] = set()  # keys being read
        self._waiting: dict[Sequence, set[int]] = {}  # sequences held for pending keys
        self.ssd_lookups = 0
        self.ssd_hits = 0
        self.promoted = 0
        bm.track_evictions = store is not None

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        runner: ModelRunner,
        bm: BlockManager,
        loaded: LoadedModel,
        on_read: Callable[[], None] | None = None,
    ) -> CacheTiers:
        reason = None
        if config.ssd_cache_dir is None:
            reason = "no --ssd-cache-dir"
        elif runner.has_state_layers:
            reason = "the model keeps recurrent per-sequence state, which KV blocks cannot rebuild"
        elif not bm.enable_prefix_caching:
            reason = "prefix caching is off"
        elif not runner.specs:
            reason = "the model has no attention layers"
        store = None
        if reason is None:
            assert config.ssd_cache_dir is not None
            fp = kv_fingerprint(loaded.model, loaded.config, runner.specs, config.block_size)
            block_bytes = bytes_per_block(runner.kv_specs, config.block_size)
            store = SsdStore(
                config.ssd_cache_dir,
                fp,
                block_bytes,
                int(config.ssd_cache_max_gb * GIB),
                max(config.ssd_write_queue_mb * 1024 * 1024 // max(block_bytes, 1), 1),
                on_read=on_read,
            )
            log.info(
                "SSD cache tier: %d blocks on disk for this model (fingerprint %s)",
                len(store.keys),
                fp[:12],
            )
        elif config.ssd_cache_dir is not None:
            log.warning("SSD cache tier off: %s", reason)
        tiers = cls(bm, runner, store)
        tiers.ssd_disabled_reason = reason
        return tiers

    # -- promotion ---------------------------------------------------------
    def prefetch(self, seq: Sequence) -> None:
        """Start reading the on-disk blocks of a new sequence's prompt."""
        if self.store is None:
            return
        ids = seq.keys(0, len(seq.prompt_ids))  # image positions as their content keys
        bs = self.bm.block_size
        want: list[tuple[int, tuple[int, ...]]] = []
        waits: set[int] = set()
        for i, key in enumerate(self.bm.prompt_keys(ids, seq.table.root)):
            bid = self.bm.hash_to_block.get(key)
            if bid is not None:
                self.bm.touch(bid)  # so installing the rest does not evict it
                continue
            if key in self._pending:
                waits.add(key)
                continue
            self.ssd_lookups += 1
            if not self.store.contains(key):
                break
            self.ssd_hits += 1
            want.append((key, tuple(ids[i * bs : (i + 1) * bs])))
        if want:
            self._pending.update(k for k, _ in want)
            waits.update(k for k, _ in want)
            self.store.request(want)
        if waits:
            self._waiting[seq] = waits

    def is_promoting(self, seq: Sequence) -> bool:
        return seq in self._waiting

    def forget(self, seq: Sequence) -> None:
        self._waiting.pop(seq, None)

    def poll(self) -> None:
        """Hand finished spills to the writer and install finished reads (engine thread)."""
        if self.store is None:
            return
        self._hand_over_spills()
        done = self.store.completed()
        if not done:
            return
        room = self.bm.num_free
        keys: list[int] = []
        payloads: list[bytes] = []
        for r in done:
            if r.payload is None or len(keys) >= room:
                continue
            bid = self.bm.install(r.key, r.token_ids)
            if bid is not None:
                keys.append(bid)
                payloads.append(r.payload)
        if keys:
            # Copy out what the installs evicted before their blocks are overwritten.
            self.spill_evicted()
            self.runner.write_blocks(keys, self._decode(payloads))
            mx.async_eval(self.runner.arrays_to_eval([]))
            self.promoted += len(keys)
        finished = {r.key for r in done}
        self._pending -= finished
        for seq in list(self._waiting):
            rest = self._waiting[seq] - finished
            if rest:
                self._waiting[seq] = rest
            else:
                del self._waiting[seq]

    def _decode(self, payloads: list[bytes]) -> list[mx.array]:
        """Block payloads -> one [heads, n * block_size, width] array per pool part."""
        bs = self.bm.block_size
        per_block: list[list[np.ndarray]] = []
        for data in payloads:
            arrays, off = [], 0
            for h, w, raw, _ in self.parts:
                n = h * bs * w
                arrays.append(np.frombuffer(data, raw, n, off).reshape(h, bs, w))
                off += n * raw.itemsize
            per_block.append(arrays)
        out = []
        for j, (_, _, _, dtype) in enumerate(self.parts):
            joined = np.concatenate([b[j] for b in per_block], axis=1)
            a = mx.array(joined)
            out.append(a if a.dtype == dtype else a.view(dtype))
        return out

    # -- spilling ----------------------------------------------------------
    def spill_evicted(self) -> None:
        """Copy out cached blocks the allocator just took, before anything overwrites them."""
        evicted = self.bm.take_evicted()
        if self.store is None or not evicted:
            return
        evicted = [e for e in evicted if not self.store.known(e[1])]
        if evicted:
            self._copy_out(evicted)

    def _copy_out(self, blocks: list[tuple[int, int, tuple[int, ...]]]) -> None:
        parts = [raw_view(a) for a in self.runner.read_blocks([b[0] for b in blocks])]
        # Launched now, ahead of the scatters that will overwrite these blocks, so those
        # still update the pools in place.
        mx.async_eval(parts)
        self._spilling.append((blocks, parts))

    def _hand_over_spills(self, block: bool = False) -> None:
        assert self.store is not None
        bs = self.bm.block_size
        for blocks, parts in self._spilling:
            arrays = [np.array(p) for p in parts]
            for i, (_, key, tokens) in enumerate(blocks):
                views = [a[:, i * bs : (i + 1) * bs] for a in arrays]
                self.store.put(key, tokens, views, block=block)
        self._spilling = []

    def flush(self) -> None:
        """Write every cached block not yet on disk (at shutdown), and wait for the writer."""
        if self.store is None:
            return
        blocks = [
            (bid, key, self.bm.blocks[bid].token_ids)
            for key, bid in self.bm.hash_to_block.items()
            if not self.store.known(key)
        ]
        for i in range(0, len(blocks), 256):
            self._copy_out(blocks[i : i + 256])
            self._hand_over_spills(block=True)
        self._hand_over_spills(block=True)
        self.store.drain()

    def close(self, flush: bool = True) -> None:
        if self.store is None:
            return
        try:
            if flush:
                self.flush()
        finally:
            self.store.close()

    # -- control -----------------------------------------------------------
    def clear(self, tier: str | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        if tier in (None, "memory"):
            out["memory"] = self.bm.clear_cache()
        if tier in (None, "ssd") and self.store is not None:
            self._spilling = []
            self.bm.take_evicted()
            out["ssd"] = self.store.clear()
        return out

    def pools_reset(self) -> None:
        """The KV pools were made anew (after a failed step): forget every cached block
        and drop the copies out not yet handed to the writer, which read the old pools."""
        self._spilling = []
        self.bm.take_evicted()
        self.bm.clear_cache()

    def stats(self) -> dict[str, Any]:
        bm = self.bm
        per_block = bytes_per_block(self.runner.kv_specs, bm.block_size)
        mem: dict[str, Any] = {
            "blocks": bm.num_cached,
            "bytes": bm.num_cached * per_block,
            "capacity_blocks": bm.num_usable,
            "capacity_bytes": bm.num_usable * per_block,
            "block_size": bm.block_size,
            "lookups": bm.query_blocks,
            "hits": bm.hit_blocks,
            "hit_rate": bm.hit_blocks / bm.query_blocks if bm.query_blocks else 0.0,
            "kv_bits": self.runner.kv_bits,
            "kv_group_size": self.runner.kv_group_size if self.runner.kv_bits else None,
        }
        out: dict[str, Any] = {"memory": mem}
        if self.store is None:
            out["ssd"] = {"enabled": False, "reason": self.ssd_disabled_reason}
        else:
            ssd = {"enabled": True, **self.store.stats()}
            ssd.update(
                lookups=self.ssd_lookups,
                hits=self.ssd_hits,
                hit_rate=self.ssd_hits / self.ssd_lookups if self.ssd_lookups else 0.0,
                promoted=self.promoted,
                promoting=len(self._pending),
            )
            out["ssd"] = ssd
        return out
