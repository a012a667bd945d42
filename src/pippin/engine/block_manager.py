"""Paged KV blocks: allocation, refcounts and the chained-hash prefix cache.

Block 0 is reserved as the null block: padding positions write into it and
gathers of unused table entries read from it, so it is never handed out.

Block keys are 128-bit BLAKE2b digests, stable across processes, so the SSD tier
can find a block again after a restart. A request's `cache_salt` and LoRA adapter
are folded into the key of its first block (the table's `root`), so requests with
different salts or adapters never share KV.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np


def chain_hash(parent: int | None, token_ids: Seq[int]) -> int:
    """Key of a full block: equal keys mean equal KV (same prefix, same tokens). Whatever
    else changes a sequence's KV (its cache salt) is folded into its first parent, the
    table's `root`."""
    h = hashlib.blake2b(digest_size=16)
    h.update(b"-" if parent is None else parent.to_bytes(16, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def salt_root(salt: str | None, lora: str | None = None) -> int | None:
    """The parent key of a salted sequence's first block (None without a salt or a
    LoRA adapter's key). The adapter's is hashed in a domain of its own (BLAKE2b's
    `person`), so that no cache salt a client sends can stand for it."""
    root = None
    if salt is not None:
        digest = hashlib.blake2b(salt.encode(), digest_size=16).digest()
        root = int.from_bytes(digest, "little")
    if lora is None:
        return root
    h = hashlib.blake2b(digest_size=16, person=b"pippin-lora")
    h.update(b"-" if root is None else root.to_bytes(16, "little"))
    h.update(lora.encode())
    return int.from_bytes(h.digest(), "little")


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    # Set once the block is full, computed and registered in the prefix cache.
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass
class BlockTable:
    """The blocks one sequence holds, in order, and the hashes of its full ones."""

    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # one per registered full block
    root: int | None = None  # parent key of the first block: the request's cache salt


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (front is evicted first); cached ones keep their hash.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.hits = 0
        self.queries = 0
        # Full prompt blocks looked up at admission and found cached.
        self.query_blocks = 0
        self.hit_blocks = 0
        # With a tier below memory: cached blocks taken for reuse since the last
        # `take_evicted`, as (block id, key, token ids), for spilling.
        self.track_evictions = False
        self.evicted: list[tuple[int, int, tuple[int, ...]]] = []
        # Told the key of each block that leaves the prefix cache (state snapshots
        # keyed by it go with it).
        self.on_forget: Callable[[int], None] | None = None

    # -- accounting -------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    @property
    def num_cached(self) -> int:
        return len(self.hash_to_block)

    def prompt_keys(self, token_ids: Seq[int], root: int | None = None) -> list[int]:
        """Keys of the full blocks a prompt can take from a cache (its last token is
        always computed)."""
        bs = self.block_size
        keys: list[int] = []
        parent = root
        for i in range((len(token_ids) - 1) // bs):
            parent = chain_hash(parent, token_ids[i * bs : (i + 1) * bs])
            keys.append(parent)
        return keys

    # -- prefix cache -----------------------------------------------------
    def match_prefix(
        self, token_ids: Seq[int], root: int | None = None
    ) -> tuple[list[int], list[int]]:
        """Cached full blocks at the start of `token_ids`, leaving at least one
        token to compute (its logits are needed to sample)."""
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        ids: list[int] = []
        hashes: list[int] = []
        parent = root
        for i in range(max_blocks):
            chunk = token_ids[i * bs : (i + 1) * bs]
            h = chain_hash(parent, chunk)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(chunk):
                break
            ids.append(bid)
            hashes.append(h)
            parent = h
        return ids, hashes

    # -- allocation -------------------------------------------------------
    def can_allocate(self, num_new_blocks: int, cached: Seq[int] = ()) -> bool:
        # Cached hits that sit in the free list are taken out of it too.
        reclaimed = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return num_new_blocks + reclaimed <= self.num_free

    def _take_free(self) -> int:
        bid, _ = self.free.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == bid:
                del self.hash_to_block[block.hash]
                if self.track_evictions:
                    self.evicted.append((bid, block.hash, block.token_ids))
                if self.on_forget is not None:
                    self.on_forget(block.hash)
            block.hash = None
            block.token_ids = ()
        block.ref_count = 1
        return bid

    def allocate(
        self, table: BlockTable, num_tokens: int, cached: list[int], cached_hashes: list[int]
    ) -> None:
        """Give `table` the cached blocks plus fresh ones to hold `num_tokens`."""
        self.queries += 1
        if cached:
            self.hits += 1
        if self.enable_prefix_caching:
            self.query_blocks += (num_tokens - 1) // self.block_size
            self.hit_blocks += len(cached)
        for bid in cached:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
        table.block_ids = list(cached)
        table.hashes = list(cached_hashes)
        self.ensure_capacity(table, num_tokens)

    def ensure_capacity(self, table: BlockTable, num_tokens: int) -> bool:
        """Grow `table` to hold `num_tokens`; False (and no change) if blocks run out."""
        need = self.blocks_for(num_tokens) - len(table.block_ids)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            table.block_ids.append(self._take_free())
        return True

    def trim(self, table: BlockTable, num_tokens: int) -> None:
        """Free the blocks past those holding `num_tokens` (rejected speculative tokens'
        slots). They were taken by `ensure_capacity` and never registered: unshared."""
        keep = self.blocks_for(num_tokens)
        for bid in reversed(table.block_ids[keep:]):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[bid] = None
                self.free.move_to_end(bid, last=False)
        del table.block_ids[keep:]

    def free_table(self, table: BlockTable) -> None:
        # Tail blocks first, so they are evicted before the shared prefix.
        for bid in reversed(table.block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is None:
                    # Nothing to reuse: evict it before any cached block.
                    self.free[bid] = None
                    self.free.move_to_end(bid, last=False)
                else:
                    self.free[bid] = None
        table.block_ids = []
        table.hashes = []

    def register_full_blocks(
        self,
        table: BlockTable,
        token_ids: Callable[[int, int], Seq[int]],
        num_computed: int,
    ) -> None:
        """Enter blocks that became full and computed into the prefix cache.

        `token_ids(start, end)` gives the sequence's tokens in [start, end): only the
        new blocks' tokens are read, not the whole sequence, on every step."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_computed // bs, len(table.block_ids))
        for i in range(len(table.hashes), full):
            parent = table.hashes[i - 1] if i else table.root
            chunk = tuple(token_ids(i * bs, (i + 1) * bs))
            h = chain_hash(parent, chunk)
            table.hashes.append(h)
            bid = table.block_ids[i]
            if h not in self.hash_to_block:
                block = self.blocks[bid]
                block.hash = h
                block.token_ids = chunk
                self.hash_to_block[h] = bid

    # -- tiers ------------------------------------------------------------
    def take_evicted(self) -> list[tuple[int, int, tuple[int, ...]]]:
        out, self.evicted = self.evicted, []
        return out

    def touch(self, bid: int) -> None:
        """Mark a cached, unreferenced block most recently used."""
        if self.blocks[bid].ref_count == 0:
            self.free.move_to_end(bid)

    def install(self, key: int, token_ids: tuple[int, ...]) -> int | None:
        """Take a free block for KV promoted from a lower tier and enter it in the
        prefix cache, unreferenced and most recently used. None when the key is
        already cached or no block is free."""
        if key in self.hash_to_block or not self.free:
            return None
        bid = self._take_free()
        block = self.blocks[bid]
        block.ref_count = 0
        block.hash = key
        block.token_ids = token_ids
        self.hash_to_block[key] = bid
        self.free[bid] = None  # at the end: evicted last
        return bid

    def clear_cache(self) -> int:
        """Forget every cached block (blocks in use stay allocated, unshared)."""
        n = len(self.hash_to_block)
        for key, bid in self.hash_to_block.items():
            if self.on_forget is not None:
                self.on_forget(key)
            block = self.blocks[bid]
            block.hash = None
            block.token_ids = ()
            if block.ref_count == 0:
                self.free.move_to_end(bid, last=False)
        self.hash_to_block.clear()
        return n
