"""Speculative decoding with a draft model: exact for greedy and sampled requests, batched
with requests that do not speculate, the draft's KV rolled back and freed, bad drafts
refused at startup."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support.engine_runs import (
    OOM,
    engine_config,
    faulty_forward,
    loaded_model,
    random_prompts,
    run_to_end,
)
from support.tiny_models import with_swapped_tokens
from test_speculative import _chi2_ok, _sample_many, _softmax

from pippin.engine.config import SpeculativeConfig
from pippin.engine.core import EngineCore
from pippin.engine.draft_model import DraftModelError
from pippin.engine.types import SamplingParams
from pippin.runner.model_runner import ModelRunner
from pippin.store.loaded import ModelLoadError


def _spec(model: Path, k: int = 4, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(model), num_speculative_tokens=k, **kw)


def _small_draft(tiny_models) -> Path:
    """The target's first layer alone (the same seed draws the same embeddings, first
    layer and head): a draft that agrees with it now and then."""
    return tiny_models("llama", num_hidden_layers=1)


def test_config_takes_vllm_draft_model_keys() -> None:
    cfg = SpeculativeConfig.parse('{"model": "/m", "num_speculative_tokens": 3}')
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/m", 3)
    cfg = SpeculativeConfig.parse('{"method": "draft_model", "model": "org/draft"}')
    assert cfg.model == "org/draft"
    for bad, words in [
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"method": "ngram", "model": "/m"}', "is for method 'draft_model'"),
        ('{"model": "/m", "num_speculative_tokens": 33}', "<= 32"),
        ('{"model": "/m", "num_speculative_tokens": 0}', ">= 1"),
    ]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


def _greedy_runs(loaded, spec, core_kw=None, penalties=True) -> tuple[dict, dict, EngineCore]:
    """Greedy requests of different lengths batched with ones that do not speculate
    (sampled with a seed) and ones with stop tokens and (`penalties`) with penalties,
    bias, min_tokens and logprobs."""
    vocab = loaded.model.args.vocab_size
    prompts = random_prompts(vocab, 5, seed=9)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    reqs = [(f"g{i}", p, greedy) for i, p in enumerate(prompts)]
    reqs += [
        ("seeded", prompts[0], SamplingParams(max_tokens=30, temperature=0.9, seed=3)),
    ]
    if penalties:
        reqs.append(
            (
                "pen",
                prompts[1],
                SamplingParams(
                    max_tokens=35,
                    temperature=0.0,
                    repetition_penalty=1.3,
                    logit_bias={50: 3.0},
                    min_tokens=20,
                    logprobs=True,
                    top_logprobs=2,
                ),
            )
        )
    reqs += [
        ("stop", prompts[2], SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=[77])),
    ]
    core = EngineCore(loaded, engine_config(speculative=spec, **(core_kw or {})))
    for r in reqs:
        core.add_request(*r)
    res = run_to_end(core)
    return {k: (v["ids"][0], v["finish"][0]) for k, v in res.items()}, core.stats(), core


@pytest.mark.parametrize("draft", ["small", "self"])
def test_greedy_identical_with_a_draft_model(tiny_models, draft: str) -> None:
    target = tiny_models("llama")
    loaded = loaded_model(target)
    plain, _, _ = _greedy_runs(loaded, None)
    path = target if draft == "self" else _small_draft(tiny_models)
    spec, stats, core = _greedy_runs(loaded, _spec(path))
    assert spec == plain
    assert stats["spec_decode_num_drafts"] > 0
    drafted, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    if draft == "self":
        # Penalties in the draft see only the tokens known on the host (not the step's
        # earlier proposals), so a few proposals may be refused; most are kept.
        assert kept >= 0.8 * drafted
        # Without them, the target as its own draft proposes its next greedy tokens.
        spec, stats, _ = _greedy_runs(loaded, _spec(path), penalties=False)
        drafted, kept = (
            stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"],
        )
        assert kept == drafted
        assert stats["spec_decode_num_accepted_tokens_pos3"] > 0
    else:
        assert kept < drafted
    for model in ("", "spec_draft_"):
        assert stats[f"{model}blocks_free"] == stats[f"{model}blocks_total"]
    assert not core.spec.draft.seqs


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_proposals_follow_the_requests_logit_bias(tiny_models, temperature: float) -> None:
    """A bias that makes the target say one token: a draft that applies the request's
    bias proposes it and every proposal is kept (the draft's own argmax would not be)."""
    target = tiny_models("llama")
    loaded = loaded_model(target)
    core = EngineCore(loaded, engine_config(speculative=_spec(_small_draft(tiny_models), k=4)))
    params = SamplingParams(
        max_tokens=24, temperature=temperature, seed=None, logit_bias={50: 60.0}, ignore_eos=True
    )
    core.add_request("bias", random_prompts(loaded.model.args.vocab_size, 1, seed=3)[0], params)
    res = run_to_end(core)
    assert res["bias"]["ids"][0] == [50] * 24
    stats = core.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


def test_draft_kv_caught_up_in_chunks_and_evicted_when_short(tiny_models) -> None:
    """A draft pool too small for every sequence: the draft KV of sequences not in the
    step is dropped and computed again later; a small step budget chunks catch-ups over
    several steps. Outputs stay those of plain decoding."""
    target = tiny_models("llama")
    loaded = loaded_model(target)
    small = {"max_num_batched_tokens": 16, "num_blocks": 60}
    plain, _, _ = _greedy_runs(loaded, None, small, penalties=False)
    spec, stats, core = _greedy_runs(loaded, _spec(target, k=3), small, penalties=False)
    assert spec == plain
    assert stats["spec_draft_blocks_total"] == 59 and stats["spec_draft_evictions"] > 0
    assert stats["spec_draft_blocks_free"] == 59
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]


