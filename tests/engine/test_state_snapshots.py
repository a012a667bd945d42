"""Recurrent-state snapshots: hybrid models resume cached prefixes from the state kept at
block boundaries (`pippin.engine.state_snapshots`), alone and in the engine."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from support.engine_runs import (
    GEN,
    agrees,
    engine_config,
    loaded_model,
    mlx_lm_reference,
    random_prompts,
    run_to_end,
)

from pippin.engine.block_manager import BlockManager, BlockTable
from pippin.engine.core import EngineCore
from pippin.engine.state_snapshots import (
    STATE_ONLY_INTERVAL_TOKENS,
    StateSnapshots,
    own_copy,
    snapshot_interval,
    state_bytes,
)
from pippin.engine.types import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


def _state(value: float, size: int = 8) -> list:
    return [None, [mx.full((1, size), value)], None]


def _registered(bm: BlockManager, tokens: list[int]) -> BlockTable:
    table = BlockTable()
    cached, hashes = bm.match_prefix(tokens)
    bm.allocate(table, len(tokens), cached, hashes)
    bm.register_full_blocks(table, lambda s, e: tokens[s:e], len(tokens))
    return table


# -- alone ----------------------------------------------------------------------------
def test_chunks_end_at_the_prompt_s_last_block_and_every_interval() -> None:
    snaps = StateSnapshots(BlockManager(64, BS), 1 << 20, interval_blocks=2)
    # 23 tokens: the last block a match can reach ends at 20; interval points at 8, 16.
    assert snaps.clip(0, 100, 23) == 8
    assert snaps.clip(8, 100, 23) == 8
    assert snaps.clip(16, 100, 23) == 4
    assert snaps.clip(20, 100, 23) == 100  # past the last point: no cut
    assert snaps.clip(0, 5, 23) == 5  # the budget ends it first
    assert [e for e in range(1, 24) if snaps.is_point(e, 23)] == [8, 16, 20]
    # 24 tokens: the last token is always computed, so 20 is still the last point.
    assert snaps.clip(16, 100, 24) == 4
    only_ends = StateSnapshots(BlockManager(64, BS), 1 << 20, interval_blocks=0)
    assert only_ends.clip(0, 100, 23) == 20
    assert [e for e in range(1, 24) if only_ends.is_point(e, 23)] == [20]


def test_deepest_snapshot_wins_and_resumes_only_the_blocks_up_to_it() -> None:
    bm = BlockManager(64, BS)
    snaps = StateSnapshots(bm, 1 << 20, interval_blocks=0)
    table = _registered(bm, list(range(3, 23)))  # 5 full blocks
    snaps.put(table.hashes[1], _state(1.0))
    snaps.put(table.hashes[3], _state(3.0))
    cached, hashes = bm.match_prefix(list(range(3, 30)))
    assert len(cached) == 5
    got_ids, got_hashes, state = snaps.deepest(cached, hashes)
    assert got_ids == cached[:4] and got_hashes == hashes[:4]
    assert state is not None and state[1][0][0, 0].item() == 3.0 and state[0] is None
    assert snaps.hits == 1
    assert snaps.deepest(cached[:1], hashes[:1]) == ([], [], None)


def test_snapshots_stay_within_their_bytes_least_recently_used_first() -> None:
    bm = BlockManager(64, BS)
    one = state_bytes(_state(0.0))
    snaps = StateSnapshots(bm, 2 * one, interval_blocks=0)
    table = _registered(bm, list(range(3, 23)))
    k = table.hashes
    snaps.put(k[0], _state(0.0))
    snaps.put(k[1], _state(1.0))
    snaps.deepest(bm.match_prefix(list(range(3, 8)))[0], [k[0]])  # k0 used: k1 is older
    snaps.put(k[2], _state(2.0))
    assert snaps.contains(k[0]) and snaps.contains(k[2]) and not snaps.contains(k[1])
    assert snaps.bytes == 2 * one and snaps.evictions == 1
    snaps.put(k[3], [None, [mx.zeros((1, 1000))], None])  # larger than the whole budget
    assert not snaps.contains(k[3]) and len(snaps) == 2


def test_a_snapshot_goes_with_the_block_it_is_keyed_by() -> None:
    bm = BlockManager(6, BS)  # 5 usable blocks
    snaps = StateSnapshots(bm, 1 << 20, interval_blocks=0)
    tokens = list(range(3, 15))  # 3 blocks
    table = _registered(bm, tokens)
    snaps.put(table.hashes[2], _state(2.0))
    bm.free_table(table)
    # Another sequence needs every block: the cached ones are taken, the snapshot goes.
    other = _registered(bm, list(range(100, 120)))
    assert len(snaps) == 0 and snaps.evictions == 1
    bm.free_table(other)
    table = _registered(bm, tokens[:8])
    snaps.put(table.hashes[1], _state(1.0))
    bm.clear_cache()
    assert len(snaps) == 0


def test_own_copy_does_not_keep_the_batch_s_buffer() -> None:
    gc.collect()
    base = mx.get_active_memory()
    batch = mx.ones((64, 256, 256))
    mx.eval(batch)
    row = [None, [batch[3:4]]]
    kept = own_copy(row)
    mx.eval(kept[1])
    del batch, row
    gc.collect()
    assert mx.get_active_memory() - base <= 2 * 256 * 256 * 4


# -- in the engine --------------------------------------------------------------------
@pytest.fixture(scope="module")
def hybrid(tiny_models):
    return loaded_model(tiny_models("qwen3_next"))


def _prompts(loaded, n: int, seed: int) -> list[list[int]]:
    return random_prompts(loaded.model.args.vocab_size, n, seed=seed)


def test_an_agent_s_next_turn_resumes_from_the_answer_s_snapshot(hybrid) -> None:
    a, b, c = _prompts(hybrid, 3, seed=11)
    prompt = a + b + a  # long enough for several blocks
    ref = mlx_lm_reference(hybrid.model, prompt, GEN)
    core = EngineCore(hybrid, engine_config(block_size=BS))
    core.add_request("t1", prompt, GREEDY)
    first = run_to_end(core)["t1"]
    assert agrees(first["ids"][0], *ref) and first["cached"] == 0

    # The same prompt again: everything up to its last full block is resumed.
    core.add_request("again", prompt, GREEDY)
    again = run_to_end(core)["again"]
    assert again["cached"] == (len(prompt) - 1) // BS * BS
    assert agrees(again["ids"][0], *ref)

    # The next turn: prompt + answer + a new message. Its cached part reaches into the
    # answer, from the snapshot taken when the generation ended.
    turn2 = prompt + first["ids"][0] + c
    ref2 = mlx_lm_reference(hybrid.model, turn2, GEN)
    core.add_request("t2", turn2, GREEDY)
    second = run_to_end(core)["t2"]
    assert second["cached"] == (len(prompt) + GEN - 1) // BS * BS
    assert agrees(second["ids"][0], *ref2)
    stats = core.stats()
    assert stats["snapshot_hits"] == 2 and stats["snapshot_count"] >= 2
    assert stats["blocks_free"] == stats["blocks_total"]


def test_prompts_sharing_a_long_prefix_resume_from_an_interval_snapshot(hybrid) -> None:
    shared = sum(_prompts(hybrid, 4, seed=12), [])[:60]
    x, y = _prompts(hybrid, 2, seed=13)
    core = EngineCore(
        hybrid, engine_config(block_size=BS, snapshot_interval_blocks=4)
    )  # a point every 16 tokens
    core.add_request("x", shared + x, GREEDY)
    run_to_end(core)
    ref = mlx_lm_reference(hybrid.model, shared + y, GEN)
    core.add_request("y", shared + y, GREEDY)
    got = run_to_end(core)["y"]
    assert got["cached"] == 48  # the last interval point inside the shared 60 tokens
    assert agrees(got["ids"][0], *ref)


def test_snapshots_off_without_prefix_caching_and_apart_by_cache_salt(hybrid) -> None:
    prompt = _prompts(hybrid, 1, seed=14)[0] * 2
    core = EngineCore(hybrid, engine_config(block_size=BS, enable_prefix_caching=False))
    assert core.snapshots is None
    core.add_request("a", prompt, GREEDY)
    core.add_request("b", prompt, GREEDY)
    res = run_to_end(core)
    assert res["a"]["cached"] == res["b"]["cached"] == 0
    assert "snapshot_hits" not in core.stats()

    core = EngineCore(hybrid, engine_config(block_size=BS))
    core.add_request("a", prompt, SamplingParams(max_tokens=4, cache_salt="alice"))
    run_to_end(core)
    core.add_request("b", prompt, SamplingParams(max_tokens=4, cache_salt="bob"))
    core.add_request("c", prompt, SamplingParams(max_tokens=4, cache_salt="alice"))
    res = run_to_end(core)
    assert res["b"]["cached"] == 0 and res["c"]["cached"] > 0


def test_preempted_sequences_resume_from_their_own_snapshots(hybrid) -> None:
    prompts = _prompts(hybrid, 6, seed=15)
    refs = [mlx_lm_reference(hybrid.model, p, 40) for p in prompts]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    core = EngineCore(hybrid, engine_config(block_size=BS, num_blocks=60))
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    res = run_to_end(core)
    stats = core.stats()
    assert stats["preemptions"] > 0 and stats["snapshot_hits"] > 0
    for i, ref in enumerate(refs):
        assert agrees(res[f"r{i}"]["ids"][0], *ref), i


def test_the_interval_weighs_a_snapshot_against_the_kv_it_covers() -> None:
    # Qwen3-Next-80B: 73.7 MiB of state, 24 KiB of KV a token -> 6,288 tokens apart.
    assert snapshot_interval(int(73.6875 * 2**20), 24 * 1024, 16) == 393
    assert snapshot_interval(1000, 0, 16) == STATE_ONLY_INTERVAL_TOKENS // 16
    assert snapshot_interval(10, 10**6, 16) == 1
