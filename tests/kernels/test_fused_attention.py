"""The fused decode attention block (`kernels/fused_attention.py`).

Its CUDA kernel runs only on an NVIDIA GPU; there it must equal `reference`, mlx-lm's own
ops. Everywhere else the hook itself (the module swap, the layouts that opt in, the
pools written through the layer's parts) is tested with `reference` standing in.
"""

from __future__ import annotations

import random
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_map
from mlx_lm.models import llama, qwen3
from mlx_lm.models.rope_utils import initialize_rope
from support.engine_runs import greedy_logprobs, loaded_model

from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.kernels import device, fused_attention, paged_attention, patches
from pippin.store.loaded import LoadedModel

on_cuda = device.on_cuda()

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# Logprob agreement between two arithmetics of one float32 model (TF32 is off in tests:
# conftest.py).
TOL = 5e-3


def assert_same_greedy(base: dict[str, list], got: dict[str, list]) -> None:
    """Same greedy tokens with logprobs within TOL, up to a request's first near tie: a
    point where `got` took another token whose logprob under `base` was within 2 TOL of
    the one `base` took (after it the two continuations differ, rightly)."""
    assert got.keys() == base.keys()
    for rid, ref in base.items():
        for (t, lp, _), (t_ref, lp_ref, top_ref) in zip(got[rid], ref):
            if t != t_ref:
                alt = dict(top_ref).get(t)
                assert alt is not None and lp_ref - alt < 2 * TOL, (rid, t, t_ref, top_ref)
                break
            assert abs(lp - lp_ref) < TOL, rid
        else:
            assert len(got[rid]) == len(ref), rid


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """On by default where the paged kernel runs; each test here turns it on explicitly."""
    monkeypatch.setenv("PIPPIN_FUSED_ATTENTION", "1")


def _runner(model: Any, **config: Any) -> Any:
    """The model runner of a small engine on `model` (a path or a loaded model): what it
    fused."""
    loaded = model if isinstance(model, LoadedModel) else loaded_model(model)
    return EngineCore(loaded, EngineConfig(num_blocks=64, **config)).runner


def _kernel_path(monkeypatch: pytest.MonkeyPatch) -> str:
    """Turn the paged kernel on: the CUDA kernels on a GPU, the references elsewhere.
    Returns the name of the fused function that runs."""
    if on_cuda:
        monkeypatch.setenv("PIPPIN_PAGED_KERNEL", "auto")
        return "fused_decode_attention"
    monkeypatch.setattr(paged_attention, "force_reference", True)
    return "reference"