def test_speculation_off_above_the_batch_threshold(tiny_models) -> None:
    target = tiny_models("llama")
    loaded = loaded_model(target)
    core = EngineCore(loaded, engine_config(speculative=_spec(target, disable_by_batch_size=2)))
    for i, p in enumerate(random_prompts(loaded.model.args.vocab_size, 3, seed=2)):
        params = SamplingParams(max_tokens=10 + 20 * i, temperature=0.0, ignore_eos=True)
        core.add_request(f"r{i}", p, params)
    for _ in range(6):  # all three decoding: no draft call, no draft KV
        core.step()
    assert core.stats()["spec_decode_num_drafts"] == 0 and not core.spec.draft.seqs
    run_to_end(core)
    assert core.stats()["spec_decode_num_drafts"] > 0  # once the first ended


@pytest.mark.parametrize("draft", ["other", "self"])
def test_sampled_tokens_follow_the_target_distribution(tiny_models, draft: str) -> None:
    """Four tokens at top_k=2 from many sequences, the second and third proposed by a
    draft: their joint frequencies match the target's exact joint distribution. Drafts:
    the target's weights with another RoPE base (it agrees about a third of the time, so
    most proposals are refused and the residual draws), and the target itself (nearly
    every proposal kept, the bonus token drawn)."""
    target = tiny_models("llama")
    loaded = loaded_model(target)
    model = loaded.model
    prompt = random_prompts(model.args.vocab_size, 1, seed=21)[0][:20]
    temp, top_k, N = 0.7, 2, 2000

    def dist(ctx: list[int]) -> dict[int, float]:
        logits = np.array(model(mx.array([ctx]))[0, -1].astype(mx.float32)) / temp
        top = np.argsort(-logits)[:top_k]
        return dict(zip(top.tolist(), _softmax(logits[top]).tolist()))

    exact: dict[tuple, float] = {(): 1.0}
    for _ in range(4):
        exact = {
            c + (t,): p * pt for c, p in exact.items() for t, pt in dist(prompt + list(c)).items()
        }
    mx.random.seed(11)
    path = target if draft == "self" else tiny_models("llama", rope_theta=500.0)
    cfg = _spec(path, k=2, disable_by_batch_size=100_000)
    params = SamplingParams(max_tokens=4, temperature=temp, top_k=top_k, n=N, ignore_eos=True)
    res, stats = _sample_many(loaded, cfg, prompt, params)
    # (Catch-ups of 2000 prompts take a few steps' budgets: some decode plainly first.)
    assert stats["spec_decode_num_drafts"] >= N // 2
    drafted, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    if draft == "self":
        assert kept >= 0.95 * drafted
    else:
        assert 0.1 * drafted < kept < 0.6 * drafted
    assert stats["spec_decode_num_accepted_tokens_pos1"] > 0
    assert stats["spec_draft_blocks_free"] == stats["spec_draft_blocks_total"]
    observed = Counter(tuple(v) for v in res.values())
    ok, stat, limit = _chi2_ok(observed, exact, N)
    assert ok, (stat, limit)


def test_draft_pool_and_weights_count_against_the_memory(tiny_models) -> None:
    """The KV budget covers both models' pools, and the engine's weight and KV bytes (what
    the model registry holds against its memory limit) include the draft's."""
    loaded = loaded_model(tiny_models("llama"))
    draft_path = _small_draft(tiny_models)
    plain = EngineCore(loaded, engine_config(num_blocks=None))
    budget = 200 * (plain.kv_bytes // plain.num_blocks)
    alone = EngineCore(loaded, engine_config(num_blocks=None, cache_memory_bytes=budget))
    both = EngineCore(
        loaded,
        engine_config(num_blocks=None, cache_memory_bytes=budget, speculative=_spec(draft_path)),
    )
    draft = both.spec.draft
    assert alone.num_blocks == 200
    assert draft.num_blocks > 1 and both.num_blocks < alone.num_blocks
    assert both.kv_bytes == both.runner.pool_bytes + draft.runner.pool_bytes
    assert budget - alone.kv_bytes // alone.num_blocks < both.kv_bytes <= budget
    assert both.weight_bytes == alone.weight_bytes + draft.runner.weight_bytes > alone.weight_bytes
    stats = both.stats()
    assert (stats["kv_bytes"], stats["weight_bytes"]) == (both.kv_bytes, both.weight_bytes)
    # Past what the draft needs (few speculating sequences), the rest is the target's.
    few = _spec(draft_path, disable_by_batch_size=1)
    core = EngineCore(
        loaded, engine_config(num_blocks=None, cache_memory_bytes=budget, speculative=few)
    )
    need = 512 // 4 + 2 + 1
    assert core.spec.draft.num_blocks == need
    assert core.num_blocks == (budget - need * draft.bytes_per_block) // (
        alone.kv_bytes // alone.num_blocks
    )


