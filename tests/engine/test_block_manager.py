"""`BlockManager` alone: refcounts, the chained-hash prefix cache, LRU eviction, salts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pippin.engine.block_manager import BlockManager, BlockTable, chain_hash, salt_root

BS = 4


def _bm(num_blocks: int = 9, caching: bool = True) -> BlockManager:
    return BlockManager(num_blocks, BS, caching)


def _admit(bm: BlockManager, tokens: list[int], root: int | None = None) -> BlockTable:
    """What the scheduler does at admission: take the cached prefix, allocate the rest."""
    table = BlockTable(root=root)
    cached, hashes = bm.match_prefix(tokens, root)
    bm.allocate(table, len(tokens), cached, hashes)
    return table


def _compute(bm: BlockManager, table: BlockTable, tokens: list[int]) -> None:
    """What a finished step does: register the full blocks of the computed tokens."""
    bm.register_full_blocks(table, lambda s, e: tokens[s:e], len(tokens))


# -- the chained hash -----------------------------------------------------------------
def test_chain_hash_keys_a_block_by_its_tokens_and_its_whole_prefix() -> None:
    a = chain_hash(None, [1, 2, 3, 4])
    assert a == chain_hash(None, [1, 2, 3, 4])
    assert a != chain_hash(None, [1, 2, 3, 5])
    # The same tokens after another parent are another block.
    p, q = chain_hash(None, [9, 9, 9, 9]), chain_hash(None, [8, 8, 8, 8])
    assert chain_hash(p, [1, 2, 3, 4]) != chain_hash(q, [1, 2, 3, 4])
    assert chain_hash(p, [1, 2, 3, 4]) != a
    # A 128-bit key: the SSD tier stores it in 16 bytes.
    assert 0 <= a < 1 << 128


def test_chain_hash_is_stable_across_processes() -> None:
    """The SSD tier finds blocks again after a restart, so keys must not depend on
    Python's per-process hash seed."""
    code = (
        "from pippin.engine.block_manager import chain_hash, salt_root;"
        "print(chain_hash(chain_hash(salt_root('s'), [1, 2]), [3, 4]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    got = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert int(got.stdout) == chain_hash(chain_hash(salt_root("s"), [1, 2]), [3, 4])


def test_prompt_keys_chain_and_leave_the_last_token_to_compute() -> None:
    bm = _bm()
    keys = bm.prompt_keys(list(range(12)))  # 3 full blocks; the last token is computed
    assert keys == [
        chain_hash(None, [0, 1, 2, 3]),
        chain_hash(keys[0], [4, 5, 6, 7]),
    ]
    assert len(bm.prompt_keys(list(range(13)))) == 3
    # Equal prefixes give equal keys, whatever follows.
    assert bm.prompt_keys([1] * 8 + [2] * 5)[:2] == bm.prompt_keys([1] * 8 + [3] * 5)[:2]
    assert bm.prompt_keys([5] + [1] * 12)[1] != bm.prompt_keys([6] + [1] * 12)[1]


# -- allocation and refcounts ---------------------------------------------------------
def test_needs_two_blocks_and_never_hands_out_the_null_block() -> None:
    with pytest.raises(ValueError):
        BlockManager(1, BS)
    bm = _bm(5)
    assert bm.num_usable == bm.num_free == 4
    table = BlockTable()
    assert bm.ensure_capacity(table, 4 * BS)
    assert sorted(table.block_ids) == [1, 2, 3, 4]
    assert bm.num_free == 0


def test_allocate_gives_fresh_blocks_with_one_reference() -> None:
    bm = _bm()
    table = _admit(bm, list(range(9)))  # 9 tokens: 3 blocks
    assert len(table.block_ids) == bm.blocks_for(9) == 3
    assert len(set(table.block_ids)) == 3 and 0 not in table.block_ids
    assert all(bm.blocks[b].ref_count == 1 for b in table.block_ids)
    assert bm.num_free == bm.num_usable - 3
    bm.free_table(table)
    assert table.block_ids == [] and table.hashes == []
    assert all(bm.blocks[b].ref_count == 0 for b in range(1, 9))
    assert bm.num_free == bm.num_usable


def test_ensure_capacity_grows_or_changes_nothing() -> None:
    bm = _bm(4)  # 3 usable
    table = BlockTable()
    assert bm.ensure_capacity(table, 1)
    assert bm.ensure_capacity(table, BS)  # still one block
    assert len(table.block_ids) == 1
    assert not bm.ensure_capacity(table, 4 * BS)  # needs 3 more, 2 free
    assert len(table.block_ids) == 1 and bm.num_free == 2
    assert bm.ensure_capacity(table, 3 * BS)
    assert bm.num_free == 0


def test_shared_prefix_is_referenced_once_per_holder() -> None:
    bm = _bm()
    prompt = list(range(10))  # 2 full blocks and 2 tokens
    first = _admit(bm, prompt)
    _compute(bm, first, prompt)
    assert bm.num_cached == 2

    second = _admit(bm, prompt)
    shared = first.block_ids[:2]
    assert second.block_ids[:2] == shared
    assert second.hashes == first.hashes
    assert second.block_ids[2] != first.block_ids[2]  # the partial block is its own
    assert [bm.blocks[b].ref_count for b in shared] == [2, 2]
    assert (bm.queries, bm.hits, bm.query_blocks, bm.hit_blocks) == (2, 1, 4, 2)

    bm.free_table(first)
    assert [bm.blocks[b].ref_count for b in shared] == [1, 1]
    assert all(b not in bm.free for b in shared)  # still held by `second`
    bm.free_table(second)
    assert all(bm.blocks[b].ref_count == 0 and b in bm.free for b in shared)
    # Freed, they stay cached: a third request finds them.
    third = _admit(bm, prompt)
    assert third.block_ids[:2] == shared


def test_match_prefix_stops_at_the_first_miss_and_keeps_a_token_to_compute() -> None:
    bm = _bm()
    prompt = list(range(12))  # exactly 3 full blocks
    table = _admit(bm, prompt)
    _compute(bm, table, prompt)
    # The whole prompt is cached, but its last token must be computed for its logits.
    ids, hashes = bm.match_prefix(prompt)
    assert ids == table.block_ids[:2] and hashes == table.hashes[:2]
    assert bm.match_prefix(prompt + [99])[0] == table.block_ids
    # A different first block: nothing after it matches, though later tokens agree.
    assert bm.match_prefix([7] + prompt[1:] + [99]) == ([], [])
    # A different second block: only the first matches.
    changed = prompt[:4] + [7] + prompt[5:] + [99]
    assert bm.match_prefix(changed)[0] == table.block_ids[:1]


def test_can_allocate_counts_cached_blocks_taken_back_from_the_free_list() -> None:
    bm = _bm(5)  # 4 usable
    prompt = list(range(9))
    table = _admit(bm, prompt)  # 3 blocks
    _compute(bm, table, prompt)  # 2 of them cached
    bm.free_table(table)
    cached, _ = bm.match_prefix(prompt)
    assert len(cached) == 2 and bm.num_free == 4
    # Two fresh blocks plus the two cached ones taken out of the free list: 4.
    assert bm.can_allocate(2, cached)
    assert not bm.can_allocate(3, cached)
    assert bm.can_allocate(4)  # without them, evicting both is fine


def test_trim_frees_the_blocks_past_the_kept_tokens_first_in_line() -> None:
    bm = _bm()
    table = BlockTable()
    bm.ensure_capacity(table, 4 * BS)
    tail = table.block_ids[2:]
    bm.trim(table, 2 * BS - 1)  # 2 blocks hold what is kept
    assert len(table.block_ids) == 2
    assert all(bm.blocks[b].ref_count == 0 for b in tail)
    # The freed slots hold nothing reusable: they are taken before anything else.
    assert set(list(bm.free)[:2]) == set(tail)


def test_register_full_blocks_only_registers_full_computed_blocks() -> None:
    bm = _bm()
    tokens = list(range(11))
    table = _admit(bm, tokens)
    bm.register_full_blocks(table, lambda s, e: tokens[s:e], 3)  # not one full block yet
    assert table.hashes == [] and bm.num_cached == 0
    bm.register_full_blocks(table, lambda s, e: tokens[s:e], 6)
    assert table.hashes == [chain_hash(None, tokens[:4])]
    assert bm.blocks[table.block_ids[0]].token_ids == tuple(tokens[:4])
    # Only the new block's tokens are read.
    reads: list[tuple[int, int]] = []

    def ids(s: int, e: int) -> list[int]:
        reads.append((s, e))
        return tokens[s:e]

    bm.register_full_blocks(table, ids, 11)
    assert reads == [(4, 8)]
    assert table.hashes[1] == chain_hash(table.hashes[0], tokens[4:8])
    assert bm.num_cached == 2


def test_equal_blocks_computed_twice_keep_the_first_in_the_cache() -> None:
    bm = _bm()
    prompt = list(range(5))
    a, b = _admit(bm, prompt), _admit(bm, prompt)  # both admitted before either computed
    _compute(bm, a, prompt)
    _compute(bm, b, prompt)
    assert a.hashes == b.hashes
    assert bm.hash_to_block[a.hashes[0]] == a.block_ids[0]
    duplicate = b.block_ids[0]
    assert bm.blocks[duplicate].hash is None  # not cached: `a`'s block is
    bm.free_table(b)
    # Holding nothing reusable, it goes before any cached block.
    assert duplicate in list(bm.free)[:2]
    assert bm.match_prefix(prompt)[0] == a.block_ids[:1]


def test_prefix_caching_off_shares_nothing() -> None:
    bm = _bm(caching=False)
    prompt = list(range(10))
    first = _admit(bm, prompt)
    _compute(bm, first, prompt)
    assert first.hashes == [] and bm.num_cached == 0
    assert bm.match_prefix(prompt) == ([], [])
    second = _admit(bm, prompt)
    assert not set(first.block_ids) & set(second.block_ids)


# -- eviction -------------------------------------------------------------------------
def test_freed_cached_blocks_are_evicted_least_recently_used_first() -> None:
    bm = _bm(7)  # 6 usable
    old, new = [1] * 5, [2] * 5
    t_old = _admit(bm, old)
    _compute(bm, t_old, old)
    t_new = _admit(bm, new)
    _compute(bm, t_new, new)
    old_key, new_key = t_old.hashes[0], t_new.hashes[0]
    bm.free_table(t_old)
    bm.free_table(t_new)
    assert bm.num_cached == 2

    # Four fresh blocks take the four uncached ones; the next takes the older cached one.
    grab = BlockTable()
    assert bm.ensure_capacity(grab, 4 * BS)
    assert bm.num_cached == 2
    assert bm.ensure_capacity(grab, 5 * BS)
    assert old_key not in bm.hash_to_block and new_key in bm.hash_to_block
    assert bm.match_prefix(old) == ([], [])
    assert len(bm.match_prefix(new)[0]) == 1


def test_a_freed_table_evicts_its_tail_before_its_prefix() -> None:
    bm = _bm()
    prompt = list(range(13))
    table = _admit(bm, prompt)
    _compute(bm, table, prompt)
    held = list(table.block_ids)
    bm.free_table(table)
    order = [b for b in bm.free if b in held]
    # The unregistered last block goes first, then the cached ones from the tail back.
    assert order[0] == held[3]
    assert order[-3:] == [held[2], held[1], held[0]]


def test_reuse_moves_a_cached_block_to_most_recently_used() -> None:
    bm = _bm(5)  # 4 usable
    a, b = [1] * 5, [2] * 5
    ta = _admit(bm, a)
    _compute(bm, ta, a)
    tb = _admit(bm, b)
    _compute(bm, tb, b)
    bm.free_table(ta)
    bm.free_table(tb)
    # `a` is used again, after `b`: now `b` is the older one.
    bm.free_table(_admit(bm, a))
    grab = BlockTable()
    assert bm.ensure_capacity(grab, 3 * BS)  # 2 uncached and one cached block
    assert bm.match_prefix(b) == ([], [])
    assert len(bm.match_prefix(a)[0]) == 1


def test_touch_marks_a_cached_block_recently_used() -> None:
    bm = _bm(4)  # 3 usable
    a, b = [1] * 5, [2] * 5
    for p in (a, b):
        t = _admit(bm, p)
        _compute(bm, t, p)
        bm.free_table(t)
    bm.touch(bm.match_prefix(a)[0][0])
    grab = BlockTable()
    assert bm.ensure_capacity(grab, 2 * BS)  # the uncached one, then the oldest cached
    assert bm.match_prefix(b) == ([], [])
    assert len(bm.match_prefix(a)[0]) == 1


def test_evictions_are_reported_for_spilling_when_tracked() -> None:
    bm = _bm(3)  # 2 usable
    prompt = [3] * 5
    t = _admit(bm, prompt)
    _compute(bm, t, prompt)
    key, bid = t.hashes[0], t.block_ids[0]
    bm.free_table(t)
    bm.track_evictions = True
    grab = BlockTable()
    bm.ensure_capacity(grab, 2 * BS)
    assert bm.take_evicted() == [(bid, key, (3, 3, 3, 3))]
    assert bm.take_evicted() == []


# -- tiers and clearing ---------------------------------------------------------------
def test_install_enters_a_promoted_block_unreferenced_and_matchable() -> None:
    bm = _bm(4)
    key = chain_hash(None, [5, 6, 7, 8])
    bid = bm.install(key, (5, 6, 7, 8))
    assert bid is not None and bm.blocks[bid].ref_count == 0 and bid in bm.free
    assert list(bm.free)[-1] == bid  # evicted last
    assert bm.install(key, (5, 6, 7, 8)) is None  # already cached
    assert bm.match_prefix([5, 6, 7, 8, 9]) == ([bid], [key])
    table = _admit(bm, [5, 6, 7, 8, 9])
    assert table.block_ids[0] == bid and bm.blocks[bid].ref_count == 1
    grab = BlockTable()
    bm.ensure_capacity(grab, bm.num_free * BS)
    assert bm.install(chain_hash(None, [1, 1, 1, 1]), (1, 1, 1, 1)) is None  # none free


def test_clear_cache_forgets_every_cached_block() -> None:
    bm = _bm()
    prompt = list(range(9))
    kept = _admit(bm, prompt)
    _compute(bm, kept, prompt)
    freed = _admit(bm, [7] * 9)
    _compute(bm, freed, [7] * 9)
    bm.free_table(freed)
    assert bm.clear_cache() == 4
    assert bm.num_cached == 0 and bm.match_prefix(prompt) == ([], [])
    assert all(bm.blocks[b].ref_count == 1 for b in kept.block_ids)  # still held
    assert bm.num_free == bm.num_usable - len(kept.block_ids)


# -- cache salt -----------------------------------------------------------------------
def test_cache_salt_isolates_prefixes() -> None:
    assert salt_root(None) is None
    assert salt_root("a") == salt_root("a") != salt_root("b")
    bm = _bm()
    prompt = list(range(9))
    salted = _admit(bm, prompt, salt_root("a"))
    _compute(bm, salted, prompt)
    assert salted.hashes[0] == chain_hash(salt_root("a"), prompt[:4])
    # Without the salt, or with another, nothing is shared; with the same, all of it.
    assert bm.match_prefix(prompt) == ([], [])
    assert bm.match_prefix(prompt, salt_root("b")) == ([], [])
    assert bm.match_prefix(prompt, salt_root("a"))[0] == salted.block_ids[:2]
    assert bm.prompt_keys(prompt, salt_root("a")) == salted.hashes
