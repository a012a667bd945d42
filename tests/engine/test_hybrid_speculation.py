"""Speculative decoding on hybrid (attention + recurrent) models: refused proposals leave
the recurrent state as if they had never run, for prompt lookup and draft models (hybrid
ones too), greedy and sampled, batched with rows that do not speculate."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from support.engine_runs import (
    OOM,
    agrees,
    beside_speculation,
    engine_config,
    loaded_model,
    mlx_lm_reference,
    random_prompts,
    run_to_end,
)
from support.tiny_hybrids import FAMILIES, get_tiny_hybrid
from test_speculative import _chi2_ok, _sample_many, _softmax

from pippin.engine import speculative
from pippin.engine.config import SpeculativeConfig
from pippin.engine.core import EngineCore
from pippin.engine.draft_model import DraftModel
from pippin.engine.speculative import Speculator
from pippin.engine.types import SamplingParams
from pippin.runner.model_runner import ModelRunner
from pippin.runner.recurrent_state import as_arrays
from pippin.store.loaded import LoadedModel

K = 4
LOOKUP = SpeculativeConfig(num_speculative_tokens=K, prompt_lookup_max=3, prompt_lookup_min=1)


def _draft(path: Path, k: int = K, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(path), num_speculative_tokens=k, **kw)


def _hybrid_drafts(tiny_models) -> dict[str, Path]:
    """Hybrid drafts for the tiny qwen3_next: a two-layer one (a gated-DeltaNet layer,
    then attention), which seldom agrees with it, and its own weights with another RoPE
    base, which mostly does."""
    return {
        "small": tiny_models("qwen3_next", num_hidden_layers=2, full_attention_interval=2),
        "rope": tiny_models("qwen3_next", rope_theta=500.0),
    }


def _requests(vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy requests of different lengths (two with repeating prompts, for lookup),
    with ones that do not speculate (seeded) and ones with penalties, bias, min_tokens,
    logprobs and stop tokens; every prompt different."""
    rng = random.Random(5)
    repeating = [[rng.randrange(3, vocab) for _ in range(9)] * 3 for _ in range(2)]
    prompts = repeating + random_prompts(vocab, 6, seed=9)
    greedy = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (40, 33, 27, 36)
    ]
    params = greedy + beside_speculation()
    return [(f"r{i}", p, params[i]) for i, p in enumerate(prompts[: len(params)])]


def _run(loaded: LoadedModel, spec: SpeculativeConfig | None, **kw) -> tuple[dict, dict]:
    core = EngineCore(loaded, engine_config(speculative=spec, **kw))
    for r in _requests(loaded.model.args.vocab_size):
        core.add_request(*r)
    res = run_to_end(core)
    stats = core.stats()
    assert stats["blocks_free"] == stats["blocks_total"]
    if core.spec is not None and core.spec.draft is not None:
        assert stats["spec_draft_blocks_free"] == stats["spec_draft_blocks_total"]
        assert not core.spec.draft.seqs
    return {k: (v["ids"][0], v["finish"][0]) for k, v in res.items()}, stats


def _oracle(monkeypatch, full: list[list[int]], seed: int = 0) -> None:
    """Lookups that propose each sequence's true next tokens (`full`: each prompt and its
    output without speculation) with one of them changed at a random place, or none:
    proposals are kept up to every position, the whole of them now and then."""
    rng = random.Random(seed)

    def propose(ids, k, n_max, n_min):
        ids = list(ids)
        for f in full:
            if f[: len(ids)] == ids:
                draft = f[len(ids) : len(ids) + k]
                j = rng.randrange(k + 2)
                if j < len(draft):
                    draft[j] = 3 + (draft[j] + 1) % 300
                return draft
        return [ids[-1]] * k

    monkeypatch.setattr(speculative, "propose_ngram", propose)


def _full(loaded: LoadedModel, plain: dict) -> list[list[int]]:
    return [p + plain[rid][0] for rid, p, _ in _requests(loaded.model.args.vocab_size)]


