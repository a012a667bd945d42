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

Models with recurrent layers resume a prefix only from a state snapshot taken at its
end (`state_snapshots`), so snapshots move between the tiers too (`ssd_snapshots`):
one leaving memory (for room, or with its block) is written unless already on disk, and
at shutdown every one in memory is. A request's prefetch picks the deepest prompt block
whose blocks up to it are each in memory or on disk and whose snapshot is in memory or
on disk, reads what is only on disk (blocks and snapshot, kept apart), and holds the
request until both are installed. The blocks of a model without attention layers (Mamba)
hold no KV: they are installed from their tokens alone, and only snapshots are written.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from pippin.engine.block_manager import BlockManager
from pippin.engine.kv_fingerprint import from_raw, kv_fingerprint, raw_dtype, raw_view
from pippin.engine.ssd_snapshots import SsdSnapshots, state_layout
from pippin.engine.ssd_store import SsdStore
from pippin.engine.state_snapshots import StateSnapshots
from pippin.runner.model_runner import ModelRunner
from pippin.runner.paged_cache import bytes_per_block

if TYPE_CHECKING:
    from pippin.engine.config import EngineConfig
    from pippin.engine.sequence import Sequence
    from pippin.store.loaded import LoadedModel

log = logging.getLogger(__name__)

GIB = 1024**3
MIB = 1024**2
TIERS = ("memory", "ssd")
# What a sequence waits for: a block or a snapshot (their keys are the same ints).
BLOCK, SNAPSHOT = 0, 1


