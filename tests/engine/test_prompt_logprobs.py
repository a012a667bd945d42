"""Prompt logprobs (vLLM's `prompt_logprobs`) against a direct mlx-lm forward pass, over
prompts longer than a prefill chunk, with and without a cached prefix; and the masks of
`allowed_token_ids` and `bad_words`."""

from __future__ import annotations

import mlx.core as mx
import pytest
from support.engine_runs import engine_config, loaded_model, random_prompts

from pippin.engine import prompt_logprobs
from pippin.engine.core import EngineCore
from pippin.engine.types import RequestOutput, SamplingParams

K = 3


def _reference(model, prompt: list[int]) -> mx.array:
    """log-softmax of the model's logits at every prompt position, [len, vocab]."""
    logits = model(mx.array(prompt)[None])[0].astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _run(core: EngineCore) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {}
    while core.has_work():
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _check(prompt: list[int], got, ref: mx.array, tol: float = 2e-3) -> None:
    """Each prompt token's logprob, rank and top K as the reference has them (ranks and
    the order of the top only up to float ties)."""
    assert got[0] is None and len(got) == len(prompt)
    rows = ref.tolist()
    for i in range(1, len(prompt)):
        lp, row, tok = got[i], rows[i - 1], prompt[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(row[tok], abs=tol), i
        above = [v - row[tok] for v in row]
        assert 1 + sum(d > tol for d in above) <= lp.rank <= 1 + sum(d > -tol for d in above)
        best = sorted(row, reverse=True)[:K]
        assert [v for _, v in lp.top] == pytest.approx(best, abs=tol)
        assert all(row[t] == pytest.approx(v, abs=tol) for t, v in lp.top)


@pytest.mark.parametrize("arch,head", [("llama", True), ("qwen3", True), ("llama", False)])
def test_prompt_logprobs_match_mlx_lm(tiny_models, arch: str, head: bool) -> None:
    """`head`: the LM head runs on the selected positions only (`kernels.head_rows`), else
    on every position (models where it cannot be patched)."""
    loaded = loaded_model(tiny_models(arch))
    vocab = loaded.model.args.vocab_size
    prompt = random_prompts(vocab, 1, seed=5)[0]
    prompt = (prompt * 4)[:70]  # longer than the 16-token chunks below
    ref = _reference(loaded.model, prompt)
    core = EngineCore(loaded, engine_config(max_num_batched_tokens=16))
    assert core.runner.head is not None
    if not head:
        core.runner.head = None
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=K)

    # Without a cached prefix, beside a request without prompt logprobs.
    core.add_request("a", prompt, scored)
    core.add_request("b", prompt[:40], plain)
    outs = _run(core)
    first = outs["a"][0]
    assert first.prompt_logprobs is not None
    assert all(o.prompt_logprobs is None for o in outs["a"][1:] + outs["b"])
    _check(prompt, first.prompt_logprobs, ref)
    assert first.cached_tokens == 0

    # The whole prompt is now cached: it is computed again, and scores the same.
    core.add_request("c", prompt, plain)
    assert _run(core)["c"][0].cached_tokens > 0
    core.add_request("d", prompt, scored)
    again = _run(core)["d"]
    assert again[0].cached_tokens == 0
    _check(prompt, again[0].prompt_logprobs, ref)
    # The same greedy answer either way.
    ids = [t for o in outs["a"] for c in o.outputs for t in c.token_ids]
    assert ids == [t for o in again for c in o.outputs for t in c.token_ids]
    stats = core.stats()
    assert stats["blocks_free"] == stats["blocks_total"]


def test_prompt_logprobs_zero_and_n(tiny_models) -> None:
    """k = 0: the prompt token alone; with n = 2 the prompt is scored once."""
    loaded = loaded_model(tiny_models("llama"))
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=9)[0][:30]
    core = EngineCore(loaded, engine_config())
    params = SamplingParams(max_tokens=2, temperature=0.8, seed=1, n=2, prompt_logprobs=0)
    core.add_request("a", prompt, params)
    outs = _run(core)["a"]
    with_lps = [o for o in outs if o.prompt_logprobs is not None]
    assert len(with_lps) == 1
    lps = with_lps[0].prompt_logprobs
    assert len(lps) == len(prompt) and all(lp.top == [] for lp in lps[1:])
    _check_zero = _reference(loaded.model, prompt).tolist()
    for i in range(1, len(prompt)):
        assert lps[i].logprob == pytest.approx(_check_zero[i - 1][prompt[i]], abs=2e-3)


def test_allowed_token_ids_and_bad_words(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    vocab = loaded.model.args.vocab_size
    prompt = random_prompts(vocab, 1, seed=2)[0]
    core = EngineCore(loaded, engine_config())
    allowed = frozenset({7, 11, 13})
    core.add_request(
        "a",
        prompt,
        SamplingParams(
            max_tokens=12, temperature=1.0, seed=4, ignore_eos=True, allowed_token_ids=allowed
        ),
    )
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    core.add_request("g", prompt, greedy)
    outs = _run(core)
    got = [t for o in outs["a"] for c in o.outputs for t in c.token_ids]
    assert got and set(got) <= allowed
    free = [t for o in outs["g"] for c in o.outputs for t in c.token_ids]
    # Ban the greedy answer's first token, and its 3rd token after its 2nd.
    banned = SamplingParams(
        max_tokens=12,
        temperature=0.0,
        ignore_eos=True,
        bad_words_ids=[[free[0]]],
    )
    core.add_request("b", prompt, banned)
    got = [t for o in _run(core)["b"] for c in o.outputs for t in c.token_ids]
    assert free[0] not in got
    # A two-token word: its last token is banned only after its first.
    pair = SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, bad_words_ids=[free[1:3]]
    )
    core.add_request("p", prompt, pair)
    got = [t for o in _run(core)["p"] for c in o.outputs for t in c.token_ids]
    assert got[:2] == free[:2] and got[2] != free[2]
    assert all(got[i : i + 2] != free[1:3] for i in range(len(got) - 1))


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny_models, monkeypatch) -> None:
    """A scored prompt preempted half way through its chunks is scored again from the
    start, and reported once."""
    starts: list[int] = []
    real = prompt_logprobs.record

    def record(items, score, logits):
        starts.extend(items[b].start for b in score)
        return real(items, score, logits)

    monkeypatch.setattr(prompt_logprobs, "record", record)
    loaded = loaded_model(tiny_models("llama"))
    vocab = loaded.model.args.vocab_size
    first, long = random_prompts(vocab, 2, seed=11)
    first = (first * 3)[:8]
    long = (long * 4)[:70]
    core = EngineCore(
        loaded, engine_config(num_blocks=26, max_num_batched_tokens=4, max_model_len=100)
    )
    core.add_request("a", first, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    core.add_request("b", long, scored)
    outs = _run(core)
    assert starts.count(0) == 2 and starts[-1] > 0  # begun again, after some chunks
    with_lps = [o for o in outs["b"] if o.prompt_logprobs is not None]
    assert len(with_lps) == 1
    _check(long, with_lps[0].prompt_logprobs, _reference(loaded.model, long))
