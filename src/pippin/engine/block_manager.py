"""Paged KV blocks: allocation, refcounts and the chained-hash prefix cache.

Block 0 is reserved as the null block: padding positions write into it and
gathers of unused table entries read from it, so it is never handed out.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field


def chain_hash(parent: int | None, token_ids: Seq[int], extra: object = None) -> int:
    """Key of a full block: equal keys mean equal KV (same prefix, same tokens)."""
    return hash((parent, tuple(token_ids), extra))


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

    # -- accounting -------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- prefix cache -----------------------------------------------------
    def match_prefix(
        self, token_ids: Seq[int], extra: object = None
    ) -> tuple[list[int], list[int]]:
        """Cached full blocks at the start of `token_ids`, leaving at least one
        token to compute (its logits are needed to sample)."""
        if not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        max_blocks = (len(token_ids) - 1) // bs
        ids: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        for i in range(max_blocks):
            chunk = token_ids[i * bs : (i + 1) * bs]
            h = chain_hash(parent, chunk, extra)
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
        extra: object = None,
    ) -> None:
        """Enter blocks that became full and computed into the prefix cache.

        `token_ids(start, end)` gives the sequence's tokens in [start, end): only the
        new blocks' tokens are read, not the whole sequence, on every step."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(num_computed // bs, len(table.block_ids))
        for i in range(len(table.hashes), full):
            parent = table.hashes[i - 1] if i else None
            chunk = tuple(token_ids(i * bs, (i + 1) * bs))
            h = chain_hash(parent, chunk, extra)
            table.hashes.append(h)
            bid = table.block_ids[i]
            if h not in self.hash_to_block:
                block = self.blocks[bid]
                block.hash = h
                block.token_ids = chunk
                self.hash_to_block[h] = bid
