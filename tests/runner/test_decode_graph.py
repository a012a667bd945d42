"""The compiled decode step (`runner/decode_graph.py`) against the step built op by op."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from support.engine_runs import greedy_logprobs, greedy_or_skip, loaded_model

from pippin.runner import decode_graph


@pytest.mark.parametrize(
    "arch,config",
    [
        ("llama", {}),
        ("qwen3", {}),
        ("gemma3", {}),
        ("llama", {"kv_bits": 8, "kv_group_size": 32}),
        ("qwen3_moe", {}),
        ("gpt_oss", {}),
    ],
)
def test_compiled_decode_matches_op_by_op(
    tiny_models, arch: str, config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches that shrink through several padded sizes, contexts that cross block and
    table-width buckets, (gemma3, gpt_oss) sliding-window layers, (gpt_oss) attention sinks,
    (qwen3_moe, gpt_oss) routed experts: the same tokens and logprobs."""
    windowed = arch in ("gemma3", "gpt_oss")
    loaded = loaded_model(tiny_models(arch) if windowed else tiny_models(arch, head_dim=32))
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(1, 60))] for _ in range(11)]
    gens = [rng.randrange(5, 70) for _ in prompts]
    monkeypatch.setenv("PIPPIN_COMPILE", "0")
    eager = greedy_or_skip(loaded, prompts, gens, 400, **config)

    monkeypatch.setenv("PIPPIN_COMPILE", "1")
    traced = 0
    real = decode_graph.DecodeGraph._step

    def counting(self, *args):
        nonlocal traced
        traced += 1
        return real(self, *args)

    monkeypatch.setattr(decode_graph.DecodeGraph, "_step", counting)
    compiled = greedy_logprobs(loaded, prompts, gens, 400, **config)
    assert 0 < traced < 40  # traced once per padded shape, not once per step
    assert compiled.keys() == eager.keys()
    for rid, ref in eager.items():
        got = compiled[rid]
        assert [t for t, _ in got] == [t for t, _ in ref], rid
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, ref)) < 2e-3, rid


def test_buckets_pad_little_and_are_few() -> None:
    sizes = [decode_graph.bucket(n) for n in range(1, 1025)]
    assert all(n <= b <= max(n * 1.25, n + 1) for n, b in zip(range(1, 1025), sizes))
    assert len(set(sizes)) <= 40
    assert [decode_graph.pow2(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert mx.array(sizes).max().item() == 1024


def test_the_engine_counts_each_new_shape_traced(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`decode_traces` (/metrics: `pippin_decode_graph_traces_total`) counts the compiled
    step's traces, one per new padded shape, and the host time they took; the same load
    again, on shapes already traced, adds none."""
    from support.engine_runs import engine_config, run_to_end

    from pippin.engine.core import EngineCore
    from pippin.engine.types import SamplingParams

    monkeypatch.setenv("PIPPIN_COMPILE", "1")
    traced = 0
    real = decode_graph.DecodeGraph._step

    def counting(self, *args):  # type: ignore[no-untyped-def]
        nonlocal traced
        traced += 1
        return real(self, *args)

    monkeypatch.setattr(decode_graph.DecodeGraph, "_step", counting)
    core = EngineCore(loaded_model(tiny_models("llama", head_dim=32)), engine_config())
    assert core.stats()["decode_traces"] == 0

    def load(tag: str) -> None:
        for i, n in enumerate((3, 9, 20)):  # batches of 3, then 2, then 1 row
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            core.add_request(f"{tag}{i}", [5 + i] * 7, params)
        run_to_end(core)

    load("a")
    first = core.stats()
    assert first["decode_traces"] == traced >= 3
    assert first["decode_trace_seconds"] > 0
    load("b")
    assert core.stats()["decode_traces"] == traced == first["decode_traces"]


@pytest.mark.parametrize("arch", ["llama", "llama-4bit", "qwen3_moe", "qwen3_next"])
def test_warmed_shapes_are_not_traced_again_and_decode_the_same(
    tiny_models, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PIPPIN_WARM_DECODE=N`: the engine traces every (rows, table width) shape of up to
    --max-num-seqs rows and N tokens of context before it serves; a load within those bounds
    then traces nothing, and its tokens are those of an engine that did not warm (the
    warm-up wrote only the null block). Dense, 4-bit and MoE models alike; a hybrid
    (recurrent layers) has no compiled step, so nothing is traced or warmed."""
    import mlx.nn as nn
    from support.engine_runs import engine_config, run_to_end

    from pippin.engine.core import EngineCore
    from pippin.engine.types import SamplingParams
    from pippin.kernels.config import KernelConfig

    monkeypatch.setenv("PIPPIN_COMPILE", "1")
    loaded = loaded_model(tiny_models(arch.removesuffix("-4bit"), head_dim=32))
    if arch.endswith("-4bit"):
        nn.quantize(loaded.model, group_size=32, bits=4)

    def run(warm: int) -> tuple[EngineCore, dict]:
        kernels = KernelConfig(compile="1", warm_decode=warm)
        core = EngineCore(loaded, engine_config(max_num_seqs=6, kernels=kernels))
        rng = random.Random(3)
        for i in range(6):  # contexts of 5-60 tokens (block size 4: up to 15 blocks)
            prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(5, 30))]
            params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
            core.add_request(str(i), prompt, params)
        return core, run_to_end(core)

    cold, want = run(0)
    warm, got = run(64)
    rows = len({decode_graph.bucket(b) for b in range(1, 7)})  # 1-6: six buckets
    widths = len({decode_graph.bucket(n) for n in range(1, 17)})  # 64 tokens: 16 blocks
    if arch == "qwen3_next":
        assert warm.runner.graph is None
        assert warm.stats()["decode_traces"] == cold.stats()["decode_traces"] == 0
    else:
        assert warm.stats()["decode_traces"] == rows * widths
        assert 0 < cold.stats()["decode_traces"] < rows * widths
    assert {k: v["ids"] for k, v in got.items()} == {k: v["ids"] for k, v in want.items()}