def test_greedy_identical_with_proposals_kept_and_refused(tiny_models, monkeypatch) -> None:
    loaded = loaded_model(tiny_models("qwen3_next"))
    plain, _ = _run(loaded, None)
    # mlx-lm's own generation agrees with the engine's (a check on the reference).
    for rid, prompt, params in _requests(loaded.model.args.vocab_size)[:4]:
        ref, gaps = mlx_lm_reference(loaded.model, prompt, params.max_tokens)
        assert agrees(plain[rid][0], ref, gaps), rid

    # Lookup as it is: the repeating prompts find proposals.
    spec, stats = _run(loaded, LOOKUP)
    assert spec == plain
    assert stats["spec_decode_num_drafts"] > 0

    _oracle(monkeypatch, _full(loaded, plain))
    spec, stats = _run(loaded, LOOKUP)
    assert spec == plain
    drafted, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert 0 < kept < drafted
    assert stats[f"spec_decode_num_accepted_tokens_pos{K - 1}"] > 0  # all four kept
    # Rows that refused one went back to their state from before the verify call.
    assert 0 < stats["spec_decode_num_replays"] < stats["spec_decode_num_drafts"]


def test_greedy_identical_with_chunked_prompts_and_small_blocks(tiny_models, monkeypatch) -> None:
    """Prompts prefilled in chunks beside verifying decodes, proposals across block
    boundaries (two-token blocks): still the tokens of plain decoding."""
    loaded = loaded_model(tiny_models("qwen3_next"))
    small = {"block_size": 2, "num_blocks": 900, "max_num_batched_tokens": 20}
    plain, _ = _run(loaded, None, **small)
    _oracle(monkeypatch, _full(loaded, plain), seed=1)
    spec, stats = _run(loaded, LOOKUP, **small)
    assert spec == plain
    assert stats["spec_decode_num_replays"] > 0


def test_prefix_cache_holds_only_kept_tokens_and_their_state(tiny_models, monkeypatch) -> None:
    """A proposal at every step, most of them refused: a later request whose prompt is
    the whole conversation so far resumes from cached blocks and a state snapshot, and
    continues as an engine without any cache does."""

    def propose(ids, k, n_max, n_min):
        return [ids[-1]] * k

    monkeypatch.setattr(speculative, "propose_ngram", propose)
    loaded = loaded_model(tiny_models("qwen3_next"))
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=7)[0]
    greedy = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    core = EngineCore(loaded, engine_config(speculative=LOOKUP))
    core.add_request("a", prompt, greedy)
    first = run_to_end(core)["a"]["ids"][0]
    stats = core.stats()
    assert stats["spec_decode_num_replays"] > 0
    full = prompt + first
    cached, _ = core.bm.match_prefix(full)
    for i, bid in enumerate(cached):
        assert core.bm.blocks[bid].token_ids == tuple(full[i * 4 : (i + 1) * 4])
    again = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    core.add_request("b", full, again)
    res = run_to_end(core)["b"]
    assert res["cached"] >= (len(prompt) - 1) // 4 * 4  # the prompt's snapshot at least
    fresh = EngineCore(loaded, engine_config(enable_prefix_caching=False))
    fresh.add_request("b", full, again)
    assert run_to_end(fresh)["b"]["ids"] == res["ids"]


def test_failed_verify_and_replay_calls_recovered(tiny_models, monkeypatch) -> None:
    """Verify calls and replay calls that run the device out of memory: the running
    sequences are recomputed from their known tokens, and every request ends exactly as
    without speculation or failures, each token sent once."""
    loaded = loaded_model(tiny_models("qwen3_next"))
    plain, _ = _run(loaded, None)
    _oracle(monkeypatch, _full(loaded, plain), seed=2)
    real = ModelRunner.forward
    failed: list[str] = []

    def forward(self, items):
        replay = all(not it.samples and it.start + it.length == it.seq.num_computed for it in items)
        kind = "replay" if replay else "verify" if any(it.draft for it in items) else None
        out = real(self, items)
        # The first of each (a sequence fails after STEP_ATTEMPTS failed steps).
        if kind is not None and kind not in failed:
            failed.append(kind)
            raise RuntimeError(OOM)
        return out

    monkeypatch.setattr(ModelRunner, "forward", forward)
    core = EngineCore(loaded, engine_config(speculative=LOOKUP))
    for r in _requests(loaded.model.args.vocab_size):
        core.add_request(*r)
    res = run_to_end(core, recover=True)
    assert {k: (v["ids"][0], v["finish"][0]) for k, v in res.items()} == plain
    assert sorted(failed) == ["replay", "verify"]
    stats = core.stats()
    assert stats["failed_steps_out_of_memory"] == 2
    assert stats["blocks_free"] == stats["blocks_total"]


