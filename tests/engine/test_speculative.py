"""Speculative decoding (prompt lookup): exact for greedy and sampled requests, KV blocks
given back after rejections, acceptance counted. Hybrid (recurrent) models:
test_hybrid_speculation.py."""

from __future__ import annotations

import math
import random
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from support.engine_runs import engine_config, loaded_model, random_prompts, run_to_end

from pippin.engine import speculative
from pippin.engine.config import SpeculativeConfig
from pippin.engine.core import EngineCore
from pippin.engine.rejection import judge, walk
from pippin.engine.speculative import propose_ngram
from pippin.engine.types import SamplingParams

SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


def _sample_many(
    loaded: object, cfg: SpeculativeConfig, prompt: list[int], params: SamplingParams
) -> tuple[dict, dict[str, int]]:
    """`params.n` samples of `prompt` in one request, with `cfg`'s speculation: the ids of
    each, and the engine's stats after."""
    core = EngineCore(
        loaded,
        engine_config(
            speculative=cfg,
            num_blocks=6000,
            block_size=16,
            max_num_seqs=params.n,
            max_num_batched_tokens=8192,
        ),
    )
    core.add_request("many", prompt, params)
    return run_to_end(core)["many"]["ids"], core.stats()


def _chi2_ok(observed: dict, expected: dict[tuple, float], n: int) -> tuple[bool, float, float]:
    """Pearson's chi-square of `observed` counts against probabilities `expected`, at a
    significance of 1e-4 (Wilson-Hilferty's quantile); any count outside the support
    fails."""
    if set(observed) - set(expected):
        return False, math.inf, 0.0
    stat = sum((observed.get(c, 0) - n * p) ** 2 / (n * p) for c, p in expected.items())
    df = len(expected) - 1
    z = 3.719  # the standard normal's 1 - 1e-4 quantile
    limit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < limit, stat, limit


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    ids = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # "2 3" occurred twice before the end; the latest is followed by 7 8 5.
    assert propose_ngram(ids, 3, n_max=2, n_min=1) == [7, 8, 5]
    assert propose_ngram(ids, 10, n_max=2, n_min=1) == [7, 8, 5, 2, 3]
    assert propose_ngram([4, 5, 6], 3, n_max=3, n_min=1) == []
    assert propose_ngram([4, 5, 6, 4], 3, n_max=3, n_min=2) == []
    assert propose_ngram([4, 5, 6, 4], 3, n_max=3, n_min=1) == [5, 6, 4]


def test_config_parses_vllm_keys_and_rejects_the_rest() -> None:
    cfg = SpeculativeConfig.parse(
        '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2, "disable_by_batch_size": 3}'
    )
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.disable_by_batch_size) == (
        5,
        2,
        3,
    )
    for bad, words in [
        ("nope", "not JSON"),
        ('{"method": "eagle"}', "not supported"),
        ('{"method": "draft_model"}', 'needs "model"'),
        ('{"num_speculative_tokens": 0}', ">= 1"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min"),
        ('{"lookahead": 3}', "unknown keys"),
    ]:
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


@pytest.mark.parametrize("with_q", [False, True])
def test_rejection_sampler_emits_the_target_distribution(with_q: bool) -> None:
    mx.random.seed(3)
    V, R = 6, 40_000
    target = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 0.3], np.float32)
    p = _softmax(target)
    draft = np.random.default_rng(0).integers(0, V, R)
    q = None
    if with_q:
        # A draft model's distribution, which drew the proposals.
        q_row = _softmax(np.array([0.0, 2.0, 0.0, 1.0, 0.0, -2.0], np.float32))
        draft = np.random.default_rng(1).choice(V, R, p=q_row)
        q = mx.broadcast_to(mx.array(q_row)[None], (R, V))
    x = mx.broadcast_to(mx.array(target)[None], (R, V))
    v = judge(x, mx.zeros((R,), mx.bool_), mx.array(draft, mx.int32), q)
    kept, resid = np.array(v.kept), np.array(v.residual)
    first = np.where(kept, draft, resid)
    counts = dict(zip(*np.unique(first, return_counts=True)))
    ok, stat, limit = _chi2_ok(
        {(int(k),): int(c) for k, c in counts.items()}, {(i,): p[i] for i in range(V)}, R
    )
    assert ok, (stat, limit, counts)
    # Plain draws (the bonus token) follow p too.
    counts = dict(zip(*np.unique(np.array(v.plain), return_counts=True)))
    ok, stat, limit = _chi2_ok(
        {(int(k),): int(c) for k, c in counts.items()}, {(i,): p[i] for i in range(V)}, R
    )
    assert ok, (stat, limit)

    # Greedy rows keep exactly the argmax.
    g = judge(x[:V], mx.ones((V,), mx.bool_), mx.arange(V, dtype=mx.int32))
    assert np.array(g.kept).tolist() == [True] + [False] * (V - 1)
    assert set(np.array(g.residual).tolist()) == {0}
    assert walk([True, False], [9, 4], [1, 2, 3], [7, 8]) == [7, 4]
    assert walk([True, True], [9, 9], [1, 2, 3], [7, 8]) == [7, 8, 3]


