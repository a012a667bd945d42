"""Prompt chunks' attention and SwiGLU in numpy on the CPU (`cpu_prefill`), against
MLX's own ops: the same values for every mask kind a model passes, and the same greedy
tokens through the engine for the architectures users run."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support.engine_runs import greedy_logprobs, loaded_model

from pippin.kernels import cpu_prefill
from pippin.kernels.config import KernelConfig


@pytest.fixture(params=["one tile", "many tiles"])
def tiles(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "many tiles":  # tiles of MIN_TILE queries: every boundary case
        monkeypatch.setattr(cpu_prefill, "TILE_SCORES", 1)
        monkeypatch.setattr(cpu_prefill, "MIN_TILE", 3)
    return str(request.param)


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4), (6, 3)])
@pytest.mark.parametrize("L,S", [(5, 9), (7, 7), (16, 40)])
@pytest.mark.parametrize("mask_kind", ["causal", "none", "bool", "additive", "padded rows"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_attention_matches_mlx(
    tiles: str,
    hq: int,
    hkv: int,
    L: int,
    S: int,
    mask_kind: str,
    dtype: mx.Dtype,
    with_sinks: bool,
) -> None:
    B, D = 2, 16
    rng = np.random.default_rng(L * 100 + S + hq)
    q, k, v = (
        mx.array(rng.standard_normal(shape), dtype=dtype)
        for shape in ((B, hq, L, D), (B, hkv, S, D), (B, hkv, S, D))
    )
    mask: mx.array | str | None = {"causal": "causal", "none": None}.get(mask_kind)
    if mask_kind in ("bool", "padded rows"):
        m = rng.random((B, 1, L, S)) > 0.4
        m[..., 0] = True
        if mask_kind == "padded rows":
            m[1, :, L // 2 :] = False  # a padded row's queries see no key: uniform, not NaN
        mask = mx.array(m)
    elif mask_kind == "additive":
        mask = mx.array(rng.standard_normal((L, S)), dtype=dtype)  # broadcast over B, heads
    sinks = mx.array(rng.standard_normal(hq), dtype=dtype) if with_sinks else None
    # numpy computes in float32 whatever the dtype: so is the reference (MLX keeps
    # bfloat16 scores in bfloat16, a coarser answer).
    f32_mask = mask
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        f32_mask = mask.astype(mx.float32)
    want = mx.fast.scaled_dot_product_attention(
        q.astype(mx.float32),
        k.astype(mx.float32),
        v.astype(mx.float32),
        scale=0.3,
        mask=f32_mask,
        sinks=None if sinks is None else sinks.astype(mx.float32),
    ).astype(dtype)
    got = cpu_prefill.attention(q, k, v, 0.3, mask, sinks)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-5 if dtype == mx.float32 else 8e-3
    got_np, want_np = (np.array(x.astype(mx.float32)) for x in (got, want))
    assert np.isfinite(got_np).all()
    assert np.allclose(got_np, want_np, atol=tol)


@pytest.mark.parametrize("shape", [(1, 37, 24), (3, 5, 7)])
def test_swiglu_matches_mlx(shape: tuple[int, ...]) -> None:
    rng = np.random.default_rng(0)
    g = rng.standard_normal(shape).astype(np.float32) * 30  # exp overflows for some gates
    x = rng.standard_normal(shape).astype(np.float32)
    want = np.array(nn.silu(mx.array(g)) * mx.array(x))
    got = np.array(cpu_prefill.swiglu(mx.array(g), mx.array(x)))
    assert np.isfinite(got).all()
    assert np.allclose(got, want, atol=1e-5, rtol=1e-5)


def test_decode_shapes_keep_the_original() -> None:
    seen: list[tuple[int, ...]] = []

    def original(gate: mx.array, x: mx.array) -> mx.array:
        seen.append(tuple(gate.shape))
        return gate * x

    routed = cpu_prefill.routed_swiglu(original)
    routed(mx.ones((1, 6, 8)), mx.ones((1, 6, 8)))  # mlx-lm's own callers: untouched
    with cpu_prefill.in_runner():
        routed(mx.ones((4, 1, 8)), mx.ones((4, 1, 8)))  # a decode batch: one token a row
        routed(mx.ones((2, 5, 3, 8)), mx.ones((2, 5, 3, 8)))  # MoE experts' shape
        routed(mx.ones((1, 6, 8)), mx.ones((1, 6, 8)))  # a prompt chunk: numpy
    assert seen == [(1, 6, 8), (4, 1, 8), (2, 5, 3, 8)]
    short, long = mx.zeros((8, 2, 30, 4)), mx.zeros((8, 2, cpu_prefill.DECODE_KEYS, 4))
    assert cpu_prefill.applies(mx.zeros((1, 2, 6, 4)), short)
    assert not cpu_prefill.applies(mx.zeros((8, 2, 1, 4)), short)  # decode, short context
    assert cpu_prefill.applies(mx.zeros((8, 2, 1, 4)), long)  # decode, long context
    assert not cpu_prefill.applies(mx.zeros((8, 2, 1, 4)), long, traced=True)


def test_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_prefill.wanted("1")
    assert not cpu_prefill.wanted("0")
    assert cpu_prefill.wanted("auto") == (mx.default_device() == mx.cpu)
    monkeypatch.setenv("PIPPIN_CPU_PREFILL", "0")
    assert KernelConfig.from_env().cpu_prefill == "0"


@pytest.mark.parametrize("decode", ["short decode in MLX", "every decode in numpy"])
@pytest.mark.parametrize(
    "arch", ["llama", "llama-4bit", "qwen3", "gemma3", "qwen3_next", "qwen3_moe", "gpt_oss"]
)
def test_engine_outputs_match_mlx_ops(
    tiny_models, arch: str, decode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh prompts batched together, prompts after a cached prefix (array masks) and a
    chunked prompt: the same greedy tokens and logprobs as with MLX's own ops. gemma3 has
    sliding-window layers, qwen3_next recurrent ones, qwen3_moe experts (whose SwiGLU
    keeps MLX's), gpt_oss attention sinks; llama-4bit quantised projections."""
    if decode == "every decode in numpy":
        monkeypatch.setattr(cpu_prefill, "DECODE_KEYS", 1)
    loaded = loaded_model(tiny_models(arch.removesuffix("-4bit")))
    if arch.endswith("-4bit"):
        nn.quantize(loaded.model, group_size=64, bits=4)
        mx.eval(loaded.model.parameters())
    rng = random.Random(7)
    header = [rng.randrange(3, 200) for _ in range(20)]
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 40))] for _ in range(4)]
    prompts += [header + [rng.randrange(3, 200) for _ in range(n)] for n in (3, 17, 30)]
    prompts.append([rng.randrange(3, 200) for _ in range(90)])  # chunked at 64 tokens a step
    config = {"max_num_batched_tokens": 64}

    monkeypatch.setenv("PIPPIN_CPU_PREFILL", "0")
    reference = greedy_logprobs(loaded, prompts, **config)

    monkeypatch.setenv("PIPPIN_CPU_PREFILL", "1")
    calls = {"attention": 0, "swiglu": 0, "decode": 0}
    real_attention, real_swiglu = cpu_prefill.attention, cpu_prefill.swiglu

    def attention(*args: object) -> mx.array:
        calls["attention"] += 1
        calls["decode"] += args[0].shape[2] == 1  # type: ignore[attr-defined]
        return real_attention(*args)  # type: ignore[arg-type]

    def swiglu(*args: mx.array) -> mx.array:
        calls["swiglu"] += 1
        return real_swiglu(*args)

    monkeypatch.setattr(cpu_prefill, "attention", attention)
    monkeypatch.setattr(cpu_prefill, "swiglu", swiglu)
    got = greedy_logprobs(loaded, prompts, **config)
    assert calls["attention"] > 0
    assert (calls["decode"] > 0) == (decode == "every decode in numpy")
    assert (calls["swiglu"] > 0) == (arch in ("llama", "llama-4bit", "qwen3", "qwen3_next"))
    assert got.keys() == reference.keys() == {str(i) for i in range(len(prompts))}
    for rid in reference:
        assert [t for t, _ in got[rid]] == [t for t, _ in reference[rid]], rid
        assert np.allclose(
            [lp for _, lp in got[rid]], [lp for _, lp in reference[rid]], atol=2e-3
        ), rid