@pytest.mark.parametrize("draft", ["small", "rope", "self", "dense"])
def test_greedy_identical_with_a_draft_model(tiny_models, draft: str) -> None:
    """A hybrid target's drafts: hybrids (their own state rolled back to their last kept
    proposal), the target itself, a dense model."""
    target = tiny_models("qwen3_next")
    loaded = loaded_model(target)
    plain, _ = _run(loaded, None)
    drafts = {**_hybrid_drafts(tiny_models), "self": target}
    path = drafts.get(draft) or tiny_models("llama", num_hidden_layers=1)
    spec, stats = _run(loaded, _draft(path))
    assert spec == plain
    drafted, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert drafted > 0
    if draft == "self":
        # Only the penalised request's proposals (drawn without its penalties on the
        # step's earlier proposals) may be refused.
        assert kept >= 0.8 * drafted
        assert stats[f"spec_decode_num_accepted_tokens_pos{K - 1}"] > 0
    else:
        # The dense draft (another architecture) never agrees: every proposal refused.
        assert (0 < kept or draft == "dense") and kept < drafted
        assert stats["spec_decode_num_replays"] > 0


def _state_matches(model, ids: list[int], state: list) -> None:
    """`state` (a `Sequence.recurrent`) is what running `model` over `ids` in one call
    leaves in its recurrent layers."""
    cache = make_prompt_cache(model)
    model(mx.array([ids]), cache=cache)
    layers = [i for i, c in enumerate(cache) if isinstance(c, ArraysCache)]
    assert layers
    for i in layers:
        for want, got in zip(cache[i].cache, as_arrays(state[i])):
            assert np.allclose(np.array(got), np.array(want), atol=1e-4, rtol=1e-3)


def test_states_after_each_verdict_are_those_of_the_kept_tokens(tiny_models, monkeypatch) -> None:
    """After every speculative step, each sequence's recurrent state, and its hybrid
    draft's, are what a fresh run over exactly its kept tokens leaves."""
    loaded = loaded_model(tiny_models("qwen3_next"))
    draft_path = _hybrid_drafts(tiny_models)["rope"]
    draft_model = loaded_model(draft_path).model
    seen: dict[str, list[int]] = {"target": [], "draft": []}
    real_step, real_settle = Speculator.step, DraftModel.settle

    def step(self, core, sched):
        verifying = [it.seq for it in sched.decodes if it.draft]
        outs = real_step(self, core, sched)
        for seq in verifying:
            if seq.finish_reason is None and len(seen["target"]) < 40:
                _state_matches(loaded.model, seq.ids(0, seq.num_computed), seq.recurrent)
                seen["target"].append(seq.num_computed)
        return outs

    def settle(self, seq_id, kept):
        ds = self.seqs.get(seq_id)
        k = ds.k if ds is not None else 0
        real_settle(self, seq_id, kept)
        if k and len(seen["draft"]) < 40:
            _state_matches(draft_model, ds.ids(0, ds.computed), ds.recurrent)
            seen["draft"].append(min(kept, k - 1))

    monkeypatch.setattr(Speculator, "step", step)
    monkeypatch.setattr(DraftModel, "settle", settle)
    _run(loaded, _draft(draft_path))
    assert len(seen["target"]) == len(seen["draft"]) == 40
    # Drafts rolled back to the start, part way, and not at all.
    assert {0, 1, K - 1} <= set(seen["draft"])