def _repeating_prompt(vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(12)]
    return base * 4


def test_greedy_identical_alone_and_batched_with_others(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    vocab = loaded.model.args.vocab_size
    prompts = [_repeating_prompt(vocab, s) for s in range(3)] + random_prompts(vocab, 3, seed=4)
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    others = [
        # Penalties, bias and min_tokens are applied per verified position; logprobs too.
        SamplingParams(
            max_tokens=40,
            temperature=0.0,
            repetition_penalty=1.2,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            logit_bias={40: 2.0, 41: -5.0},
            min_tokens=30,
            logprobs=True,
            top_logprobs=2,
        ),
        # Seeded and sampled: speculation is off for it, its tokens are the same.
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=70, temperature=0.0, stop_token_ids=[407, 626, 545]),
    ]

    def run(spec: SpeculativeConfig | None, batched: bool) -> tuple[dict, dict]:
        core = EngineCore(loaded, engine_config(speculative=spec))
        res: dict = {}
        logprobs: dict[str, list] = {}
        reqs = [(f"g{i}", p, greedy) for i, p in enumerate(prompts)]
        reqs += [(f"o{i}", prompts[i], o) for i, o in enumerate(others)]
        if batched:
            for rid, p, params in reqs:
                core.add_request(rid, p, params)
            batches = [reqs]
        else:
            batches = [[r] for r in reqs]
        for batch in batches:
            if not batched:
                core.add_request(*batch[0])
            while core.has_work():
                for out in core.step():
                    r = res.setdefault(out.request_id, {"ids": [], "finish": None})
                    c = out.outputs[0]
                    r["ids"] += c.token_ids
                    r["finish"] = r["finish"] or c.finish_reason
                    logprobs.setdefault(out.request_id, []).extend(c.logprobs or [])
        stats = core.stats()
        assert stats["blocks_free"] == stats["blocks_total"]
        return res, {"stats": stats, "logprobs": logprobs}

    for batched in (False, True):
        plain, _ = run(None, batched)
        spec, extra = run(SPEC, batched)
        assert spec == plain, batched
        stats = extra["stats"]
        assert stats["spec_decode_num_drafts"] > 0
        assert 0 < stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
        assert (
            stats["spec_decode_num_accepted_tokens_pos0"]
            >= stats["spec_decode_num_accepted_tokens_pos1"]
        )
        lps = extra["logprobs"]["o0"]
        assert [lp.token_id for lp in lps] == spec["o0"]["ids"]
        for lp in lps:
            assert len(lp.top) == 2 and lp.top[0][0] == lp.token_id
            assert abs(lp.top[0][1] - lp.logprob) < 1e-5
    assert len(spec["o0"]["ids"]) >= 30  # min_tokens held EOS off


