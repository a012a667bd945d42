"""Prompt chunks' attention composed of plain ops (`prefill_attention`), the CUDA route
that avoids a cuDNN plan build per shape, against MLX's fused attention.

The route is on by default only on CUDA; `PIPPIN_PREFILL_ATTENTION=composed` forces it
anywhere, which is how these tests run it on CPU."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from test_engine import _loaded
from test_paged_attention import _greedy_logprobs

from pippin.engine import prefill_attention


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4), (6, 3)])
@pytest.mark.parametrize("L,S", [(5, 9), (7, 7), (1, 6)])
@pytest.mark.parametrize("mask_kind", ["causal", "none", "bool", "additive"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_composed_matches_fused(
    hq: int, hkv: int, L: int, S: int, mask_kind: str, dtype: mx.Dtype
) -> None:
    B, D = 3, 16
    rng = np.random.default_rng(L * 100 + S + hq)
    q, k, v = (
        mx.array(rng.standard_normal(shape), dtype=dtype)
        for shape in ((B, hq, L, D), (B, hkv, S, D), (B, hkv, S, D))
    )
    mask: mx.array | str | None = {"causal": "causal", "none": None}.get(mask_kind)
    if mask_kind == "bool":
        m = rng.random((B, 1, L, S)) > 0.4
        m[..., 0] = True  # every query sees at least one key
        mask = mx.array(m)
    elif mask_kind == "additive":
        mask = mx.array(rng.standard_normal((B, 1, L, S)), dtype=dtype)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask)
    got = prefill_attention.composed_attention(q, k, v, 0.3, mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    got_np, want_np = (np.array(x.astype(mx.float32)) for x in (got, want))
    assert np.allclose(got_np, want_np, atol=tol)


def test_route_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    small_q, small_k = mx.zeros((2, 32, 512, 64)), mx.zeros((2, 8, 512, 64))
    big_q, big_k = mx.zeros((16, 32, 1024, 1)), mx.zeros((16, 8, 2048, 1))
    one = mx.zeros((2, 32, 1, 64))
    monkeypatch.setattr(prefill_attention, "_on_cuda", lambda: True)
    monkeypatch.delenv("PIPPIN_PREFILL_ATTENTION", raising=False)
    assert prefill_attention.wanted()
    assert prefill_attention.use_composed(small_q, small_k)
    assert not prefill_attention.use_composed(big_q, big_k)  # over the budget: cuDNN
    assert not prefill_attention.use_composed(one, small_k)  # decode
    monkeypatch.setenv("PIPPIN_PREFILL_ATTENTION", "fused")
    assert not prefill_attention.wanted()
    assert not prefill_attention.use_composed(small_q, small_k)
    monkeypatch.setenv("PIPPIN_PREFILL_ATTENTION", "composed")
    assert prefill_attention.use_composed(big_q, big_k)
    monkeypatch.setattr(prefill_attention, "_on_cuda", lambda: False)
    monkeypatch.delenv("PIPPIN_PREFILL_ATTENTION")
    assert not prefill_attention.wanted()  # Metal and CPU build nothing per shape
    assert not prefill_attention.use_composed(small_q, small_k)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_engine_outputs_match_with_composed_prefill(
    tiny_models, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh prompts batched together, prompts after a cached prefix (array masks), and
    chunked prompts: the same greedy tokens and logprobs as the fused attention. gemma3
    has sliding-window layers."""
    loaded = _loaded(tiny_models(arch, head_dim=32) if arch != "gemma3" else tiny_models(arch))
    rng = random.Random(5)
    header = [rng.randrange(3, 200) for _ in range(20)]
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 40))] for _ in range(4)]
    prompts += [header + [rng.randrange(3, 200) for _ in range(n)] for n in (3, 17, 30)]
    prompts.append([rng.randrange(3, 200) for _ in range(90)])  # chunked at 64 tokens a step
    config = {"max_num_batched_tokens": 64}

    monkeypatch.setenv("PIPPIN_PREFILL_ATTENTION", "fused")
    fused = _greedy_logprobs(loaded, prompts, **config)

    monkeypatch.setenv("PIPPIN_PREFILL_ATTENTION", "composed")
    calls = 0
    real = prefill_attention.composed_attention

    def counting(*args: object) -> mx.array:
        nonlocal calls
        calls += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill_attention, "composed_attention", counting)
    composed = _greedy_logprobs(loaded, prompts, **config)
    assert calls > 0
    assert fused.keys() == composed.keys() == {str(i) for i in range(len(prompts))}
    for rid in fused:
        assert [t for t, _ in composed[rid]] == [t for t, _ in fused[rid]], rid
        assert np.allclose(
            [lp for _, lp in composed[rid]], [lp for _, lp in fused[rid]], atol=2e-3
        ), rid
