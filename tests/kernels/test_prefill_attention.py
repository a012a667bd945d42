"""Prompt chunks' attention composed of plain ops (`prefill_attention`), the CUDA route
that avoids a cuDNN plan build per shape, against MLX's fused attention.

The route is on by default only on CUDA; `PIPPIN_PREFILL_ATTENTION=composed` forces it
anywhere, which is how these tests run it on CPU."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from support.engine_runs import greedy_logprobs, loaded_model

from pippin.kernels import prefill_attention
from pippin.kernels.config import KernelConfig


@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4), (6, 3)])
@pytest.mark.parametrize("L,S", [(5, 9), (7, 7), (1, 6)])
@pytest.mark.parametrize("mask_kind", ["causal", "none", "bool", "additive"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_composed_matches_fused(
    hq: int, hkv: int, L: int, S: int, mask_kind: str, dtype: mx.Dtype, with_sinks: bool
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
    sinks = mx.array(rng.standard_normal(hq), dtype=dtype) if with_sinks else None
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, sinks=sinks)
    got = prefill_attention.composed_attention(q, k, v, 0.3, mask, sinks=sinks)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    got_np, want_np = (np.array(x.astype(mx.float32)) for x in (got, want))
    assert np.allclose(got_np, want_np, atol=tol)


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("mask_kind", ["causal", "per-row", "shared"])
def test_rows_in_pieces_match_whole(rows: int, mask_kind: str) -> None:
    B, hq, hkv, L, S, D = 5, 4, 2, 6, 10, 16
    rng = np.random.default_rng(rows)
    q, k, v = (
        mx.array(rng.standard_normal(shape), dtype=mx.float32)
        for shape in ((B, hq, L, D), (B, hkv, S, D), (B, hkv, S, D))
    )
    m = rng.random((B if mask_kind == "per-row" else 1, 1, L, S)) > 0.3
    m[..., 0] = True
    mask = "causal" if mask_kind == "causal" else mx.array(m)
    whole = prefill_attention.composed_attention(q, k, v, 0.25, mask)
    pieces = prefill_attention.composed_attention(q, k, v, 0.25, mask, rows)
    assert np.allclose(np.array(pieces), np.array(whole), atol=1e-6)


def test_route_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    def rows(B: int, L: int, S: int, mode: str = "auto") -> int:
        q, k = mx.zeros((B, 32, L, 1)), mx.zeros((B, 8, S, 1))
        return prefill_attention.composed_rows(q, k, mode)

    monkeypatch.setattr(prefill_attention, "on_cuda", lambda: True)
    assert prefill_attention.wanted("auto")
    assert rows(16, 512, 528) == 16  # 16 prompts of 512 tokens: one piece
    assert rows(6, 1692, 1696) == 2  # 92M score elements a row: two rows a piece
    assert rows(1, 4096, 4096) == 0  # a long prompt's row alone is over: cuDNN
    assert rows(4, 1, 512) == 0  # decode
    assert not prefill_attention.wanted("fused")
    assert rows(16, 512, 528, "fused") == 0
    assert rows(1, 4096, 4096, "composed") == 1
    monkeypatch.setattr(prefill_attention, "on_cuda", lambda: False)
    assert not prefill_attention.wanted("auto")  # Metal and CPU build nothing per shape
    assert rows(16, 512, 528) == 0
    # The switch is read from the environment once, into the engine's config.
    monkeypatch.setenv("PIPPIN_PREFILL_ATTENTION", "composed")
    assert KernelConfig.from_env().prefill_attention == "composed"


@pytest.mark.parametrize("route", ["composed", "pieces"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3_next"])
def test_engine_outputs_match_with_composed_prefill(
    tiny_models, arch: str, route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh prompts batched together, prompts after a cached prefix (array masks), and
    chunked prompts: the same greedy tokens and logprobs as the fused attention. gemma3
    has sliding-window layers; qwen3_next recurrent ones (its prompts go one a call).
    `pieces`: the CUDA default's policy with a budget small enough that batches of rows
    go in pieces, and the longest rows to the fused kernel."""
    loaded = loaded_model(tiny_models(arch, head_dim=32) if arch != "gemma3" else tiny_models(arch))
    rng = random.Random(5)
    header = [rng.randrange(3, 200) for _ in range(20)]
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 40))] for _ in range(4)]
    prompts += [header + [rng.randrange(3, 200) for _ in range(n)] for n in (3, 17, 30)]
    prompts.append([rng.randrange(3, 200) for _ in range(90)])  # chunked at 64 tokens a step
    prompts += [[rng.randrange(3, 200) for _ in range(rng.randrange(5, 8))] for _ in range(6)]
    config = {"max_num_batched_tokens": 64}
    monkeypatch.setenv("PIPPIN_CPU_PREFILL", "0")  # on the CPU it would take the chunks first
    monkeypatch.setenv("PIPPIN_PREFILL_ATTENTION", "fused")
    fused = greedy_logprobs(loaded, prompts, **config)

    if route == "pieces":
        monkeypatch.delenv("PIPPIN_PREFILL_ATTENTION")
        monkeypatch.setattr(prefill_attention, "on_cuda", lambda: True)
        # 4 query heads: rows of up to 7 tokens go two a piece, longer ones to the fused kernel.
        monkeypatch.setattr(prefill_attention, "SCORES_BUDGET", 2 * 4 * 7 * 7)
    else:
        monkeypatch.setenv("PIPPIN_PREFILL_ATTENTION", "composed")
    calls, split = 0, 0
    real = prefill_attention.composed_attention

    def counting(*args: object) -> mx.array:
        nonlocal calls, split
        calls += 1
        split += args[5] < args[0].shape[0]  # type: ignore[operator,attr-defined]
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(prefill_attention, "composed_attention", counting)
    composed = greedy_logprobs(loaded, prompts, **config)
    assert calls > 0
    # Recurrent models prefill one row a call: nothing to split.
    assert (split > 0) == (route == "pieces" and arch != "qwen3_next")
    assert fused.keys() == composed.keys() == {str(i) for i in range(len(prompts))}
    for rid in fused:
        assert [t for t, _ in composed[rid]] == [t for t, _ in fused[rid]], rid
        assert np.allclose(
            [lp for _, lp in composed[rid]], [lp for _, lp in fused[rid]], atol=2e-3
        ), rid
