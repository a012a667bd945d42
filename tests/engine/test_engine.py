"""The engine against mlx-lm's own generate_step, on tiny random models of real architectures."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import mlx.core as mx
import pytest
from support.engine_runs import (
    GEN,
    OOM,
    agrees,
    engine_config,
    faulty_forward,
    loaded_model,
    mlx_lm_reference,
    random_prompts,
    run_to_end,
    serve_inproc,
)

from pippin.engine import core as core_module
from pippin.engine.core import EngineCore, EngineError
from pippin.engine.inproc_client import InprocClient
from pippin.engine.types import SamplingParams, ThinkingBudget
from pippin.kernels import device


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3_next", "qwen3_moe", "gpt_oss"])
def test_greedy_matches_mlx_lm_alone_and_batched(tiny_models, arch: str) -> None:
    loaded = loaded_model(tiny_models(arch))
    vocab = loaded.model.args.vocab_size
    prompts = random_prompts(vocab, 16)
    refs = [mlx_lm_reference(loaded.model, p, GEN) for p in prompts[:4]]
    greedy = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)

    # Alone: one request at a time.
    core = EngineCore(loaded, engine_config())
    for i, (ref, gaps) in enumerate(refs):
        core.add_request(f"a{i}", prompts[i], greedy)
        got = run_to_end(core)[f"a{i}"]["ids"][0]
        assert agrees(got, ref, gaps), (i, got, ref)

    # Batched with 15 others of other lengths and sampling settings; a small
    # token budget forces chunked prefill beside running decodes.
    core = EngineCore(loaded, engine_config())
    for i, p in enumerate(prompts):
        if i < 4:
            params = greedy
        else:
            params = SamplingParams(
                max_tokens=GEN + i,
                temperature=0.7 + 0.05 * i,
                top_p=0.9,
                top_k=50,
                min_p=0.02,
                seed=i,
                repetition_penalty=1.1,
                presence_penalty=0.2,
                frequency_penalty=0.1,
                ignore_eos=True,
                logprobs=i % 3 == 0,
                top_logprobs=2,
            )
        core.add_request(f"b{i}", p, params)
    res = run_to_end(core)
    for i, (ref, gaps) in enumerate(refs):
        got = res[f"b{i}"]["ids"][0]
        assert agrees(got, ref, gaps), (i, got, ref)
    for i in range(4, 16):
        assert len(res[f"b{i}"]["ids"][0]) == GEN + i
    stats = core.stats()
    assert stats["blocks_free"] == stats["blocks_total"]
    assert stats["running"] == stats["waiting"] == 0


def test_preemption_recomputes_and_frees(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    prompts = random_prompts(loaded.model.args.vocab_size, 8, seed=3)
    refs = [mlx_lm_reference(loaded.model, p, GEN) for p in prompts]
    # 40 blocks of 4 tokens cannot hold 8 sequences of up to 84 tokens at once.
    core = EngineCore(loaded, engine_config(num_blocks=41))
    greedy = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, greedy)
    res = run_to_end(core)
    assert core.stats()["preemptions"] > 0
    for i, (ref, gaps) in enumerate(refs):
        assert agrees(res[str(i)]["ids"][0], ref, gaps)
    assert core.stats()["blocks_free"] == core.stats()["blocks_total"]


def test_prefix_cache_hit_and_n_shares_prompt(tiny_models) -> None:
    loaded = loaded_model(tiny_models("qwen3"))
    core = EngineCore(loaded, engine_config(block_size=4))
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=5)[0][:41]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    core.add_request("first", prompt, greedy)
    first = run_to_end(core)["first"]
    assert first["cached"] == 0
    core.add_request("again", prompt, greedy)
    again = run_to_end(core)["again"]
    assert again["cached"] == 40  # every full block but the one holding the last token
    assert again["ids"] == first["ids"]

    hits = core.bm.hits
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=7, n=3, ignore_eos=True)
    core.add_request("n3", prompt + [5, 6, 7, 8], params)
    res = run_to_end(core)["n3"]
    assert sorted(res["ids"]) == [0, 1, 2]
    assert core.bm.hits >= hits + 3  # all three reuse the shared prompt's blocks
    assert len({tuple(v) for v in res["ids"].values()}) > 1  # the samples differ


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_next"])
def test_an_announcing_request_gets_its_cached_tokens_before_its_prefill(
    tiny_models, arch: str
) -> None:
    """`SamplingParams.announce`: once, when first scheduled, an output without tokens that
    carries the prompt's cached tokens, before the chunked prefill gives any token (the
    Anthropic API's message_start); requests that do not ask get no such output. Dense,
    MoE and hybrid (resumed from recurrent-state snapshots) alike."""
    loaded = loaded_model(tiny_models(arch))
    core = EngineCore(loaded, engine_config(block_size=4, max_num_batched_tokens=32))
    other, prompt = random_prompts(loaded.model.args.vocab_size, 2, seed=6)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    core.add_request("plain", other, plain)
    while core.has_work():
        assert all(out.outputs for out in core.step())
    prompt = prompt + list(range(7, 7 + 64))  # two chunks at least
    # The repeat comes from the cache but for the block holding its last token.
    for rid, cached in (("first", 0), ("again", (len(prompt) - 1) // 4 * 4)):
        core.add_request(rid, prompt, replace(plain, announce=True))
        outs = []
        while core.has_work():
            outs += [out for out in core.step() if out.request_id == rid]
        empty = [i for i, out in enumerate(outs) if not out.outputs]
        assert empty == [0], rid  # the first output, once
        assert outs[0].cached_tokens == cached and not outs[0].finished
        assert sum(len(c.token_ids) for out in outs for c in out.outputs) == 4
        assert outs[-1].finished and outs[-1].cached_tokens == cached


def test_seed_gives_same_output_in_any_batch(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    prompts = random_prompts(loaded.model.args.vocab_size, 6, seed=9)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    core = EngineCore(loaded, engine_config())
    core.add_request("alone", prompts[0], seeded)
    alone = run_to_end(core)["alone"]["ids"][0]
    for i, p in enumerate(prompts):
        core.add_request(f"x{i}", p, seeded if i == 0 else SamplingParams(max_tokens=20))
    assert run_to_end(core)["x0"]["ids"][0] == alone
    core.add_request("other", prompts[0], SamplingParams(max_tokens=16, seed=99, ignore_eos=True))
    assert run_to_end(core)["other"]["ids"][0] != alone


def test_stop_strings_split_across_tokens_are_cut(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=11)[0]
    core = EngineCore(loaded, engine_config())
    core.add_request("plain", prompt, SamplingParams(max_tokens=40, temperature=0.0))
    text = run_to_end(core)["plain"]["text"][0]
    assert len(text) > 20
    # A stop that starts inside one token and ends inside a later one.
    start = len(text) // 2
    stop = text[start : start + 5]
    first = text.find(stop)
    core.add_request("stopped", prompt, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))
    res = run_to_end(core)["stopped"]
    assert res["text"][0] == text[:first]
    assert res["finish"][0] == ("stop", stop)


def test_max_tokens_stop_tokens_logprobs_and_bias(tiny_models) -> None:
    loaded = loaded_model(tiny_models("qwen3"))
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=13)[0]
    core = EngineCore(loaded, engine_config())
    core.add_request("len", prompt, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    res = run_to_end(core)["len"]
    assert len(res["ids"][0]) == 5 and res["finish"][0] == ("length", None)
    stop_tok = res["ids"][0][2]
    core.add_request(
        "tok", prompt, SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[stop_tok])
    )
    res2 = run_to_end(core)["tok"]
    assert res2["ids"][0] == res["ids"][0][: res["ids"][0].index(stop_tok) + 1]
    assert res2["finish"][0] == ("stop", stop_tok)

    core.add_request("bias", prompt, SamplingParams(max_tokens=6, logit_bias={77: 100.0}))
    assert run_to_end(core)["bias"]["ids"][0] == [77] * 6

    ref, _ = mlx_lm_reference(loaded.model, prompt, 3)
    lp_params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, top_logprobs=3)
    logprobs = []
    core.add_request("lp", prompt, lp_params)
    while core.has_work():
        for out in core.step():
            logprobs.extend(out.outputs[0].logprobs or [])
    assert [lp.token_id for lp in logprobs] == ref
    for lp in logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id
        assert abs(lp.top[0][1] - lp.logprob) < 1e-5 and lp.logprob <= 0


def test_rejects_prompt_past_context(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    core = EngineCore(loaded, engine_config(max_model_len=64))
    with pytest.raises(EngineError, match="64"):
        core.add_request("long", list(range(3, 80)), SamplingParams())


def test_async_engine_concurrency_and_cancellation(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    vocab = loaded.model.args.vocab_size
    prompts = random_prompts(vocab, 24, seed=17)

    async def main() -> dict:
        engine = InprocClient(loaded, engine_config(max_num_batched_tokens=256))
        await engine.start()
        assert engine.ready

        async def one(i: int) -> tuple[int, str | None]:
            params = SamplingParams(
                max_tokens=30, temperature=0.0 if i % 2 else 0.9, ignore_eos=True
            )
            n = 0
            reason = None
            async for out in engine.generate(prompts[i], params, f"r{i}"):
                n += len(out.outputs[0].token_ids) if out.outputs else 0
                if i % 4 == 0 and n >= 5:
                    break  # the client goes away midway
                reason = out.outputs[0].finish_reason if out.outputs else reason
            return n, reason

        results = await asyncio.gather(*(one(i) for i in range(24)))
        await asyncio.sleep(0.2)  # aborts land at the next step
        stats = engine.stats()
        await engine.stop()
        return {"results": results, "stats": stats}

    out = asyncio.run(main())
    for i, (n, reason) in enumerate(out["results"]):
        if i % 4:
            assert n == 30 and reason == "length"
    stats = out["stats"]
    assert stats["blocks_free"] == stats["blocks_total"]
    assert stats["running"] == stats["waiting"] == 0


def test_failure_adding_a_later_sequence_leaves_nothing_behind(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request of n=3 whose second sequence cannot be added ends with an error, and the
    first one, already queued, goes with it: nothing keeps waiting or holds a block, and
    the next request is served."""
    loaded = loaded_model(tiny_models("llama"))
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=4)[0]

    async def main() -> tuple[list, dict, list]:
        engine = InprocClient(loaded, engine_config())
        await engine.start()
        core = engine.engine.core
        assert core is not None
        real_add = core.scheduler.add
        added = 0

        def add(seq) -> None:  # type: ignore[no-untyped-def]
            nonlocal added
            added += 1
            if added == 2:
                raise RuntimeError("no room for sequence 1")
            real_add(seq)

        monkeypatch.setattr(core.scheduler, "add", add)
        params = SamplingParams(max_tokens=8, temperature=0.0, n=3, ignore_eos=True)
        failed = [out async for out in engine.generate(prompt, params, "broken")]
        monkeypatch.setattr(core.scheduler, "add", real_add)
        one = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        after = [out async for out in engine.generate(prompt, one, "after")]
        stats = engine.stats()
        await engine.stop()
        return failed, stats, after

    failed, stats, after = asyncio.run(main())
    assert failed[-1].finished and "no room for sequence 1" in (failed[-1].error or "")
    assert after[-1].finished and after[-1].error is None
    assert sum(len(c.token_ids) for o in after for c in o.outputs) == 4
    assert stats["running"] == stats["waiting"] == 0
    assert stats["blocks_free"] == stats["blocks_total"]


