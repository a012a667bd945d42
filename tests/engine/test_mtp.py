"""Speculative decoding with a checkpoint's multi-token-prediction (MTP) layers: the head
loaded from the checkpoint's `mtp.*` tensors computes the reference's logits; exact for
greedy and sampled requests, batched with rows that do not speculate, on a hybrid
target (qwen3_next); the head's KV rolled back and freed; checkpoints without MTP
layers refused at startup."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from support.engine_runs import (
    OOM,
    beside_speculation,
    engine_config,
    faulty_forward,
    loaded_model,
    random_prompts,
    run_to_end,
)
from support.tiny_mtp import MAIN, MTP, build_tiny_mtp, build_tiny_nextn_mtp, nextn_layer_class
from test_speculative import _chi2_ok, _sample_many, _softmax

from pippin.engine.config import SpeculativeConfig
from pippin.engine.core import EngineCore
from pippin.engine.mtp import MtpProposer
from pippin.engine.types import SamplingParams
from pippin.runner import mtp_head
from pippin.store.loaded import LoadedModel, ModelLoadError
from pippin.store.loader import read_json
from pippin.store.mtp_weights import NoMtpWeightsError

K = 3


def _spec(k: int = K, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="mtp", num_speculative_tokens=k, **kw)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_mtp(tmp_path_factory.mktemp("mtp") / "qwen3_next_mtp")


@pytest.fixture(scope="module")
def target(mtp_dir: Path) -> LoadedModel:
    return loaded_model(mtp_dir)


_NEXTN: dict[str, Path] = {}


def _nextn_dir(tmp_path_factory: pytest.TempPathFactory, family: str) -> Path:
    if family not in _NEXTN:
        dest = tmp_path_factory.mktemp("mtp") / f"{family}_mtp"
        _NEXTN[family] = build_tiny_nextn_mtp(dest, family)
    return _NEXTN[family]


def _nextn(tmp_path_factory: pytest.TempPathFactory, family: str) -> LoadedModel:
    """A tiny `family` with DeepSeek-V3's MTP layout, loaded as `loaded_model` does, but
    for mlx-lm 0.32's deepseek_v3 keeping the MTP layer of a model of other than 61
    layers (see `build_tiny_nextn_mtp`)."""
    from mlx_lm.utils import load_model, load_tokenizer

    path = _nextn_dir(tmp_path_factory, family)
    if family != "deepseek_v3":
        return loaded_model(path)
    model, config = load_model(path, strict=False)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        source=str(path),
        name=path.name,
        eos_token_ids=set(tokenizer.eos_token_ids),
    )


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return _nextn(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return _nextn(tmp_path_factory, "glm4_moe")


def test_config_takes_vllm_mtp_spellings() -> None:
    for method in ("mtp", "qwen3_next_mtp", "deepseek_mtp"):
        cfg = SpeculativeConfig.parse(f'{{"method": "{method}", "num_speculative_tokens": 2}}')
        assert (cfg.method, cfg.num_speculative_tokens) == ("mtp", 2)
    with pytest.raises(ValueError, match="is for method 'draft_model'"):
        SpeculativeConfig.parse('{"method": "mtp", "model": "/m"}')


def _reference_logits(folder: Path, tokens: list[int], hidden: np.ndarray) -> np.ndarray:
    """The MTP formula in torch over the checkpoint's own tensors, its decoder layer
    transformers' `Qwen3NextDecoderLayer`: logits for tok[t + 2] at each t, from
    tok[t + 1] = `tokens[t]` and the target's hidden state `hidden[t]`."""
    import torch
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    raw = {
        k: torch.tensor(np.array(v))
        for f in (MAIN, MTP)
        for k, v in mx.load(str(folder / f)).items()
    }
    config = json.loads((folder / "config.json").read_text())
    cfg = Qwen3NextConfig(**config)
    cfg._attn_implementation = "eager"
    idx = cfg.full_attention_interval - 1
    layer = hf.Qwen3NextDecoderLayer(cfg, idx).eval()
    own = {k[len("mtp.layers.0.") :]: v for k, v in raw.items() if k.startswith("mtp.layers.0.")}
    E = cfg.num_experts
    state = {k: v for k, v in own.items() if ".experts." not in k}
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat(
                [own[f"mlp.experts.{e}.gate_proj.weight"], own[f"mlp.experts.{e}.up_proj.weight"]]
            )
            for e in range(E)
        ]
    )
    state["mlp.experts.down_proj"] = torch.stack(
        [own[f"mlp.experts.{e}.down_proj.weight"] for e in range(E)]
    )
    layer.load_state_dict(state, strict=True)

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:  # zero-centred, as stored
        w = raw[f"mtp.{name}.weight"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * (1 + w)

    with torch.no_grad():
        L = len(tokens)
        e = raw["model.embed_tokens.weight"][torch.tensor(tokens)][None]
        h = torch.tensor(hidden)[None]
        x = torch.cat([norm(e, "pre_fc_norm_embedding"), norm(h, "pre_fc_norm_hidden")], -1)
        x = x @ raw["mtp.fc.weight"].T
        cos, sin = hf.Qwen3NextRotaryEmbedding(cfg)(x, torch.arange(L)[None])
        mask = torch.full((L, L), float("-inf")).triu(1)[None, None]
        y = layer(x, position_embeddings=(cos, sin), attention_mask=mask)
        return (norm(y, "norm") @ raw["lm_head.weight"].T)[0].numpy()


def test_head_computes_the_mtp_formula(mtp_dir: Path, target: LoadedModel) -> None:
    """The head loaded from the checkpoint (renamed, experts stacked, norms shifted)
    gives the logits of the formula over the stored tensors."""
    head = mtp_head.load(target.model, mtp_dir, {})
    tokens = random_prompts(target.model.args.vocab_size, 1, seed=2)[0][:12]
    hidden = target.model.model(mx.array([tokens]))[0]
    got = head(mx.array([tokens[1:]]), cache=head.make_cache(), hidden=hidden[None, :-1])
    want = _reference_logits(mtp_dir, tokens[1:], np.array(hidden[:-1]))
    np.testing.assert_allclose(np.array(got[0]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_nextn_head_computes_the_mtp_formula(tmp_path_factory, family: str) -> None:
    """DeepSeek-V3's layout (layer N of `model.layers`: experts one by one, DeepSeek's
    `kv_b_proj` whole, `eh_proj`, `enorm`, `hnorm`, `shared_head`) loads into the head
    that computes the formula with mlx-lm's own layer over the arrays it was made from."""
    from mlx_lm.models.base import create_attention_mask

    loaded = _nextn(tmp_path_factory, family)
    folder = _nextn_dir(tmp_path_factory, family)
    model = loaded.model
    head = mtp_head.load(model, folder, read_json(folder / "config.json"))
    tokens = random_prompts(model.args.vocab_size, 1, seed=2)[0][:12]
    hidden = model.model(mx.array([tokens]))[0]
    got = head(mx.array([tokens[1:]]), cache=head.make_cache(), hidden=hidden[None, :-1])

    ref = mx.load(str(folder / "mtp_reference.safetensors"))
    layer = nextn_layer_class(family)(model.args, model.args.num_hidden_layers)
    layer.load_weights(
        [(k, v) for k, v in ref.items() if k.startswith(("self_attn.", "mlp.", "input_", "post_"))]
    )
    eps = model.args.rms_norm_eps

    def norm(x: mx.array, name: str) -> mx.array:
        return mx.fast.rms_norm(x, ref[f"{name}.weight"], eps)

    e = ref["embed_tokens.weight"][mx.array(tokens[1:])][None]
    x = mx.concatenate([norm(e, "enorm"), norm(hidden[None, :-1], "hnorm")], axis=-1)
    x = x @ ref["eh_proj.weight"].T
    y = layer(x, create_attention_mask(x, None, return_array=family == "deepseek_v3"))
    want = norm(y, "shared_head.norm") @ ref["shared_head.head.weight"].T
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_checkpoints_without_mtp_layers_refused(tmp_path: Path, tiny_models) -> None:
    bare = build_tiny_mtp(tmp_path / "bare", mtp=False)
    with pytest.raises(NoMtpWeightsError, match="mlx-lm conversions .* drop them"):
        EngineCore(loaded_model(bare), engine_config(speculative=_spec()))
    with pytest.raises(ModelLoadError, match="runs the MTP layers of"):
        EngineCore(loaded_model(tiny_models("llama")), engine_config(speculative=_spec()))


def _requests(vocab: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Greedy requests of different lengths, with ones that do not speculate (seeded),
    penalties, bias, min_tokens and logprobs, and stop tokens."""
    prompts = random_prompts(vocab, 7, seed=9)
    greedy = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (30, 23, 37)]
    params = greedy + beside_speculation()
    return [(f"r{i}", prompts[i], p) for i, p in enumerate(params)]


def _run(
    loaded: LoadedModel, spec: SpeculativeConfig | None, **kw
) -> tuple[dict, dict, EngineCore]:
    core = EngineCore(loaded, engine_config(speculative=spec, **kw))
    for r in _requests(loaded.model.args.vocab_size):
        core.add_request(*r)
    res = run_to_end(core)
    stats = core.stats()
    assert stats["blocks_free"] == stats["blocks_total"]
    if spec is not None:
        assert stats["spec_draft_blocks_free"] == stats["spec_draft_blocks_total"]
        assert not core.spec.draft.seqs
    return {k: (v["ids"][0], v["finish"][0]) for k, v in res.items()}, stats, core


def _oracle(monkeypatch, full: dict[str, list[int]], seed: int = 0) -> None:
    """Make the head's draws for greedy rows the sequences' true next tokens (`full`:
    each request's prompt and output without speculation), one of them changed
    at a random place now and then: proposals are then kept up to every position."""
    rng = random.Random(seed)
    real = MtpProposer._draw
    made: dict[tuple[int, int], list[int]] = {}  # (seq, length) -> this step's draws

    def draw(self, logits, seqs):
        tokens, q = real(self, logits, seqs)
        out = tokens.tolist()
        for r, seq in enumerate(seqs):
            f = next((f for f in full.values() if f[: seq.num_tokens] == seq.all_ids), None)
            if seq.params.temperature > 0 or f is None:
                continue
            drawn = made.setdefault((seq.seq_id, seq.num_tokens), [])
            at = seq.num_tokens + len(drawn)
            t = f[at] if at < len(f) else out[r]
            if rng.random() < 0.15:
                t = 3 + (t + 1) % 300
            drawn.append(t)
            out[r] = t
        return mx.array(out, dtype=mx.int32), q

    monkeypatch.setattr(MtpProposer, "_draw", draw)


@pytest.mark.parametrize("family", ["target", "deepseek", "glm"])
@pytest.mark.parametrize("proposals", ["head", "oracle"])
def test_greedy_identical_with_mtp(request, monkeypatch, family: str, proposals: str) -> None:
    """The head's own proposals (random weights: nearly all refused) and true ones
    (mostly kept) leave every output as without speculation, on a hybrid target
    (qwen3_next: refused proposals' recurrent state rolled back) and attention-only ones
    (deepseek_v3, glm4_moe: their decode steps otherwise take the compiled graph)."""
    target = request.getfixturevalue(family)
    plain, _, _ = _run(target, None)
    if proposals == "oracle":
        reqs = _requests(target.model.args.vocab_size)
        _oracle(monkeypatch, {rid: p + plain[rid][0] for rid, p, _ in reqs})
    spec, stats, _ = _run(target, _spec())
    assert spec == plain
    drafted, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert stats["spec_decode_num_drafts"] > 0
    # Every position's hidden state was seen and consumed in order.
    assert stats["spec_mtp_restarts"] == 0
    if proposals == "oracle":
        assert 0.5 * drafted < kept < drafted
        assert stats[f"spec_decode_num_accepted_tokens_pos{K - 1}"] > 0


def _exact(model, prompt: list[int], temp: float, top_k: int, n: int) -> dict[tuple, float]:
    """The target's exact joint distribution of its next `n` tokens at `temp`, `top_k`."""

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


def _near_target(monkeypatch, model) -> None:
    """Make the head's logits the target's own for each row's context (its proposals of
    this step included) plus a fixed noise per context: q near p, so proposals are kept
    and refused."""
    real = MtpProposer._draw
    made: dict[tuple[int, int], list[int]] = {}
    cache: dict[tuple[int, ...], mx.array] = {}

    def logits_for(ctx: tuple[int, ...]) -> mx.array:
        if ctx not in cache:
            x = model(mx.array([list(ctx)]))[0, -1]
            noise = np.random.default_rng(len(cache)).standard_normal(x.shape[-1])
            cache[ctx] = x + mx.array(noise.astype(np.float32))
        return cache[ctx]

    def draw(self, logits, seqs):
        drafts = [made.setdefault((s.seq_id, s.num_tokens), []) for s in seqs]
        rows = [logits_for(tuple(s.all_ids + d)) for s, d in zip(seqs, drafts)]
        tokens, q = real(self, mx.stack(rows).astype(logits.dtype), seqs)
        for d, t in zip(drafts, tokens.tolist()):
            d.append(t)
        return tokens, q

    monkeypatch.setattr(MtpProposer, "_draw", draw)


@pytest.mark.parametrize("proposals", ["head", "near"])
def test_sampled_tokens_follow_the_target_distribution(
    target: LoadedModel, monkeypatch, proposals: str
) -> None:
    """Four tokens at top_k=2 from many sequences, the last three from a step verifying
    two of the head's proposals (its own q, or one near the target's): their joint
    frequencies match the target's exact joint distribution."""
    model = target.model
    prompt = random_prompts(model.args.vocab_size, 1, seed=21)[0][:8]
    temp, top_k, N = 0.7, 2, 1000
    exact = _exact(model, prompt, temp, top_k, 4)
    if proposals == "near":
        _near_target(monkeypatch, model)
    mx.random.seed(11)
    cfg = _spec(k=2, disable_by_batch_size=100_000)
    params = SamplingParams(max_tokens=4, temperature=temp, top_k=top_k, n=N, ignore_eos=True)
    res, stats = _sample_many(target, cfg, prompt, params)
    assert stats["spec_decode_num_drafts"] >= N // 2
    drafted, kept = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    if proposals == "near":
        assert 0.2 * drafted < kept < drafted and stats["spec_decode_num_replays"] > 0
        assert stats["spec_decode_num_accepted_tokens_pos1"] > 0
    assert stats["spec_draft_blocks_free"] == stats["spec_draft_blocks_total"]
    observed = Counter(tuple(v) for v in res.values())
    ok, stat, limit = _chi2_ok(observed, exact, N)
    assert ok, (stat, limit)


def _plain_full(target: LoadedModel) -> dict[str, list[int]]:
    plain, _, _ = _run(target, None)
    reqs = _requests(target.model.args.vocab_size)
    return {rid: p + plain[rid][0] for rid, p, _ in reqs}


def test_head_kv_is_that_of_the_kept_tokens(target: LoadedModel, monkeypatch) -> None:
    """After every verdict, the head's KV is what a fresh head run computes over the
    sequence's kept tokens and the target's hidden states of them: refused proposals
    and the positions it fed itself left nothing behind."""
    _oracle(monkeypatch, _plain_full(target))
    core = EngineCore(target, engine_config(speculative=_spec()))
    for r in _requests(target.model.args.vocab_size):
        core.add_request(*r)
    mtp = core.spec.draft
    head = mtp.runner.model
    checked = 0
    while core.has_work():
        core.step()
        for ms in list(mtp.seqs.values()):
            if ms.k or ms.computed < 2 or ms.source.finished or core.steps % 3:
                continue
            n = ms.origin + ms.computed
            ids = ms.source.all_ids
            hidden = target.model.model(mx.array([ids[:n]]))[0, ms.origin :]
            cache = head.make_cache()
            head(mx.array([ids[ms.origin + 1 : n + 1]]), cache=cache, hidden=hidden[None])
            c = cache[0]
            keys, values = c.keys[..., : c.offset, :], c.values[..., : c.offset, :]
            pool_keys, pool_values = mtp.runner.read_blocks(ms.table.block_ids)
            for got, want in ((pool_keys, keys), (pool_values, values)):
                np.testing.assert_allclose(
                    np.array(got[:, : ms.computed]), np.array(want[0]), rtol=1e-3, atol=1e-4
                )
            checked += 1
    assert checked >= 5 and core.stats()["spec_decode_num_accepted_tokens"] > 0


def test_nothing_held_above_the_batch_threshold(target: LoadedModel) -> None:
    """While more sequences run than may speculate, the head holds no hidden states;
    once few enough run, each starts its head over where it is. Outputs stay those of
    plain decoding."""
    vocab = target.model.args.vocab_size
    reqs = [
        (f"r{i}", p, SamplingParams(max_tokens=8 + 12 * i, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(random_prompts(vocab, 3, seed=2))
    ]

    def run(spec: SpeculativeConfig | None) -> tuple[dict, EngineCore]:
        core = EngineCore(target, engine_config(speculative=spec))
        for r in reqs:
            core.add_request(*r)
        out: dict[str, list[int]] = {}
        while core.has_work():
            three = len(core.scheduler.running) == 3
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.outputs[0].token_ids)
            if spec is not None and three:  # a step that may not speculate: nothing held
                assert not core.spec.draft.seqs
        return out, core

    plain, _ = run(None)
    got, core = run(_spec(disable_by_batch_size=2))
    assert got == plain
    stats = core.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_mtp_restarts"] > 0
    assert stats["spec_draft_blocks_free"] == stats["spec_draft_blocks_total"]


def test_failed_steps_recovered_with_the_head_pool_made_anew(
    target: LoadedModel, monkeypatch
) -> None:
    """Model calls (the target's or the head's) that run the device out of memory: the
    head's KV and held hidden states are dropped with its pool made anew, and every
    request ends as without the failures."""
    vocab = target.model.args.vocab_size
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    prompts = random_prompts(vocab, 4, seed=9)

    def run(core: EngineCore) -> dict:
        for i, p in enumerate(prompts):
            core.add_request(f"g{i}", p, greedy)
        return {k: v["ids"][0] for k, v in run_to_end(core, recover=True).items()}

    want = run(EngineCore(target, engine_config()))
    core = EngineCore(target, engine_config(speculative=_spec()))
    head_calls: list[int] = []
    real = MtpProposer._call

    def spy(self, items, ids, drawn, last):
        head_calls.append(calls["n"] + 1)
        return real(self, items, ids, drawn, last)

    calls = {"n": 0}

    def fail(n: int, _: list[str]) -> str | None:
        calls["n"] = n
        return OOM if n in (12, 31) else None

    monkeypatch.setattr(MtpProposer, "_call", spy)
    faulty_forward(monkeypatch, fail)
    assert run(core) == want
    stats = core.stats()
    assert stats["failed_steps_out_of_memory"] == 2
    assert {12, 31} & set(head_calls)  # a head call among the failed ones
    assert stats["spec_draft_blocks_free"] == stats["spec_draft_blocks_total"]
    assert stats["blocks_free"] == stats["blocks_total"] and not core.spec.draft.seqs


def test_greedy_identical_with_catch_ups_in_chunks(target: LoadedModel, monkeypatch) -> None:
    """A small step budget: prompts, and the head's catch-ups over their held hidden
    states, run in chunks over several steps; outputs stay those of plain decoding."""
    small = {"max_num_batched_tokens": 16}
    plain, _, _ = _run(target, None, **small)
    reqs = _requests(target.model.args.vocab_size)
    _oracle(monkeypatch, {rid: p + plain[rid][0] for rid, p, _ in reqs})
    spec, stats, _ = _run(target, _spec(), **small)
    assert spec == plain
    assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["spec_mtp_restarts"] == 0
