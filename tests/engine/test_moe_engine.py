"""Mixture-of-experts models (Qwen3-MoE; gpt-oss with attention sinks and sliding-window
layers) through the engine against mlx-lm's own generate_step: requests joining a running
batch, chunked prefill, the prefix cache, and the compiled decode step."""

from __future__ import annotations

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

from pippin.engine.core import EngineCore
from pippin.engine.types import SamplingParams
from pippin.runner.model_runner import UnsupportedModelError


@pytest.mark.parametrize("compiled", ["0", "1"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_joining_rows_and_prefix_hits_match_mlx_lm(
    tiny_models, arch: str, compiled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PIPPIN_COMPILE", compiled)
    loaded = loaded_model(tiny_models(arch))
    a = [(7 * i + 3) % 700 + 3 for i in range(37)]
    b = [(11 * i + 5) % 700 + 3 for i in range(11)]
    c = a[:32] + [9, 10, 11, 12, 13]  # shares eight blocks with a
    d = list(a)  # all of a's full blocks
    prompts = {"a": a, "b": b, "c": c, "d": d}
    refs = {k: mlx_lm_reference(loaded.model, p, GEN) for k, p in prompts.items()}
    greedy = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)

    # A budget of 16 tokens a step: a's prompt is prefilled in three chunks beside b's decode.
    core = EngineCore(loaded, engine_config(max_num_batched_tokens=16))
    assert (core.runner.graph is not None) == (compiled == "1")
    core.add_request("a", a, greedy)
    core.add_request("b", b, greedy)
    early: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(6):  # a is decoding by now, its prompt's blocks cached
        for out in core.step():
            for o in out.outputs:
                early[out.request_id] += o.token_ids
    assert early["a"] and early["b"]
    core.add_request("c", c, greedy)
    core.add_request("d", d, greedy)
    res = run_to_end(core)
    for k in "ab":
        res[k]["ids"][0] = early[k] + res[k]["ids"][0]
    assert res["c"]["cached"] == 32 and res["d"]["cached"] == 36
    for k, (ref, gaps) in refs.items():
        got = res[k]["ids"][0]
        assert agrees(got, ref, gaps), (k, got, ref)
    stats = core.stats()
    assert stats["blocks_free"] == stats["blocks_total"]


@pytest.mark.parametrize("compiled", ["0", "1"])
def test_decode_batches_that_sort_by_expert_match_mlx_lm(
    tiny_models, compiled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mlx-lm's SwitchGLU sorts rows by expert from 64 (row, expert) pairs on: 12 rows of
    8 routed experts each take that path in every decode step (compiled, a traced sort)."""
    monkeypatch.setenv("PIPPIN_COMPILE", compiled)
    loaded = loaded_model(tiny_models("qwen3_moe", num_experts_per_tok=8))
    prompts = random_prompts(loaded.model.args.vocab_size, 12, seed=4)
    refs = [mlx_lm_reference(loaded.model, p, GEN) for p in prompts]
    core = EngineCore(loaded, engine_config(max_num_batched_tokens=512))
    greedy = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, greedy)
    res = run_to_end(core)
    for i, (ref, gaps) in enumerate(refs):
        assert agrees(res[str(i)]["ids"][0], ref, gaps), i


def test_quantised_kv_is_refused_for_attention_sinks(tiny_models) -> None:
    """mlx-lm's quantised attention has no sinks: the engine says so at start."""
    loaded = loaded_model(tiny_models("gpt_oss", head_dim=32))
    config = engine_config(kv_bits=8, kv_group_size=32)
    with pytest.raises(UnsupportedModelError, match="attention sinks.*without --kv-bits"):
        EngineCore(loaded, config)