def test_blocks_freed_and_prefix_cache_only_has_kept_tokens(tiny_models, monkeypatch) -> None:
    # A proposal at every step (the last token again where lookup finds none): most are
    # refused, so blocks are taken for them and given back all the time.
    def propose(ids, k, n_max, n_min):
        return propose_ngram(ids, k, n_max, n_min) or [ids[-1]] * k

    monkeypatch.setattr(speculative, "propose_ngram", propose)
    loaded = loaded_model(tiny_models("qwen3"))
    prompt = _repeating_prompt(loaded.model.args.vocab_size, 7)
    greedy = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    core = EngineCore(loaded, engine_config(speculative=SPEC, block_size=4))
    core.add_request("a", prompt, greedy)
    first = run_to_end(core)["a"]["ids"][0]
    stats = core.stats()
    assert stats["blocks_free"] == stats["blocks_total"]
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"]
    # The whole output again as a prompt: every cached block holds what was generated.
    full = prompt + first
    cached, _ = core.bm.match_prefix(full)
    for i, bid in enumerate(cached):
        assert core.bm.blocks[bid].token_ids == tuple(full[i * 4 : (i + 1) * 4])
    core.add_request("b", full, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    res = run_to_end(core)["b"]
    assert res["cached"] >= len(prompt)
    no_spec = EngineCore(loaded, engine_config(block_size=4))
    no_spec.add_request("b", full, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert run_to_end(no_spec)["b"]["ids"] == res["ids"]


def test_speculation_off_above_the_batch_threshold(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    prompt = _repeating_prompt(loaded.model.args.vocab_size, 1)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    cfg = SpeculativeConfig(prompt_lookup_min=1, disable_by_batch_size=2)
    core = EngineCore(loaded, engine_config(speculative=cfg))
    for i in range(3):
        core.add_request(f"r{i}", prompt, greedy)
    run_to_end(core)
    assert core.stats()["spec_decode_num_drafts"] == 0
    core.add_request("alone", prompt, greedy)
    run_to_end(core)
    assert core.stats()["spec_decode_num_drafts"] > 0


def test_sampled_tokens_follow_the_target_distribution(tiny_models, monkeypatch) -> None:
    """Three tokens at top_k=3 from many sequences, each later step verifying random
    proposals: their joint frequencies match the model's exact joint distribution."""
    loaded = loaded_model(tiny_models("llama"))
    model = loaded.model
    prompt = random_prompts(model.args.vocab_size, 1, seed=21)[0][:20]
    temp, top_k, N = 0.7, 3, 2000

    def dist(ctx: list[int]) -> dict[int, float]:
        logits = np.array(model(mx.array([ctx]))[0, -1].astype(mx.float32)) / temp
        top = np.argsort(-logits)[:top_k]
        return dict(zip(top.tolist(), _softmax(logits[top]).tolist()))

    exact: dict[tuple, float] = {}
    top: dict[tuple, list[int]] = {}  # the tokens each context may continue with
    for t1, p1 in dist(prompt).items():
        d2 = dist(prompt + [t1])
        top[(t1,)] = list(d2)
        for t2, p2 in d2.items():
            d3 = dist(prompt + [t1, t2])
            top[(t1, t2)] = list(d3)
            for t3, p3 in d3.items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
    rng = random.Random(0)

    def propose(ids, k, n_max, n_min):
        # Tokens the target may well produce (kept or refused by chance), now and then
        # one it never does (always refused).
        out = ids[len(prompt) :]
        draft = []
        for _ in range(k):
            options = top.get(tuple(out + draft), [5])
            # The least likely of the three most often: a sampler that keeps too many
            # proposals would show it.
            u = rng.random()
            draft.append(options[-1] if u < 0.5 else rng.choice(options) if u < 0.9 else 5)
        return draft

    monkeypatch.setattr(speculative, "propose_ngram", propose)
    mx.random.seed(11)
    cfg = SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=100_000)
    params = SamplingParams(max_tokens=3, temperature=temp, top_k=top_k, n=N, ignore_eos=True)
    res, stats = _sample_many(loaded, cfg, prompt, params)
    assert stats["spec_decode_num_drafts"] >= N
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    observed = Counter(tuple(v) for v in res.values())
    ok, stat, limit = _chi2_ok(observed, exact, N)
    assert ok, (stat, limit)


def test_lookups_back_off_while_they_find_nothing(tiny_models, monkeypatch) -> None:
    """A stream whose lookups find nothing is looked up again after 1, 2, 4, 8, 8 ...
    steps, so most of its steps keep the overlap of host and device work."""
    loaded = loaded_model(tiny_models("llama"))
    calls = []
    prompt = _repeating_prompt(loaded.model.args.vocab_size, 8)
    quiet = len(prompt) + 60  # no proposal before the output's 60th token

    def propose(ids, k, n_max, n_min):
        calls.append(len(ids))
        return [] if len(ids) < quiet else [ids[-1]]

    monkeypatch.setattr(speculative, "propose_ngram", propose)
    core = EngineCore(loaded, engine_config(speculative=SPEC))
    core.add_request("a", prompt, SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True))
    run_to_end(core)
    misses = [n for n in calls if n < quiet]
    # 60 tokens without a match: tries at +1, +2, +4, +8, +8, ... steps.
    assert 5 <= len(misses) <= 12, misses
    # Once proposals come, every step looks up again.
    found = [n for n in calls if n >= quiet]
    assert len(found) >= 10 and core.stats()["spec_decode_num_drafts"] == len(found)
