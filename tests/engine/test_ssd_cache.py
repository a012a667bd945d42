"""The prefix cache's tiers on tiny models: memory, SSD spill and promotion, restart
reuse, corrupt files, a failing disk, model changes, cache_salt and quantised KV; for
models with recurrent layers (Qwen3-Next, Mamba) their state snapshots too."""

from __future__ import annotations

import errno
import random
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache
from support import tiny_hybrids
from support.engine_runs import (
    OOM,
    agrees,
    core_or_skip,
    engine_config,
    faulty_forward,
    loaded_model,
    mlx_lm_reference,
    random_prompts,
    run_to_end,
)

from pippin.engine.core import EngineCore
from pippin.engine.kv_fingerprint import kv_fingerprint
from pippin.engine.ssd_store import SsdStore
from pippin.engine.types import SamplingParams
from pippin.store.loader import load_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BS = 4


def _core(loaded, ssd: Path | None, **kw) -> EngineCore:
    base = dict(num_blocks=40, block_size=BS, max_model_len=128)
    base.update(kw)
    return EngineCore(loaded, engine_config(ssd_cache_dir=str(ssd) if ssd else None, **base))


def _one(core: EngineCore, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> dict:
    core.add_request(rid, prompt, params)
    return run_to_end(core)[rid]


def _evict_all(core: EngineCore, vocab: int) -> None:
    """Run enough other prompts that nothing of earlier ones is left in memory."""
    for i, p in enumerate(random_prompts(vocab, 12, seed=99)):
        _one(core, f"filler{i}", p)
    core.scheduler.schedule()  # hands the last spills to the writer
    _drain(core)


def _drain(core: EngineCore) -> None:
    """Wait for the writers of KV blocks and of state snapshots."""
    for store in (core.tiers.store, getattr(core.tiers.ssd_snapshots, "store", None)):
        if store is not None:
            store.drain()


def _stats(core: EngineCore) -> dict:
    return core.tiers.stats()


@pytest.fixture
def llama(tiny_models):
    return loaded_model(tiny_models("llama"))


def _prompt(vocab: int, n: int = 41, seed: int = 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def test_memory_hit_miss_and_partial_hit(llama) -> None:
    vocab = llama.model.args.vocab_size
    core = _core(llama, None)
    prompt = _prompt(vocab)
    cold = _one(core, "cold", prompt)
    assert cold["cached"] == 0
    hit = _one(core, "hit", prompt)
    assert hit["cached"] == 40 and hit["ids"] == cold["ids"]
    partial = _one(core, "partial", prompt[:21] + [7] * 20)
    assert partial["cached"] == 20
    miss = _one(core, "miss", [9] + prompt[1:])
    assert miss["cached"] == 0
    mem = _stats(core)["memory"]
    assert mem["hits"] == 10 + 5 and mem["lookups"] == 4 * 10
    assert _stats(core)["ssd"] == {"enabled": False, "reason": "no --ssd-cache-dir"}


def test_ssd_spill_promote_hit_and_partial_hit(llama, tmp_path: Path) -> None:
    vocab = llama.model.args.vocab_size
    core = _core(llama, tmp_path)
    prompt = _prompt(vocab)
    cold = _one(core, "cold", prompt)
    _evict_all(core, vocab)
    assert core.bm.match_prefix(prompt)[0] == []  # gone from memory
    ssd = _stats(core)["ssd"]
    assert ssd["writes"] >= 10 and ssd["blocks"] >= 10
    hit = _one(core, "hit", prompt)
    assert hit["cached"] == 40 and hit["ids"] == cold["ids"]
    ssd = _stats(core)["ssd"]
    assert ssd["hits"] >= 10 and ssd["promoted"] >= 10 and ssd["read_hits"] >= 10

    # Partial: the first 5 blocks come from disk, the rest is computed.
    _evict_all(core, vocab)
    other = prompt[:21] + [11] * 20
    ref = _one(_core(llama, None), "ref", other)
    partial = _one(core, "partial", other)
    assert partial["cached"] == 20 and partial["ids"] == ref["ids"]
    # A miss: nothing on disk starts like this.
    assert _one(core, "miss", [12] + prompt[1:])["cached"] == 0
    core.tiers.close()


def test_restart_reuses_disk_blocks(llama, tmp_path: Path) -> None:
    vocab = llama.model.args.vocab_size
    prompt = _prompt(vocab)
    first = _core(llama, tmp_path)
    cold = _one(first, "cold", prompt)
    first.tiers.close(flush=True)  # what the server does on shutdown

    again = _core(llama, tmp_path)
    assert _stats(again)["ssd"]["blocks"] >= 10
    hit = _one(again, "hit", prompt)
    assert hit["cached"] == 40 and hit["ids"] == cold["ids"]
    again.tiers.close()


def test_concurrent_requests_share_a_prefix_being_promoted(llama, tmp_path: Path) -> None:
    vocab = llama.model.args.vocab_size
    prompt = _prompt(vocab)
    first = _core(llama, tmp_path)
    cold = _one(first, "cold", prompt)
    first.tiers.close(flush=True)

    core = _core(llama, tmp_path)
    for i in range(3):
        core.add_request(f"r{i}", prompt + [20 + i] * (i + 4), GREEDY)
    assert core.tiers.is_promoting(core.scheduler.waiting[0])
    assert core.tiers.is_promoting(core.scheduler.waiting[2])
    res = run_to_end(core)
    for i in range(3):
        assert res[f"r{i}"]["cached"] == 40
    ssd = _stats(core)["ssd"]
    assert ssd["reads"] == 10 and ssd["promoted"] == 10  # each block read once
    # The shared prompt again gives what the cold run gave.
    assert _one(core, "again", prompt)["ids"] == cold["ids"]
    core.tiers.close()


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_failed_step_leaves_the_disk_tier_right(
    tiny_models, arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory while requests run on blocks (and, for Qwen3-Next, a snapshot)
    promoted from disk: after the recovery (fresh pools, the memory tier emptied) they end
    as without it, and what is on disk is still read back right."""
    loaded = loaded_model(tiny_models(arch))
    vocab = loaded.model.args.vocab_size
    prompt = _prompt(vocab)
    prompts = [prompt + [20 + i] * (i + 4) for i in range(3)]
    ref = _core(loaded, None)
    for i, p in enumerate(prompts):
        ref.add_request(f"r{i}", p, GREEDY)
    want = run_to_end(ref)
    cold = _one(ref, "cold", prompt)

    core = _core(loaded, tmp_path)
    _one(core, "cold", prompt)
    _evict_all(core, vocab)
    calls = {"n": 0}

    def fail(n: int, rids: list[str]) -> str | None:
        calls["n"] += 1
        return OOM if calls["n"] == 2 else None

    faulty_forward(monkeypatch, fail)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, GREEDY)
    got = run_to_end(core, recover=True)
    monkeypatch.undo()
    assert calls["n"] > 2 and core.failed_steps["out_of_memory"] == 1
    for i in range(3):
        assert got[f"r{i}"]["ids"] == want[f"r{i}"]["ids"], i
    again = _one(core, "again", prompt)
    assert again["ids"] == cold["ids"] and again["cached"] == 40
    core.tiers.close()


def test_corrupt_file_is_skipped_counted_and_deleted(llama, tmp_path: Path) -> None:
    vocab = llama.model.args.vocab_size
    prompt = _prompt(vocab)
    first = _core(llama, tmp_path)
    cold = _one(first, "cold", prompt)
    keys = first.bm.prompt_keys(prompt)
    fp = first.tiers.store.fingerprint
    first.tiers.close(flush=True)

    # Flip one byte in the payload of the fourth block, and truncate the seventh.
    files = [tmp_path / fp / f"{k:032x}"[:2] / f"{k:032x}.kv" for k in keys]
    data = bytearray(files[3].read_bytes())
    data[len(data) // 2] ^= 0xFF
    files[3].write_bytes(bytes(data))
    files[6].write_bytes(files[6].read_bytes()[:100])

    core = _core(llama, tmp_path)
    res = _one(core, "after", prompt)
    assert res["cached"] == 12  # the three blocks before the corrupt one
    assert res["ids"] == cold["ids"]  # never wrong KV
    ssd = _stats(core)["ssd"]
    assert ssd["corrupt"] == 2
    assert not files[3].exists() and not files[6].exists()
    assert not core.tiers.store.contains(keys[3])
    core.tiers.close()


def test_failing_disk_degrades_the_tier_and_serving_goes_on(
    llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(self, path, chunks) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(SsdStore, "_write_file", full)
    vocab = llama.model.args.vocab_size
    core = _core(llama, tmp_path)
    prompt = _prompt(vocab)
    cold = _one(core, "cold", prompt)
    _evict_all(core, vocab)
    ssd = _stats(core)["ssd"]
    assert ssd["degraded"] is True and "No space left" in ssd["degraded_reason"]
    assert ssd["write_errors"] >= 1 and ssd["writes"] == 0
    assert ssd["writes_skipped_degraded"] > 0
    again = _one(core, "again", prompt)  # recomputed, same answer
    assert again["cached"] == 0 and again["ids"] == cold["ids"]
    assert not list(tmp_path.glob("*/*/*.tmp"))
    core.tiers.close()


def test_full_write_queue_is_reported(llama, tmp_path: Path, monkeypatch) -> None:
    real = SsdStore._write_file

    def slow(self, path, chunks) -> None:
        time.sleep(0.05)
        real(self, path, chunks)

    monkeypatch.setattr(SsdStore, "_write_file", slow)
    vocab = llama.model.args.vocab_size
    core = _core(llama, tmp_path, ssd_write_queue_mb=0)  # a queue of one block
    _one(core, "cold", _prompt(vocab))
    _evict_all(core, vocab)
    ssd = _stats(core)["ssd"]
    assert ssd["write_queue_capacity"] == 1 and ssd["write_queue_full"] > 0
    core.tiers.close(flush=False)


def test_model_change_never_reads_stale_kv(tiny_models, tmp_path: Path) -> None:
    a = loaded_model(tiny_models("llama"))
    b = loaded_model(tiny_models("llama", seed=1))  # same shapes, other weights
    prompt = _prompt(a.model.args.vocab_size)
    first = _core(a, tmp_path)
    _one(first, "a", prompt)
    first.tiers.close(flush=True)

    ref = _one(_core(b, None), "ref", prompt)
    core = _core(b, tmp_path)
    assert core.tiers.store.fingerprint != first.tiers.store.fingerprint
    res = _one(core, "b", prompt)
    assert res["cached"] == 0 and res["ids"] == ref["ids"]
    ssd = _stats(core)["ssd"]
    assert ssd["hits"] == 0 and ssd["reads"] == 0
    core.tiers.close(flush=False)


def test_cache_salt_isolates_requests(llama, tmp_path: Path) -> None:
    vocab = llama.model.args.vocab_size
    prompt = _prompt(vocab)
    core = _core(llama, tmp_path)

    def salted(salt: str | None) -> SamplingParams:
        return SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, cache_salt=salt)

    plain = _one(core, "plain", prompt, salted(None))
    assert _one(core, "a1", prompt, salted("tenant-a"))["cached"] == 0
    assert _one(core, "b1", prompt, salted("tenant-b"))["cached"] == 0
    a2 = _one(core, "a2", prompt, salted("tenant-a"))
    assert a2["cached"] == 40 and a2["ids"] == plain["ids"]
    assert _one(core, "p2", prompt, salted(None))["cached"] == 40
    # Through the SSD tier too: after eviction, a salt finds only its own blocks.
    _evict_all(core, vocab)
    assert _one(core, "c1", prompt, salted("tenant-c"))["cached"] == 0
    assert _one(core, "a3", prompt, salted("tenant-a"))["cached"] == 40
    core.tiers.close()


def test_clear_each_tier(llama, tmp_path: Path) -> None:
    vocab = llama.model.args.vocab_size
    prompt = _prompt(vocab)
    core = _core(llama, tmp_path)
    _one(core, "cold", prompt)
    core.tiers.flush()
    assert _stats(core)["ssd"]["blocks"] >= 10
    assert core.tiers.clear("memory")["memory"] >= 10
    assert _stats(core)["memory"]["blocks"] == 0
    assert _one(core, "from-ssd", prompt)["cached"] == 40
    cleared = core.tiers.clear()
    assert cleared["ssd"] >= 10 and cleared["memory"] >= 10
    assert _stats(core)["ssd"]["blocks"] == 0
    assert _one(core, "cold-again", prompt)["cached"] == 0
    core.tiers.close()


def test_ssd_size_cap_evicts_least_recently_used(llama, tmp_path: Path) -> None:
    vocab = llama.model.args.vocab_size
    probe = _core(llama, None)
    block_bytes = probe.tiers.block_bytes
    cap_blocks = 12
    # Files carry a small header on top of the KV payload.
    core = _core(llama, tmp_path, ssd_cache_max_gb=cap_blocks * (block_bytes + 600) / 1024**3)
    _one(core, "a", _prompt(vocab))
    _evict_all(core, vocab)
    ssd = _stats(core)["ssd"]
    assert ssd["evictions"] > 0 and ssd["disk_bytes"] <= ssd["max_bytes"]
    assert ssd["blocks"] <= cap_blocks * (block_bytes + 600) // block_bytes < ssd["writes"]
    # The first prompt's blocks were written first and never read: they went first.
    assert not any(core.tiers.store.contains(k) for k in core.bm.prompt_keys(_prompt(vocab)))
    on_disk = list(tmp_path.glob("*/*/*.kv"))
    assert len(on_disk) == ssd["blocks"]
    core.tiers.close(flush=False)


def test_stores_on_one_directory_share_its_cap_and_clear(tmp_path: Path) -> None:
    """A hybrid model's block and snapshot stores (two fingerprints, one directory): one
    byte count under the cap, the other's rows evicted first when older, one clear."""
    blocks = SsdStore(tmp_path, "blocks-fp", 1000, 5000)
    snaps = SsdStore(tmp_path, "snapshots-fp", 1000, 5000)
    payload = np.zeros(1000, np.uint8)
    for store in (blocks, snaps):
        for k in range(3):  # files of about 1.1 kB: four fit
            store.put(k, (k,), [payload], block=True)
            store.drain()
    assert blocks.keys == {2} and snaps.keys == {0, 1, 2}
    assert blocks.total_bytes == snaps.total_bytes <= 5000
    assert len(list(tmp_path.glob("*/*/*.kv"))) == 4
    assert snaps.clear() == 4
    assert blocks.keys == set() and not list(tmp_path.glob("*/*/*.kv"))
    blocks.put(7, (7,), [payload], block=True)  # its folder is back
    blocks.drain()
    assert blocks.keys == {7} and snaps.total_bytes == blocks.total_bytes > 1000
    blocks.close()
    snaps.close()


# -- models with recurrent layers: KV blocks and state snapshots -----------------------
@pytest.fixture
def hybrid(tiny_models):
    return loaded_model(tiny_models("qwen3_next"))


def _hybrid_core(loaded, ssd: Path | None, **kw) -> EngineCore:
    # Snapshots only at prompt ends and finished generations: the tests know where.
    return _core(loaded, ssd, snapshot_interval_blocks=0, **kw)


def _in_memory(core: EngineCore, prompt: list[int]) -> tuple[int, int]:
    """How many of the prompt's blocks, and of their snapshots, are in memory."""
    keys = core.bm.prompt_keys(prompt)
    assert core.snapshots is not None
    blocks = sum(k in core.bm.hash_to_block for k in keys)
    return blocks, sum(core.snapshots.contains(k) for k in keys)


def test_hybrid_blocks_and_snapshots_spill_and_come_back(hybrid, tmp_path: Path) -> None:
    """Qwen3-Next: a prompt's blocks and snapshots evicted to disk; the same prompt and
    the next turn (into the answer) resume from disk and give mlx-lm's tokens."""
    vocab = hybrid.model.args.vocab_size
    prompt = _prompt(vocab)
    ref = mlx_lm_reference(hybrid.model, prompt, GREEDY.max_tokens)
    core = _hybrid_core(hybrid, tmp_path)
    cold = _one(core, "cold", prompt)
    assert cold["cached"] == 0 and agrees(cold["ids"][0], *ref)
    _evict_all(core, vocab)
    assert _in_memory(core, prompt) == (0, 0)
    ssd = _stats(core)["ssd"]
    assert ssd["blocks"] >= 10 and ssd["snapshots"]["count"] >= 2  # prompt end, answer end
    assert ssd["snapshots"]["bytes"] == ssd["snapshots"]["count"] * core.runner.state_bytes

    hit = _one(core, "hit", prompt)
    assert hit["cached"] == 40 and hit["ids"] == cold["ids"]
    snaps = _stats(core)["ssd"]["snapshots"]
    assert snaps["hits"] == snaps["promoted"] == snaps["read_hits"] == 1

    # The next turn: its cached part reaches into the answer, from the snapshot taken
    # when the generation ended, also brought back from disk.
    turn2 = prompt + cold["ids"][0] + _prompt(vocab, 9, seed=6)
    ref2 = mlx_lm_reference(hybrid.model, turn2, GREEDY.max_tokens)
    _evict_all(core, vocab)  # its fillers come back from disk too
    promoted = _stats(core)["ssd"]["snapshots"]["promoted"]
    second = _one(core, "turn2", turn2)
    assert second["cached"] == (len(prompt) + GREEDY.max_tokens - 1) // BS * BS
    assert agrees(second["ids"][0], *ref2)
    assert _stats(core)["ssd"]["snapshots"]["promoted"] == promoted + 1
    core.tiers.close()


def test_a_snapshot_evicted_for_room_comes_back_alone(hybrid, tmp_path: Path) -> None:
    """Snapshot memory for one: the prompt's snapshot makes room for the answer's and is
    written, its blocks stay in memory; the prompt again reads only the snapshot."""
    vocab = hybrid.model.args.vocab_size
    prompt = _prompt(vocab)
    probe = _hybrid_core(hybrid, None)
    budget = 1 << 30
    share = 1.5 * probe.runner.state_bytes / budget
    core = _hybrid_core(hybrid, tmp_path, cache_memory_bytes=budget, snapshot_memory_share=share)
    cold = _one(core, "cold", prompt)
    core.scheduler.schedule()  # hands the spill to the writer
    _drain(core)
    assert _in_memory(core, prompt) == (10, 0)
    assert _stats(core)["ssd"]["snapshots"]["count"] == 1
    hit = _one(core, "hit", prompt)
    assert hit["cached"] == 40 and hit["ids"] == cold["ids"]
    ssd = _stats(core)["ssd"]
    assert ssd["snapshots"]["promoted"] == 1 and ssd["reads"] == 0  # no block was read
    core.tiers.close()


def test_hybrid_restart_serves_from_disk_alone(hybrid, tmp_path: Path) -> None:
    vocab = hybrid.model.args.vocab_size
    prompt = _prompt(vocab)
    ref = mlx_lm_reference(hybrid.model, prompt, GREEDY.max_tokens)
    first = _hybrid_core(hybrid, tmp_path)
    _one(first, "cold", prompt)
    first.tiers.close(flush=True)  # what the server does on shutdown

    again = _hybrid_core(hybrid, tmp_path)
    ssd = _stats(again)["ssd"]
    assert ssd["blocks"] >= 10 and ssd["snapshots"]["count"] >= 2
    # Two requests on the prompt's prefix wait for the same blocks and snapshot.
    longer = [prompt + [20 + i] * (i + 4) for i in range(2)]
    for i, p in enumerate(longer):
        again.add_request(f"r{i}", p, GREEDY)
        assert again.tiers.is_promoting(again.scheduler.waiting[i])
    res = run_to_end(again)
    for i, p in enumerate(longer):
        assert res[f"r{i}"]["cached"] == 40
        assert agrees(res[f"r{i}"]["ids"][0], *mlx_lm_reference(hybrid.model, p, 6))
    ssd = _stats(again)["ssd"]
    assert ssd["reads"] == 10 and ssd["snapshots"]["reads"] == 1  # each read once
    hit = _one(again, "hit", prompt)
    assert hit["cached"] == 40 and agrees(hit["ids"][0], *ref)
    again.tiers.close()


def test_corrupt_snapshot_is_counted_and_the_prompt_computed(hybrid, tmp_path: Path) -> None:
    vocab = hybrid.model.args.vocab_size
    prompt = _prompt(vocab)
    first = _hybrid_core(hybrid, tmp_path)
    cold = _one(first, "cold", prompt)
    key = f"{first.bm.prompt_keys(prompt)[-1]:032x}"
    fp = first.tiers.ssd_snapshots.store.fingerprint
    first.tiers.close(flush=True)
    path = tmp_path / fp / key[:2] / f"{key}.kv"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    core = _hybrid_core(hybrid, tmp_path)
    res = _one(core, "after", prompt)
    assert res["cached"] == 0 and res["ids"] == cold["ids"]  # never wrong state
    snaps = _stats(core)["ssd"]["snapshots"]
    assert snaps["corrupt"] == 1 and snaps["promoted"] == 0 and not path.exists()
    # Computed again, the prompt's snapshot is back in memory: a hit.
    assert _one(core, "again", prompt)["cached"] == 40
    core.tiers.close()


def test_hybrid_clear_each_tier(hybrid, tmp_path: Path) -> None:
    vocab = hybrid.model.args.vocab_size
    prompt = _prompt(vocab)
    core = _hybrid_core(hybrid, tmp_path)
    _one(core, "cold", prompt)
    core.tiers.flush()
    assert _stats(core)["ssd"]["snapshots"]["count"] >= 2
    core.tiers.clear("memory")
    assert _in_memory(core, prompt) == (0, 0)
    assert core.snapshots is not None and len(core.snapshots) == 0
    assert _stats(core)["ssd"]["snapshots"]["writes"] == 2  # clearing memory writes nothing
    assert _one(core, "from-ssd", prompt)["cached"] == 40
    core.tiers.clear()
    ssd = _stats(core)["ssd"]
    assert ssd["blocks"] == 0 and ssd["snapshots"]["count"] == 0
    assert not list(tmp_path.glob("*/*/*.kv"))
    assert _one(core, "cold-again", prompt)["cached"] == 0
    core.tiers.close()


def test_recurrent_only_model_keeps_only_snapshots_on_disk(tiny_models, tmp_path: Path) -> None:
    """Mamba: blocks hold no KV, so none is written; a snapshot brings a prompt back,
    after eviction and after a restart."""
    loaded = loaded_model(tiny_hybrids.get_tiny_hybrid("mamba"))
    vocab = loaded.model.args.vocab_size
    prompt = _prompt(vocab)
    ref = mlx_lm_reference(loaded.model, prompt, GREEDY.max_tokens)
    core = _hybrid_core(loaded, tmp_path)
    assert core.tiers.store is None and core.tiers.ssd_snapshots is not None
    cold = _one(core, "cold", prompt)
    assert agrees(cold["ids"][0], *ref)
    _evict_all(core, vocab)
    assert _in_memory(core, prompt) == (0, 0)
    hit = _one(core, "hit", prompt)
    assert hit["cached"] == 40 and hit["ids"] == cold["ids"]
    ssd = _stats(core)["ssd"]
    assert ssd["blocks"] == 0 and ssd["snapshots"]["promoted"] == 1
    core.tiers.close(flush=True)

    again = _hybrid_core(loaded, tmp_path)
    hit = _one(again, "restart", prompt)
    assert hit["cached"] == 40 and hit["ids"] == cold["ids"]
    again.tiers.close()


def _quantized_reference(model, prompt: list[int], n: int, bits: int, group_size: int):
    """Greedy tokens with mlx-lm's own QuantizedKVCache (keys quantised from the start)."""
    cache = [QuantizedKVCache(group_size, bits) for _ in model.layers]
    tokens, gaps = [], []
    logits = model(mx.array([prompt]), cache=cache)[:, -1]
    for _ in range(n):
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top2 = mx.sort(lp[0])[-2:].tolist()
        tok = int(mx.argmax(lp, axis=-1).item())
        tokens.append(tok)
        gaps.append(top2[1] - top2[0])
        logits = model(mx.array([[tok]]), cache=cache)[:, -1]
    return tokens, gaps


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_kv_matches_mlx_lm_and_saves_memory(tiny_models, bits: int) -> None:
    loaded = loaded_model(tiny_models("qwen3", head_dim=32))  # groups of 32 need dims of 32
    vocab = loaded.model.args.vocab_size
    prompts = random_prompts(vocab, 6, seed=31)
    n = 16
    full = EngineCore(loaded, engine_config(num_blocks=200))
    quant = core_or_skip(loaded, engine_config(num_blocks=200, kv_bits=bits, kv_group_size=32))
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    # Alone and batched (padding, masks and chunked prefill over quantised pools).
    for i, p in enumerate(prompts):
        quant.add_request(f"q{i}", p, params)
    batched = run_to_end(quant)
    for i, p in enumerate(prompts[:3]):
        ref, gaps = _quantized_reference(loaded.model, p, n, bits, 32)
        assert agrees(_one(quant, f"alone{i}", p, params)["ids"][0], ref, gaps)
        assert agrees(batched[f"q{i}"]["ids"][0], ref, gaps)
    full_bytes = sum(p.nbytes for p in full.runner.pools.values())
    quant_bytes = sum(p.nbytes for p in quant.runner.pools.values())
    # float32 KV of head dim 32: each row of 32 values (128 bytes) becomes 32 * bits / 8
    # bytes plus one float32 scale and bias.
    assert quant_bytes == full_bytes * (32 * bits // 8 + 8) // 128
    # Quantised blocks are shared by the prefix cache like any others.
    first = _one(quant, "first", prompts[0] * 3, params)
    again = _one(quant, "again", prompts[0] * 3, params)
    assert again["cached"] > 0 and again["ids"] == first["ids"]
    # Another layout, so another fingerprint: the SSD tier never mixes them.
    fps = {kv_fingerprint(loaded.model, {}, c.runner.specs, c.bm.block_size) for c in (full, quant)}
    assert len(fps) == 2


def test_quantized_kv_sizes_the_pool_by_its_bytes(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama", head_dim=32))
    mib = 1024 * 1024
    full = EngineCore(loaded, engine_config(num_blocks=None, cache_memory_bytes=4 * mib))
    quant = core_or_skip(
        loaded,
        engine_config(num_blocks=None, cache_memory_bytes=4 * mib, kv_bits=8, kv_group_size=32),
    )
    assert quant.num_blocks > 3 * full.num_blocks
    mx.clear_cache()


@pytest.mark.parametrize("family", tiny_hybrids.FAMILIES)
def test_every_hybrid_family_restarts_from_disk(tiny_models, family: str, tmp_path: Path) -> None:
    """Each family's state layout (Falcon-H1's CacheList slots, LFM2's convolutions, ...)
    is written and read back: after a restart the prompt resumes with the same tokens."""
    loaded = load_model(str(tiny_hybrids.get_tiny_hybrid(family)))
    prompt = _prompt(loaded.vocab_size)
    first = _hybrid_core(loaded, tmp_path)
    cold = _one(first, "cold", prompt)
    first.tiers.close(flush=True)
    snaps = _stats(first)["ssd"]["snapshots"]
    assert snaps["count"] == 2 and snaps["not_written_other_layout"] == 0

    again = _hybrid_core(loaded, tmp_path)
    hit = _one(again, "hit", prompt)
    assert hit["cached"] == 40 and hit["ids"] == cold["ids"]
    again.tiers.close(flush=False)