def _exact(model, prompt: list[int], temp: float, top_k: int, n: int) -> dict[tuple, float]:
    """The target's exact joint distribution of its next `n` tokens at top_k."""

    def dist(ctx: list[int]) -> dict[int, float]:
        logits = np.array(model(mx.array([ctx]))[0, -1].astype(mx.float32)) / temp
        top = np.argsort(-logits)[:top_k]
        return dict(zip(top.tolist(), _softmax(logits[top]).tolist()))

    exact: dict[tuple, float] = {(): 1.0}
    for _ in range(n):
        exact = {
            c + (t,): p * pt for c, p in exact.items() for t, pt in dist(prompt + list(c)).items()
        }
    return exact


@pytest.mark.parametrize("method", ["ngram", "hybrid_draft"])
def test_sampled_tokens_follow_the_target_distribution(
    tiny_models, monkeypatch, method: str
) -> None:
    """Three tokens at top_k=3 from many sequences, the later ones verifying proposals
    (random ones of the likely tokens, or a hybrid draft's): their joint frequencies
    match the hybrid target's exact joint distribution."""
    loaded = loaded_model(tiny_models("qwen3_next"))
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=21)[0][:8]
    temp, top_k, N = 0.7, 3, 1000
    exact = _exact(loaded.model, prompt, temp, top_k, 3)
    if method == "ngram":
        rng = random.Random(0)

        def propose(ids, k, n_max, n_min):
            # Tokens the target may well produce, now and then one it never does.
            out = tuple(ids[len(prompt) :])
            draft: list[int] = []
            for _ in range(k):
                ctx = out + tuple(draft)
                options = sorted({c[len(ctx)] for c in exact if c[: len(ctx)] == ctx})
                draft.append(rng.choice(options) if rng.random() < 0.9 else 5)
            return draft

        monkeypatch.setattr(speculative, "propose_ngram", propose)
        cfg = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=100_000)
    else:
        cfg = _draft(_hybrid_drafts(tiny_models)["rope"], k=2, disable_by_batch_size=100_000)
    mx.random.seed(11)
    params = SamplingParams(max_tokens=3, temperature=temp, top_k=top_k, n=N, ignore_eos=True)
    res, stats = _sample_many(loaded, cfg, prompt, params)
    assert stats["spec_decode_num_drafts"] >= N // 2
    drafted, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert 0 < kept < drafted and stats["spec_decode_num_replays"] > 0
    observed = Counter(tuple(v) for v in res.values())
    ok, stat, limit = _chi2_ok(observed, exact, N)
    assert ok, (stat, limit)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_hybrid_family_speculates_exactly(tiny_models, monkeypatch, family: str) -> None:
    """Every recurrent family mlx-lm ships, greedy with proposals kept and refused, beside
    a row that does not speculate. Where the family's recurrent layers would take a
    row's padding into its state (Nemotron-H, Jamba, Mamba), each call holds rows of one
    length; those also run with themselves as draft (catch-ups of one length a call)."""
    loaded = loaded_model(get_tiny_hybrid(family))  # in `tiny_models`' folder
    prompts = random_prompts(300, 3, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (24, 17, 20)]

    def run(spec: SpeculativeConfig | None) -> tuple[dict, dict, EngineCore]:
        core = EngineCore(loaded, engine_config(speculative=spec))
        for i, (p, sp) in enumerate(zip(prompts, params)):
            core.add_request(f"g{i}", p, sp)
        core.add_request("seeded", prompts[0], SamplingParams(max_tokens=12, seed=3))
        res = {k: v["ids"][0] for k, v in run_to_end(core).items()}
        stats = core.stats()
        assert stats["blocks_free"] == stats["blocks_total"]
        return res, stats, core

    plain, _, core = run(None)
    _oracle(monkeypatch, [p + plain[f"g{i}"] for i, p in enumerate(prompts)])
    spec, stats, _ = run(LOOKUP)
    assert spec == plain
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert stats["spec_decode_num_replays"] > 0
    if not core.runner.masks_padding:
        spec, stats, _ = run(_draft(Path(loaded.source), k=3))
        assert spec == plain
        assert stats["spec_decode_num_accepted_tokens"] > 0