def test_step_out_of_memory_is_recomputed_on_fresh_pools(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step that runs the device out of memory (as MLX's CUDA allocator says it) loses
    no request: the running ones are recomputed from their known tokens, on KV pools made
    anew, and end exactly as without the failure. A later request sharing their prompt's
    prefix reads no block the failed step left behind (the prefix cache was emptied), and
    admission is narrowed for a while, then restored."""
    loaded = loaded_model(tiny_models("llama"))
    vocab = loaded.model.args.vocab_size
    shared = random_prompts(vocab, 1, seed=9)[0][:16] + [5] * 8  # whole blocks, cached
    prompts = [shared + p for p in random_prompts(vocab, 4, seed=5)]
    later = [shared + [7, 8, 9]]
    want, want_later, _, _ = serve_inproc(loaded, prompts, later)

    monkeypatch.setattr(core_module, "NARROW_STEPS", 6)
    faulty_forward(monkeypatch, lambda n, _: OOM if n in (6, 9) else None)
    got, got_later, stats, core = serve_inproc(loaded, prompts, later)
    assert [t for t, _, _ in want] == [t for t, _, _ in got]
    assert all(len(t) == 20 and r == "length" and e is None for t, r, e in got)
    assert got_later == want_later
    assert core.scheduler.num_preemptions >= 2  # at least one running sequence, twice
    assert core.scheduler.max_num_seqs == engine_config().max_num_seqs
    assert stats["blocks_free"] == stats["blocks_total"]
    assert (stats["failed_steps_out_of_memory"], stats["failed_steps_other"]) == (2, 0)
    # The pools were made anew: nothing of what the failed step left (3.0 everywhere).
    parts = [p for pool in core.runner.pools.values() for p in pool.parts]
    assert parts and not any(mx.any(p == 3.0).item() for p in parts)


def test_recovery_frees_the_old_pools_before_making_new_ones(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed step's frames hold its graph, and through it the old KV pools: recovery
    lets them go before allocating fresh pools, so it never needs room for both (which a
    device that just ran out of memory would not have)."""
    loaded = loaded_model(tiny_models("llama"))
    core = EngineCore(loaded, engine_config(num_blocks=40000))
    pool = sum(p.nbytes for p in core.runner.pools.values())
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, p in enumerate(random_prompts(loaded.model.args.vocab_size, 3, seed=3)):
        core.add_request(str(i), p, params)
    for _ in range(3):
        core.step()
    faulty_forward(monkeypatch, lambda n, _: OOM)
    with pytest.raises(RuntimeError) as failed:
        core.step()
    before = mx.get_active_memory()
    core.recover(failed.value)
    assert mx.get_active_memory() < before + pool // 2, pool
    monkeypatch.undo()
    while core.has_work():
        core.step()
    stats = core.stats()
    assert stats["blocks_free"] == stats["blocks_total"]


def test_step_failing_again_and_again_ends_its_requests(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of memory at every step: each running request ends after `STEP_ATTEMPTS`
    failed steps, with an error that says what to change. Any other error ends every
    running request at once. Either way the engine then serves new requests in full,
    with every block back in the pool."""
    loaded = loaded_model(tiny_models("llama"))
    prompts = random_prompts(loaded.model.args.vocab_size, 5, seed=5)
    for message, hint in ((OOM, "--buffer-cache-mb"), ("a bug", None)):
        # Every call with one of the first four requests in it fails, from the fourth on.
        faulty_forward(
            monkeypatch,
            lambda n, rids, m=message: m if n >= 4 and any(r[0] == "r" for r in rids) else None,
        )
        first, after, stats, _ = serve_inproc(loaded, prompts[:4], prompts[4:])
        for tokens, reason, error in first:
            assert reason == "error" and len(tokens) < 20, (message, reason)
            assert error is not None and message in error
            assert (hint in error) if hint else ("--buffer-cache-mb" not in error)
        assert len(after[0][0]) == 20 and after[0][1:] == ("length", None)
        assert stats["blocks_free"] == stats["blocks_total"]
        oom = stats["failed_steps_out_of_memory"]
        assert (oom >= 3, stats["failed_steps_other"]) == ((True, 0) if hint else (False, 1))
        monkeypatch.undo()


def test_mixed_decode_and_prefill_step_updates_pool_in_place(tiny_models) -> None:
    """A step with both a decode call and a prefill call must not copy the KV pools."""
    loaded = loaded_model(tiny_models("qwen3"))
    config = engine_config(
        num_blocks=10000, block_size=16, max_model_len=4096, max_num_batched_tokens=2048
    )
    core = EngineCore(loaded, config)
    pool_bytes = sum(p.nbytes for p in core.runner.pools.values())
    prompts = random_prompts(loaded.model.args.vocab_size, 4, seed=21)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    core.add_request("a", prompts[0], params)
    core.step()  # a is decoding now
    for i in (1, 2, 3):
        core.add_request(str(i), prompts[i], params)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    core.step()  # a's decode and the others' prefill in one step
    assert mx.get_peak_memory() - base < pool_bytes / 4
    # Decode steps built while the previous one is still in flight update in place too.
    for _ in range(4):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        core.step()
        assert mx.get_peak_memory() - base < pool_bytes / 4


def test_lone_sequence_longer_than_pool_ends_with_length(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    core = EngineCore(loaded, engine_config(num_blocks=9, block_size=4, max_model_len=512))
    assert core.max_model_len == 32  # capped to what the pool holds
    core.add_request("r", list(range(3, 13)), SamplingParams(max_tokens=100, ignore_eos=True))
    res = run_to_end(core)["r"]
    assert res["finish"][0][0] == "length" and len(res["ids"][0]) == 22


def test_min_tokens_holds_back_stop_strings(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    prompt = random_prompts(loaded.model.args.vocab_size, 1, seed=23)[0]
    core = EngineCore(loaded, engine_config())
    core.add_request("plain", prompt, SamplingParams(max_tokens=30, temperature=0.0))
    plain = run_to_end(core)["plain"]
    first_char = plain["text"][0][0]
    params = SamplingParams(max_tokens=30, temperature=0.0, stop=[first_char], min_tokens=5)
    core.add_request("min", prompt, params)
    res = run_to_end(core)["min"]
    assert len(res["ids"][0]) >= 5


def test_cache_memory_bytes_sizes_the_pool(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    core = EngineCore(loaded, engine_config(num_blocks=None, cache_memory_bytes=4 * 1024 * 1024))
    per_block = sum(p.nbytes for p in core.runner.pools.values()) // core.num_blocks
    assert core.num_blocks == 4 * 1024 * 1024 // per_block


def test_buffer_cache_stays_under_its_limit(tiny_models) -> None:
    """MLX's cache of freed buffers is held to `buffer_cache_bytes` (by default the KV
    pool's size, at least 1 GiB), however many batch shapes the steps go through: without
    the limit the same run caches more."""
    loaded = loaded_model(tiny_models("llama"))
    before = mx.set_cache_limit(0)
    try:
        peaks = {}
        for limit in (None, 64 * 1024):
            mx.set_cache_limit(before)
            mx.clear_cache()
            core = EngineCore(loaded, engine_config(buffer_cache_bytes=limit))
            for i, p in enumerate(random_prompts(loaded.model.args.vocab_size, 12, seed=3)):
                core.add_request(f"r{i}", p, SamplingParams(max_tokens=6 + i, temperature=0))
            peak = 0
            while core.has_work():
                core.step()
                peak = max(peak, mx.get_cache_memory())
            peaks[limit] = peak
        # MLX's CUDA allocator puts a freed buffer in the cache whenever the cache is under
        # its limit, so the cache may pass the limit by one buffer; the largest this tiny
        # model's steps free is under 64 KiB (CPU and Metal trim to the limit itself).
        bound = 64 * 1024 + (64 * 1024 if device.on_cuda() else 0)
        assert peaks[64 * 1024] <= bound < peaks[None], peaks
        EngineCore(loaded, engine_config(num_blocks=None, cache_memory_bytes=4 * 1024 * 1024))
        assert mx.set_cache_limit(before) == 1 << 30  # the default's floor
    finally:
        mx.set_cache_limit(before)


def test_stream_interval_merges_deltas_without_losing_tokens(tiny_models) -> None:
    """With a stream interval, a request's tokens arrive in fewer, larger deltas: the
    first one at once, the same tokens, text and logprobs in total, the end not held."""
    loaded = loaded_model(tiny_models("llama"))
    prompts = random_prompts(loaded.model.args.vocab_size, 3, seed=31)

    async def run(interval: float) -> list[list[tuple[list[int], str, int, str | None]]]:
        engine = InprocClient(loaded, engine_config(stream_interval_s=interval))
        await engine.start()

        async def one(i: int) -> list[tuple[list[int], str, int, str | None]]:
            params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=True)
            deltas = []
            async for out in engine.generate(prompts[i], params, f"r{i}"):
                c = out.outputs[0]
                deltas.append((c.token_ids, c.text, len(c.logprobs or []), c.finish_reason))
            return deltas

        try:
            return await asyncio.gather(*(one(i) for i in range(3)))
        finally:
            await engine.stop()

    every = asyncio.run(run(0.0))
    paced = asyncio.run(run(0.05))
    for a, b in zip(every, paced):
        assert [t for d in a for t in d[0]] == [t for d in b for t in d[0]]
        assert "".join(d[1] for d in a) == "".join(d[1] for d in b)
        assert sum(d[2] for d in b) == 40
        assert b[-1][3] == "length"
        assert len(b[0][0]) == 1  # the first token is not held back
        assert len(b) < len(a)  # later ones went out together


def test_request_output_then_merges_per_choice() -> None:
    from pippin.engine.types import CompletionOutput, RequestOutput, TokenLogprob

    a = RequestOutput(
        "r",
        [
            CompletionOutput(0, [1], "a", [TokenLogprob(1, -0.1)]),
            CompletionOutput(1, [5], "x", [TokenLogprob(5, -0.5)]),
        ],
        10,
        0,
        False,
    )
    b = RequestOutput(
        "r",
        [CompletionOutput(1, [6], "y", [TokenLogprob(6, -0.6)], "stop", "y")],
        10,
        4,
        False,
    )
    c = RequestOutput(
        "r", [CompletionOutput(0, [2], "b", [TokenLogprob(2, -0.2)], "length")], 10, 4, True
    )
    m = a.then(b).then(c)
    assert m.finished and m.cached_tokens == 4
    assert [(o.index, o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in m.outputs] == [
        (0, [1, 2], "ab", "length", None),
        (1, [5, 6], "xy", "stop", "y"),
    ]
    assert [lp.token_id for lp in m.outputs[1].logprobs or []] == [5, 6]


@pytest.mark.parametrize("budget", [3, 0])
def test_thinking_budget_ends_on_the_whole_marker_only(tiny_models, budget: int) -> None:
    """A reasoning end marker of several tokens ends the section only when all of them
    come in order: a model that writes the marker's last token on its own inside the
    section (a random model on a GPU wrote '>' of '</think>') still gets its budget
    enforced, the whole marker written, then the answer."""
    loaded = loaded_model(tiny_models("qwen3"))
    a, b, c = 41, 42, 43  # the end marker as three tokens
    core = EngineCore(loaded, engine_config())
    tb = ThinkingBudget(budget, (a, b, c), start_id=None, open=True)
    # The model would write the marker's last token every time.
    params = SamplingParams(
        max_tokens=budget + 5, temperature=0.0, logit_bias={c: 100.0}, thinking=tb
    )
    core.add_request("r", random_prompts(loaded.model.args.vocab_size, 1, seed=8)[0], params)
    ids = run_to_end(core)["r"]["ids"][0]
    assert ids == [c] * budget + [a, b, c] + [c, c], ids


@pytest.mark.parametrize("error", [OOM, "a bug"])
def test_outputs_finished_before_a_failed_step_are_handed_out(
    tiny_models, monkeypatch: pytest.MonkeyPatch, error: str
) -> None:
    """A step that finishes the one in flight first (penalties need its tokens) and then
    fails: the tokens it finished reach the client (by `recover`), so a recomputed request
    misses none and one that ended in them still ends."""
    loaded = loaded_model(tiny_models("llama"))
    prompts = random_prompts(loaded.model.args.vocab_size, 3, seed=6)

    def run(fail: bool) -> dict:
        core = EngineCore(loaded, engine_config())
        for i, p in enumerate(prompts):
            params = SamplingParams(
                max_tokens=2 + 5 * i, temperature=0, ignore_eos=True, repetition_penalty=1.2
            )
            core.add_request(str(i), p, params)
        if fail:
            # The first call after request 0 ended: in the step that finished it first.
            failed: list[int] = []

            def once(n: int, ids: list[str]) -> str | None:
                if failed or "0" in core.requests:
                    return None
                failed.append(n)
                return error

            faulty_forward(monkeypatch, once)
        res = run_to_end(core, recover=True)
        monkeypatch.undo()
        return {k: (v["ids"][0], v["finish"][0][0]) for k, v in res.items()}

    want = run(False)
    got = run(True)
    if error == OOM:
        assert got == want
    else:  # every request ends: those that had not, with the error
        assert got["0"] == want["0"]
        assert {k: r for k, (_, r) in got.items()} == {"0": "length", "1": "error", "2": "error"}
        for k in ("1", "2"):
            assert want[k][0][: len(got[k][0])] == got[k][0]
