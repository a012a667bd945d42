"""The prefix cache's tiers on tiny models: memory, SSD spill and promotion, restart
reuse, corrupt files, a failing disk, model changes, cache_salt and quantised KV."""

from __future__ import annotations

import errno
import random
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache
from support.engine_runs import (
    OOM,
    agrees,
    core_or_skip,
    engine_config,
    faulty_forward,
    loaded_model,
    random_prompts,
    run_to_end,
)

from pippin.engine.core import EngineCore
from pippin.engine.kv_fingerprint import kv_fingerprint
from pippin.engine.ssd_store import SsdStore
from pippin.engine.types import SamplingParams

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
    core.tiers.store.drain()


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


def test_failed_step_leaves_the_disk_tier_right(
    llama, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory while requests run on blocks promoted from disk: after the recovery
    (fresh pools, the memory tier emptied) they end as without it, and the blocks on disk
    are still read back right."""
    vocab = llama.model.args.vocab_size
    prompt = _prompt(vocab)
    prompts = [prompt + [20 + i] * (i + 4) for i in range(3)]
    ref = _core(llama, None)
    for i, p in enumerate(prompts):
        ref.add_request(f"r{i}", p, GREEDY)
    want = run_to_end(ref)
    cold = _one(ref, "cold", prompt)

    core = _core(llama, tmp_path)
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


def test_recurrent_models_opt_out_of_the_ssd_tier(tiny_models, tmp_path: Path) -> None:
    core = _core(loaded_model(tiny_models("qwen3_next")), tmp_path)
    ssd = _stats(core)["ssd"]
    assert ssd["enabled"] is False and "recurrent" in ssd["reason"]


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