class CacheTiers:
    def __init__(
        self,
        bm: BlockManager,
        runner: ModelRunner,
        store: SsdStore | None,
        snapshots: StateSnapshots | None = None,
        ssd_snapshots: SsdSnapshots | None = None,
    ) -> None:
        self.bm = bm
        self.runner = runner
        self.store = store  # KV blocks (None: no SSD tier, or no attention layers)
        self.snapshots = snapshots  # in memory (models with recurrent layers)
        self.ssd_snapshots = ssd_snapshots  # on disk
        self.enabled = store is not None or ssd_snapshots is not None
        self.ssd_disabled_reason: str | None = None
        bs = bm.block_size
        # (heads, width, numpy dtype of the raw bytes, real dtype) of each pool part, in
        # the order ModelRunner.read_blocks returns them; a block's payload is these
        # parts, [heads, block_size, width] each, back to back.
        self.parts: list[tuple[int, int, np.dtype, mx.Dtype]] = []
        for i in sorted(runner.specs):
            spec = runner.specs[i]
            for width, dtype in spec.part_shapes():
                self.parts.append((spec.n_kv_heads, width, raw_dtype(dtype), dtype))
        self.block_bytes = sum(h * bs * w * raw.itemsize for h, w, raw, _ in self.parts)
        self._spilling: list[tuple[list[tuple[int, int, tuple[int, ...]]], list[mx.array]]] = []
        self._pending: set[int] = set()  # block keys being read
        self._snap_pending: set[int] = set()  # snapshot keys being read
        # Sequences held for pending reads: (BLOCK or SNAPSHOT, key).
        self._waiting: dict[Sequence, set[tuple[int, int]]] = {}
        self.ssd_lookups = 0
        self.ssd_hits = 0
        self.promoted = 0
        self.snapshot_hits = 0
        self.snapshots_promoted = 0
        bm.track_evictions = store is not None
        if snapshots is not None and ssd_snapshots is not None:
            snapshots.on_drop = ssd_snapshots.spill

    @classmethod
    def create(
        cls,
        config: EngineConfig,
        runner: ModelRunner,
        bm: BlockManager,
        loaded: LoadedModel,
        on_read: Callable[[], None] | None = None,
        snapshots: StateSnapshots | None = None,
    ) -> CacheTiers:
        reason = None
        slots = None
        if config.ssd_cache_dir is None:
            reason = "no --ssd-cache-dir"
        elif not bm.enable_prefix_caching:
            reason = "prefix caching is off"
        elif runner.has_state_layers:
            if snapshots is None:
                reason = "the model's recurrent state is not snapshotted"
            elif (slots := state_layout(runner)) is None:
                reason = "the model's recurrent state has no fixed layout"
        store = ssd_snapshots = None
        if reason is None:
            assert config.ssd_cache_dir is not None
            fp = kv_fingerprint(loaded.model, loaded.config, runner.specs, config.block_size)
            max_bytes = int(config.ssd_cache_max_gb * GIB)
            queue_bytes = config.ssd_write_queue_mb * MIB
            if runner.specs:  # else blocks hold no KV: only their snapshots go to disk
                block_bytes = bytes_per_block(runner.kv_specs, config.block_size)
                store = SsdStore(
                    config.ssd_cache_dir,
                    fp,
                    block_bytes,
                    max_bytes,
                    max(queue_bytes // max(block_bytes, 1), 1),
                    on_read=on_read,
                )
            if slots is not None:
                ssd_snapshots = SsdSnapshots.open(
                    config.ssd_cache_dir,
                    fp,
                    slots,
                    len(runner.slots),
                    max_bytes,
                    queue_bytes,
                    on_read=on_read,
                )
            log.info(
                "SSD cache tier: %d blocks and %d state snapshots on disk for this model "
                "(fingerprint %s)",
                len(store.keys) if store is not None else 0,
                len(ssd_snapshots.store.keys) if ssd_snapshots is not None else 0,
                fp[:12],
            )
        elif config.ssd_cache_dir is not None:
            log.warning("SSD cache tier off: %s", reason)
        tiers = cls(bm, runner, store, snapshots, ssd_snapshots)
        tiers.ssd_disabled_reason = reason
        return tiers

    # -- promotion ---------------------------------------------------------
    def prefetch(self, seq: Sequence) -> None:
        """Start reading the on-disk blocks (and snapshot) of a new sequence's prompt."""
        if not self.enabled:
            return
        ids = seq.keys(0, len(seq.prompt_ids))  # image positions as their content keys
        bs = self.bm.block_size
        keys = self.bm.prompt_keys(ids, seq.table.root)
        if self.snapshots is not None:
            keys = keys[: self._resumable(keys)]
        want: list[tuple[int, tuple[int, ...]]] = []
        waits: set[tuple[int, int]] = set()
        for i, key in enumerate(keys):
            bid = self.bm.hash_to_block.get(key)
            if bid is not None:
                self.bm.touch(bid)  # so installing the rest does not evict it
                continue
            if key in self._pending:
                waits.add((BLOCK, key))
                continue
            tokens = tuple(ids[i * bs : (i + 1) * bs])
            if self.store is None:  # no KV in blocks: its tokens are all there is
                self.bm.install(key, tokens)
                continue
            self.ssd_lookups += 1
            if not self.store.contains(key):
                break
            self.ssd_hits += 1
            want.append((key, tokens))
        if want:
            assert self.store is not None
            self._pending.update(k for k, _ in want)
            waits.update((BLOCK, k) for k, _ in want)
            self.store.request(want)
        if self.snapshots is not None and keys:
            waits |= self._prefetch_snapshot(keys[-1])
        if waits:
            self._waiting[seq] = waits

    def _resumable(self, keys: list[int]) -> int:
        """How many of a prompt's blocks a model with recurrent layers can resume: the
        most whose blocks are each in memory, on their way or on disk, and whose last
        has a snapshot in memory, on its way or on disk."""
        assert self.snapshots is not None and self.ssd_snapshots is not None
        on_disk = self.ssd_snapshots.store.contains
        best = 0
        for i, key in enumerate(keys):
            if not (
                key in self.bm.hash_to_block
                or key in self._pending
                or self.store is None
                or self.store.contains(key)
            ):
                break
            if self.snapshots.contains(key) or key in self._snap_pending or on_disk(key):
                best = i + 1
        return best

    def _prefetch_snapshot(self, key: int) -> set[tuple[int, int]]:
        """Start reading the snapshot keyed by `key` unless it is in memory; what to wait for."""
        assert self.snapshots is not None and self.ssd_snapshots is not None
        if self.snapshots.contains(key):
            self.snapshots.touch(key)
            return set()
        if key not in self._snap_pending:
            self.snapshot_hits += 1
            self._snap_pending.add(key)
            self.ssd_snapshots.request(key)
        return {(SNAPSHOT, key)}

    def is_promoting(self, seq: Sequence) -> bool:
        return seq in self._waiting

    def forget(self, seq: Sequence) -> None:
        self._waiting.pop(seq, None)

    def poll(self) -> None:
        """Hand finished spills to the writer and install finished reads (engine thread)."""
        if not self.enabled:
            return
        finished: set[tuple[int, int]] = set()
        if self.store is not None:
            self._hand_over_spills()
            finished |= self._install_blocks()
        if self.ssd_snapshots is not None:
            self.ssd_snapshots.hand_over()
            finished |= self._install_snapshots()
        if not finished:
            return
        for seq in list(self._waiting):
            rest = self._waiting[seq] - finished
            if rest:
                self._waiting[seq] = rest
            else:
                del self._waiting[seq]

    def _install_blocks(self) -> set[tuple[int, int]]:
        assert self.store is not None
        done = self.store.completed()
        if not done:
            return set()
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
        self._pending -= {r.key for r in done}
        return {(BLOCK, r.key) for r in done}

    def _install_snapshots(self) -> set[tuple[int, int]]:
        """Install finished snapshot reads whose block is cached or still on its way
        (after the blocks of this poll: a snapshot without its block resumes nothing)."""
        assert self.snapshots is not None and self.ssd_snapshots is not None
        finished = set()
        for key, state in self.ssd_snapshots.completed():
            self._snap_pending.discard(key)
            finished.add((SNAPSHOT, key))
            if state is not None and (key in self.bm.hash_to_block or key in self._pending):
                self.snapshots.install(key, state)
                self.snapshots_promoted += 1
        return finished

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
        return [
            from_raw(np.concatenate([b[j] for b in per_block], axis=1), dtype)
            for j, (_, _, _, dtype) in enumerate(self.parts)
        ]

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
        """Write every cached block and snapshot not yet on disk (at shutdown), and wait
        for the writers."""
        if self.ssd_snapshots is not None:
            assert self.snapshots is not None
            self.ssd_snapshots.flush(self.snapshots.items())
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
        if not self.enabled:
            return
        try:
            if flush:
                self.flush()
        finally:
            for store in self.stores():
                store.close()

    def stores(self) -> list[SsdStore]:
        """The SSD tier's stores: KV blocks, state snapshots (either may be absent)."""
        out = [self.store] if self.store is not None else []
        return out + ([self.ssd_snapshots.store] if self.ssd_snapshots is not None else [])

    # -- control -----------------------------------------------------------
    def clear(self, tier: str | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        if tier in (None, "memory"):
            out["memory"] = self._clear_memory()
        if tier in (None, "ssd") and self.enabled:
            self._drop_spills()
            # One clear empties the directory: the other store's files go with it.
            out["ssd"] = self.stores()[0].clear()
        return out

    def pools_reset(self) -> None:
        """The KV pools were made anew (after a failed step): forget every cached block
        (and snapshot) and drop the copies out not yet handed to the writer, which read
        the old pools (or state of the failed step)."""
        self._drop_spills()
        self._clear_memory()

    def _drop_spills(self) -> None:
        self._spilling = []
        self.bm.take_evicted()
        if self.ssd_snapshots is not None:
            self.ssd_snapshots.discard()

    def _clear_memory(self) -> int:
        """Forget every cached block and the snapshots keyed by them, writing none (as
        a cleared block is not written)."""
        snaps = self.snapshots
        if snaps is None:
            return self.bm.clear_cache()
        on_drop, snaps.on_drop = snaps.on_drop, None
        try:
            return self.bm.clear_cache()
        finally:
            snaps.on_drop = on_drop

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
        if not self.enabled:
            out["ssd"] = {"enabled": False, "reason": self.ssd_disabled_reason}
            return out
        ssd: dict[str, Any] = {"enabled": True}
        if self.store is not None:
            ssd.update(self.store.stats())
            ssd.update(
                lookups=self.ssd_lookups,
                hits=self.ssd_hits,
                hit_rate=self.ssd_hits / self.ssd_lookups if self.ssd_lookups else 0.0,
                promoted=self.promoted,
                promoting=len(self._pending),
            )
        else:  # blocks hold no KV; the directory's figures from the snapshots' store
            whole = self.stores()[0].stats()
            ssd.update(blocks=0, bytes=0, disk_bytes=whole["disk_bytes"])
            ssd["max_bytes"] = whole["max_bytes"]
        if self.ssd_snapshots is not None:
            ssd["snapshots"] = {
                **self.ssd_snapshots.stats(),
                "hits": self.snapshot_hits,
                "promoted": self.snapshots_promoted,
                "promoting": len(self._snap_pending),
            }
        out["ssd"] = ssd
        return out