@pytest.mark.parametrize("compiled", ["1", "0"])
@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"rope_scaling": LLAMA3_SCALING}),
        ("llama", {"attention_bias": True}),
        ("qwen3", {}),
    ],
)
def test_engine_decode_fused_matches_unfused(
    tiny_models, arch: str, overrides: dict, compiled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same greedy tokens and logprobs with the attention block fused as without, over
    contexts that cross blocks, in compiled and op-by-op decode steps."""
    monkeypatch.setenv("PIPPIN_COMPILE", compiled)
    loaded = loaded_model(tiny_models(arch, head_dim=32, **overrides))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 40))] for _ in range(6)]
    gens = [rng.randrange(5, 40) for _ in prompts]
    name = _kernel_path(monkeypatch)

    monkeypatch.setenv("PIPPIN_FUSED_ATTENTION", "0")
    base = greedy_logprobs(loaded, prompts, gens, top=2)
    monkeypatch.setenv("PIPPIN_FUSED_ATTENTION", "1")
    calls = 0
    real = getattr(fused_attention, name)

    def counting(*args: object) -> mx.array:
        nonlocal calls
        calls += 1
        return real(*args)

    monkeypatch.setattr(fused_attention, name, counting)
    fused = greedy_logprobs(loaded, prompts, gens, top=2)
    assert calls > 0
    assert_same_greedy(base, fused)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_next"])
def test_not_installed_where_it_does_not_apply(
    tiny_models, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sliding windows and recurrent layers keep mlx-lm's attention."""
    _kernel_path(monkeypatch)
    assert not _runner(tiny_models(arch), block_size=4).fused_attention


def test_not_installed_without_fused_projections(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernel_path(monkeypatch)
    monkeypatch.setenv("PIPPIN_FUSED_PROJ", "0")
    assert not _runner(tiny_models("llama", head_dim=32)).fused_attention
    monkeypatch.setenv("PIPPIN_FUSED_PROJ", "1")
    runner = _runner(tiny_models("llama", head_dim=32))
    assert runner.fused_attention
    assert type(runner.model.model.layers[0].self_attn).__name__ == "FusedLlamaAttention"


@pytest.mark.parametrize(
    "rope",
    [
        nn.RoPE(64, traditional=False, base=10000),
        nn.RoPE(64, traditional=True, base=500000, scale=0.25),
        nn.RoPE(32, traditional=False, base=10000),  # partial rotary: half the head
        initialize_rope(64, 500000.0, False, LLAMA3_SCALING, 131072),
    ],
)
def test_rope_frequencies_match_the_module(rope: nn.Module) -> None:
    got = fused_attention._rope(rope, 64)
    assert got is not None
    dims, trad, inv = got
    x = np.random.default_rng(1).standard_normal((2, 4, 5, 64)).astype(np.float32)
    for off in (0, 1, 999):
        ref = np.array(rope(mx.array(x), offset=off))
        mine = fused_attention._rotate(x, off, np.array(inv, dtype=np.float64), dims, trad)
        assert np.allclose(ref, mine, atol=2e-3)


def test_rope_with_other_arithmetic_is_not_fused() -> None:
    """YaRN scales the rotated dims (mscale): not a pure rotation, so not taken."""
    yarn = initialize_rope(
        64,
        10000.0,
        False,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        256,
    )
    assert fused_attention._rope(yarn, 64) is None


def _attention(kind: str, hq: int, hkv: int, d: int, dtype: mx.Dtype) -> nn.Module:
    """One mlx-lm attention module with random weights and fused q/k/v."""
    common = dict(
        hidden_size=hq * d,
        num_hidden_layers=1,
        intermediate_size=64,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=d,
        rms_norm_eps=1e-5,
        vocab_size=32,
        rope_theta=10000.0,
    )
    if kind == "qwen3":
        attn: nn.Module = qwen3.Attention(
            qwen3.ModelArgs(
                model_type="qwen3",
                max_position_embeddings=4096,
                tie_word_embeddings=True,
                **common,
            )
        )
    else:
        args = llama.ModelArgs(
            model_type="llama",
            rope_scaling=LLAMA3_SCALING if kind == "llama3" else None,
            rope_traditional=kind == "traditional",
            **common,
        )
        attn = llama.Attention(args)
    rng = np.random.default_rng(2)
    attn.update(
        tree_map(
            lambda p: mx.array(rng.standard_normal(p.shape) * 0.3, dtype=dtype), attn.parameters()
        )
    )
    assert patches.fuse_projections(attn) == 1
    assert patches.fuse_attention(attn)
    return attn


class _Layout:
    def __init__(self, tables: mx.array, offsets: mx.array, bs: int, split: bool = False) -> None:
        t = np.array(tables)
        o = np.array(offsets)
        self.gather_blocks, self.offsets, self.block_size = tables, offsets, bs
        self.paged_split = split
        self.write_slots = mx.array(t[np.arange(len(o)), o // bs] * bs + o % bs, dtype=mx.int32)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["llama", "llama3", "traditional", "qwen3"])
@pytest.mark.parametrize("B,hq,hkv,d", [(1, 32, 8, 64), (7, 16, 8, 128), (20, 8, 8, 64)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_kernel_matches_reference(
    kind: str, B: int, hq: int, hkv: int, d: int, dtype: mx.Dtype
) -> None:
    """The output, and the pools after the step: the new keys (normed, rotated) and values
    in their slots, every other slot untouched."""
    _check_against_reference(kind, B, hq, hkv, d, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
@pytest.mark.parametrize("B,hq,hkv,d,max_len", [(1, 32, 8, 128, 16_384), (3, 16, 2, 64, 5_000)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_split_kernel_matches_reference(
    kind: str, B: int, hq: int, hkv: int, d: int, max_len: int, dtype: mx.Dtype
) -> None:
    """Split over a long context: block 0 of each (row, KV head) writes the new token and
    takes the run of chunks that holds it; the parts merge to the unsplit kernel's output
    (the same prologue arithmetic) and to the reference's.

    Against the reference, float32 with `nn.RoPE` is compared only up to 8k positions:
    there the kernel's angle (position x a float32 frequency computed in float64) and MLX's
    own RoPE round differently, by about 1e-3 rad at 16k (the H200 run of 2026-12-03: the
    Qwen3 float32 case at 16k over 2e-4, Llama 3's RoPE, whose frequencies the kernel
    takes from the module, within it)."""
    from test_paged_attention import _case

    assert paged_attention.num_splits(B, hkv, max_len) > 1
    if dtype == mx.bfloat16 or kind == "llama3" or max_len <= 8192:
        _check_against_reference(kind, B, hq, hkv, d, dtype, max_len=max_len, split=True)
    attn = _attention(kind, hq, hkv, d, dtype)
    _, k, v, tables, offsets = _case(B, hq, hkv, d, dtype, max_len=max_len)
    qkv = mx.array(
        np.random.default_rng(3).standard_normal((B, 1, (hq + 2 * hkv) * d)), dtype=dtype
    )
    outs, pools = [], []
    for split in (False, True):
        parts = [k + 0, v + 0]
        mx.eval(parts)
        out = fused_attention.fused_decode_attention(
            attn, qkv, parts, _Layout(tables, offsets, 16, split)
        )
        mx.eval(out, parts)
        outs.append(np.array(out.astype(mx.float32)))
        pools.append([np.array(a.astype(mx.float32)) for a in parts])
    assert np.allclose(outs[0], outs[1], atol=1e-5 if dtype == mx.float32 else 1e-2)
    for unsplit, split_ in zip(*pools):
        assert np.array_equal(unsplit, split_)  # the same new keys and values, once


def _check_against_reference(
    kind: str,
    B: int,
    hq: int,
    hkv: int,
    d: int,
    dtype: mx.Dtype,
    max_len: int = 300,
    split: bool = False,
) -> None:
    from test_paged_attention import _case

    attn = _attention(kind, hq, hkv, d, dtype)
    _, k, v, tables, offsets = _case(B, hq, hkv, d, dtype, max_len=max_len)
    lay = _Layout(tables, offsets, 16, split)
    qkv = mx.array(
        np.random.default_rng(3).standard_normal((B, 1, (hq + 2 * hkv) * d)), dtype=dtype
    )
    ref_parts = [mx.array(k), mx.array(v)]
    ref = fused_attention.reference(attn, qkv, ref_parts, lay)
    parts = [k + 0, v + 0]  # fresh buffers: the kernel writes into them
    mx.eval(parts, ref, ref_parts)
    got = fused_attention.fused_decode_attention(attn, qkv, parts, lay)
    mx.eval(got)
    tol = 3e-2 if dtype == mx.bfloat16 else 2e-4
    assert got.shape == ref.shape == (B, 1, hq * d)
    assert np.allclose(np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32)), atol=tol)
    for mine, theirs in zip(parts, ref_parts):
        a, b = np.array(mine.astype(mx.float32)), np.array(theirs.astype(mx.float32))
        assert np.allclose(a, b, atol=tol)
        slots = np.array(lay.write_slots)
        keep = np.ones(a.shape[1], dtype=bool)
        keep[slots] = False
        assert np.array_equal(a[:, keep], b[:, keep])