def test_bad_drafts_refused_at_startup(tiny_models, tmp_path: Path) -> None:
    loaded = loaded_model(tiny_models("llama"))
    other = with_swapped_tokens(_small_draft(tiny_models), tmp_path / "other")
    with pytest.raises(DraftModelError, match="does not share the target's vocabulary"):
        EngineCore(loaded, engine_config(speculative=_spec(other)))
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        EngineCore(loaded, engine_config(speculative=_spec(tmp_path / "missing")))


def test_random_proposal_lengths_and_aborts_free_every_block(tiny_models) -> None:
    """Requests aborted mid-way and ending at max_tokens or the context: no block of
    either model is left behind."""
    target = tiny_models("llama")
    loaded = loaded_model(target)
    core = EngineCore(loaded, engine_config(speculative=_spec(target, k=5), max_model_len=64))
    rng = random.Random(4)
    prompts = random_prompts(loaded.model.args.vocab_size, 6, seed=3)
    for i, p in enumerate(prompts):
        core.add_request(
            str(i), p, SamplingParams(max_tokens=rng.randrange(1, 30), temperature=0.5)
        )
    for _ in range(4):
        core.step()
    core.abort("0")
    core.abort("3")
    run_to_end(core)
    stats = core.stats()
    assert stats["blocks_free"] == stats["blocks_total"]
    assert stats["spec_draft_blocks_free"] == stats["spec_draft_blocks_total"]
    assert not core.spec.draft.seqs


def test_failed_steps_recovered_with_both_pools_made_anew(tiny_models, monkeypatch) -> None:
    """Model calls (the target's or the draft's) that run the device out of memory: the
    running sequences are recomputed, the draft's KV is dropped with its pool made anew,
    and every request ends exactly as without the failures."""
    target = tiny_models("llama")
    loaded = loaded_model(target)
    prompts = random_prompts(loaded.model.args.vocab_size, 5, seed=9)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def run(core: EngineCore) -> dict:
        for i, p in enumerate(prompts):
            core.add_request(f"g{i}", p, greedy)
        return {k: v["ids"][0] for k, v in run_to_end(core, recover=True).items()}

    want = run(EngineCore(loaded, engine_config()))
    calls: list[bool] = []  # per model call: whether the draft's runner made it

    real = ModelRunner.forward

    def spy(self, items):
        calls.append(self is not core.runner)
        return real(self, items)

    monkeypatch.setattr(ModelRunner, "forward", spy)
    core = EngineCore(loaded, engine_config(speculative=_spec(target)))
    faulty_forward(monkeypatch, lambda n, _: OOM if n in (9, 30) else None)
    assert run(core) == want
    assert core.stats()["failed_steps_out_of_memory"] == 2
    assert any(calls[n - 1] for n in (9, 30))  # a draft call among the failed ones
    stats = core.stats()
    assert stats["spec_draft_blocks_free"] == stats["spec_draft_blocks_total"]
    assert stats["blocks_free"] == stats["blocks_total"]
    parts = [p for pool in core.spec.draft.runner.pools.values() for p in pool.parts]
    assert parts and not any(mx.any(p == 3.0).item() for p in parts)


def test_draft_kv_of_a_prompt_served_from_its_prefix_cache(tiny_models) -> None:
    """A second request with the same prompt starts from the draft KV the first left in
    the draft's prefix cache; its output is the same."""
    target = tiny_models("llama")
    loaded = loaded_model(target)
    core = EngineCore(loaded, engine_config(speculative=_spec(target)))
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=12)[0] * 2
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    outs = []
    for rid in ("a", "b"):
        core.add_request(rid, prompt, greedy)
        outs.append(run_to_end(core)[rid]["ids"][0])
    bm = core.spec.draft.bm
    assert outs[0] == outs[1]
    assert (bm.queries, bm.hits) == (2, 1) and bm.hit_blocks >= len(prompt) // 4 - 1
    stats = core.stats()
    assert stats["spec_draft_blocks_free"] == stats["spec_draft_blocks_total"]
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
