"""The gated delta rule off Metal (`kernels.gated_delta`): the chunked numpy form (the
CPU's) and the CUDA kernel against mlx-lm's step-per-token ops, for scalar and vector
gates, GQA, with and without an initial state, padding masks, at and around the chunk
size; the routing in and out of mlx-lm's modules; and the engine's greedy tokens on the
tiny Qwen3-Next against mlx-lm's generation.

On a GPU: `pytest -m cuda tests/kernels/test_gated_delta.py`."""

from __future__ import annotations

import random
import sys
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import gated_delta as mlx_gd
from mlx_lm.utils import load
from support.engine_runs import agrees, loaded_model, mlx_lm_reference, run_to_end

from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.engine.types import SamplingParams
from pippin.kernels import cpu_prefill, gated_delta, patches
from pippin.kernels.config import KernelConfig

C = gated_delta.CHUNK
LENGTHS = [1, C - 1, C, C + 1, 3 * C + 5]


def _inputs(
    T: int,
    *,
    B: int = 2,
    hk: int = 2,
    hv: int = 4,
    dk: int = 32,
    dv: int = 16,
    vector: bool = False,
    state: bool = True,
    dtype: mx.Dtype = mx.float32,
    decay: float = 1.0,
    seed: int = 0,
) -> dict[str, Any]:
    """mlx-lm's `gated_delta_update` arguments, q and k normalised as the models do;
    `decay` scales the gates' log (strong: whole chunks decay to nothing)."""
    rng = np.random.default_rng(seed)

    def arr(*shape: int, scale: float = 1.0, dt: mx.Dtype = dtype) -> mx.array:
        return mx.array(rng.standard_normal(shape) * scale, dtype=dt)

    q, k = mlx_gd.normalize_qk(arr(B, T, hk, dk), arr(B, T, hk, dk), inv_scale=dk**-0.5, eps=1e-6)
    gate = (B, T, hv, dk) if vector else (B, T, hv)
    A_log = mx.array(rng.uniform(-1, 1, (hv, 1) if vector else (hv,)) + np.log(decay), mx.float32)
    return {
        "q": q,
        "k": k,
        "v": arr(B, T, hv, dv),
        "a": arr(*gate),
        "b": arr(B, T, hv),
        "A_log": A_log,
        "dt_bias": arr(*((hv, dk) if vector else (hv,))),
        "state": arr(B, hv, dv, dk, scale=0.3, dt=mx.float32) if state else None,
    }


def _reference(args: dict[str, Any], mask: mx.array | None = None, **kw: Any) -> tuple:
    """mlx-lm's ops path (a step a token), whatever the device."""
    return mlx_gd.gated_delta_update(**args, mask=mask, use_kernel=False, **kw)


def _close(got: tuple, want: tuple, dtype: mx.Dtype, keep: np.ndarray | None = None) -> None:
    y, s = (np.array(x.astype(mx.float32)) for x in got)
    y_ref, s_ref = (np.array(x.astype(mx.float32)) for x in want)
    assert got[0].dtype == want[0].dtype and got[1].dtype == mx.float32
    assert y.shape == y_ref.shape and s.shape == s_ref.shape
    if keep is not None:  # the ops path's y at a masked position is unused garbage
        assert not y[~keep].any()
        y, y_ref = y[keep], y_ref[keep]
    # From bfloat16 inputs mlx-lm computes softplus(a + dt_bias) in bfloat16 (pippin in
    # float32), and y is rounded to bfloat16 from sums in another order.
    tol = 2e-5 if dtype == mx.float32 else 1e-2
    assert np.allclose(y, y_ref, atol=tol, rtol=tol), np.abs(y - y_ref).max()
    assert np.allclose(s, s_ref, atol=tol, rtol=5 * tol), np.abs(s - s_ref).max()


def _padded_mask(B: int, T: int) -> np.ndarray:
    """Right padding: row 0 full, each later row shorter."""
    keep = np.ones((B, T), dtype=bool)
    for b in range(1, B):
        keep[b, T - (b * T) // (B + 1) :] = False
    return keep


# --- the CPU's chunked form ---------------------------------------------------------


@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
@pytest.mark.parametrize("state", [False, True], ids=["zero state", "state"])
def test_chunked_matches_mlx_ops(T: int, vector: bool, state: bool) -> None:
    args = _inputs(T, vector=vector, state=state)
    _close(gated_delta.update(**args), _reference(args), mx.float32)


@pytest.mark.parametrize("hk,hv", [(1, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
def test_chunked_heads(hk: int, hv: int, vector: bool) -> None:
    """GQA (a key head serves several value heads) and none; Dk != Dv."""
    args = _inputs(C + 9, hk=hk, hv=hv, dk=48, dv=24, vector=vector)
    _close(gated_delta.update(**args), _reference(args), mx.float32)


@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
def test_chunked_bfloat16(vector: bool) -> None:
    args = _inputs(2 * C + 3, vector=vector, dtype=mx.bfloat16)
    _close(gated_delta.update(**args), _reference(args), mx.bfloat16)


@pytest.mark.parametrize("decay", [3.0, 20.0, 1e3], ids=["mixed", "strong", "total"])
@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
def test_chunked_strong_decays(decay: float, vector: bool) -> None:
    """Gates that empty the state within a few tokens (some all the way to 0): no NaN,
    and the decays below float32's range flush to 0 as the ops path's products do.
    `mixed`: vector gates' blocks both within `_SPAN` and past it."""
    args = _inputs(2 * C + 7, vector=vector, decay=decay)
    got = gated_delta.update(**args)
    assert all(np.isfinite(np.array(x)).all() for x in got)
    _close(got, _reference(args), mx.float32)


@pytest.mark.parametrize("kw", [{"lower_bound": -5.0}, {"allow_neg_eigval": True}])
@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
def test_chunked_gate_options(kw: dict[str, Any], vector: bool) -> None:
    """Kimi's bounded gates, OLMo-hybrid's beta in [0, 2]."""
    args = _inputs(C + 3, vector=vector)
    _close(gated_delta.update(**args, **kw), _reference(args, **kw), mx.float32)


@pytest.mark.parametrize("T", [C - 1, C + 1, 3 * C + 5])
@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
def test_chunked_padding_mask(T: int, vector: bool) -> None:
    """Right-padded rows: the valid positions as mlx-lm computes them, 0 at the padding,
    and each padded row's state the one its unpadded prompt leaves."""
    B = 3
    args = _inputs(T, B=B, vector=vector)
    keep = _padded_mask(B, T)
    mask = mx.array(keep)
    got = gated_delta.update(**args, mask=mask)
    _close(got, _reference(args, mask), mx.float32, keep)
    for b in range(1, B):
        n = int(keep[b].sum())
        alone = {k: args[k][b : b + 1, :n] for k in ("q", "k", "v", "a", "b")}
        state = None if args["state"] is None else args["state"][b : b + 1]
        alone |= {"A_log": args["A_log"], "dt_bias": args["dt_bias"], "state": state}
        _, s_alone = gated_delta.update(**alone)
        assert np.allclose(np.array(got[1][b]), np.array(s_alone[0]), atol=1e-5, rtol=1e-4)


def test_unit_lower_solve_is_stable() -> None:
    """The blocked substitution where a 64 x 64 system is nearly singular-looking (equal
    keys, beta 1: every entry below the diagonal 1): its inverse is bidiagonal."""
    a = np.tril(np.ones((2, C, C), dtype=np.float32), -1)
    rhs = np.random.default_rng(0).standard_normal((2, C, 8)).astype(np.float32)
    x = gated_delta._unit_lower_solve(a, rhs)
    want = np.linalg.solve(np.tril(np.ones((C, C))), rhs.astype(np.float64))
    assert np.allclose(x, want, atol=1e-4)


# --- routing ------------------------------------------------------------------------


def test_routed_takes_prompt_chunks_in_the_runner_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def original(*args: Any, **kw: Any) -> tuple:
        seen.append(f"mlx-lm {args[0].shape[1]}")
        return mlx_gd.gated_delta_update(*args, **kw)

    real = gated_delta.update

    def update(*args: Any, **kw: Any) -> tuple:
        seen.append(f"pippin {args[0].shape[1]}")
        return real(*args, **kw)

    monkeypatch.setattr(gated_delta, "update", update)
    monkeypatch.setattr(gated_delta, "kernel_applies", lambda q: False)  # as on the CPU
    routed = gated_delta.routed(original, on_host=True)
    short, long = (_inputs(T) for T in (gated_delta.MIN_TOKENS - 1, gated_delta.MIN_TOKENS))
    routed(**long)  # mlx-lm's own callers: untouched
    with cpu_prefill.in_runner():
        routed(**short)  # decode, short verifies
        routed(**long)
        routed(**long, use_kernel=False)  # training: mlx-lm's
    n = gated_delta.MIN_TOKENS
    assert seen == [f"mlx-lm {n}", f"mlx-lm {n - 1}", f"pippin {n}", f"mlx-lm {n}"]


def _bound(model: Any) -> Any:
    return sys.modules[type(model).__module__].gated_delta_update


def test_route_applied_and_undone(tiny_models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    model = loaded_model(tiny_models("qwen3_next")).model
    # The routing is per mlx-lm module: an earlier engine in this process may have left it.
    patches.undo(model)
    assert _bound(model) is mlx_gd.gated_delta_update
    on = KernelConfig(cpu_prefill="1")
    patches.apply(model, on, {}, {}, None)
    assert getattr(_bound(model), "_pippin_original", None) is mlx_gd.gated_delta_update
    patches.apply(model, on, {}, {}, None)  # again: wrapped once, not twice
    assert getattr(_bound(model), "_pippin_original", None) is mlx_gd.gated_delta_update
    patches.undo(model)
    assert _bound(model) is mlx_gd.gated_delta_update
    for off in (
        KernelConfig(enabled=False, cpu_prefill="1"),
        KernelConfig(gated_delta=False, cpu_prefill="1"),
    ):
        patches.apply(model, on, {}, {}, None)
        patches.apply(model, off, {}, {}, None)  # the switch also takes an earlier one back
        assert _bound(model) is mlx_gd.gated_delta_update
    monkeypatch.setenv("PIPPIN_GATED_DELTA", "0")
    assert not KernelConfig.from_env().gated_delta


# --- the engine ---------------------------------------------------------------------


def _engine_matches_mlx_lm(tiny_models: Any, monkeypatch: pytest.MonkeyPatch, fn: str) -> None:
    """Prompts in one padded batch (masks) and chunked at 48 tokens a step (the state
    carried between calls), each over the chunk size: the greedy tokens of mlx-lm's own
    generation (a second, unrouted copy), through `gated_delta.<fn>`."""
    path = tiny_models("qwen3_next")
    loaded, (reference, _) = loaded_model(path), load(str(path))
    calls = {"n": 0}
    real = getattr(gated_delta, fn)

    def counted(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kw)

    monkeypatch.setattr(gated_delta, fn, counted)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (20, C + 1, 2 * C + 30)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for budget in (512, 48):
        config = EngineConfig(
            num_blocks=400, block_size=4, max_model_len=512, max_num_batched_tokens=budget
        )
        core = EngineCore(loaded, config)
        for i, p in enumerate(prompts):
            core.add_request(str(i), p, params)
        got = run_to_end(core)
        for i, p in enumerate(prompts):
            ref, gaps = mlx_lm_reference(reference, p, 12)
            assert agrees(got[str(i)]["ids"][0], ref, gaps), (budget, i)
    assert calls["n"] > 0


def test_engine_matches_mlx_lm(tiny_models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (or any host with PIPPIN_CPU_PREFILL=1): the chunked form."""
    if gated_delta.kernel_applies(mx.zeros((1, 1, 1, 32))):
        pytest.skip("on CUDA the kernel takes every call: test_engine_matches_mlx_lm_cuda")
    monkeypatch.setenv("PIPPIN_CPU_PREFILL", "1")
    _engine_matches_mlx_lm(tiny_models, monkeypatch, "chunked")


# --- CUDA ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("T", LENGTHS)
@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
@pytest.mark.parametrize("state", [False, True], ids=["zero state", "state"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_cuda_matches_mlx_ops(T: int, vector: bool, state: bool, dtype: mx.Dtype) -> None:
    args = _inputs(T, vector=vector, state=state, dtype=dtype, dk=128, dv=128, hk=2, hv=4)
    assert gated_delta.kernel_applies(args["q"])
    _close(gated_delta.update(**args), _reference(args), dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("T", [1, C + 1, 3 * C + 5])
@pytest.mark.parametrize("vector", [False, True], ids=["scalar", "vector"])
def test_cuda_padding_mask_and_heads(T: int, vector: bool) -> None:
    """Right padding (state kept, y 0 at the padding), GQA 1:4, Dk 64 != Dv 32, a value
    dim that leaves a thread block's last warp idle (Dv 30), strong decays."""
    for kw in ({"hk": 1, "hv": 4, "dk": 64, "dv": 32}, {"dv": 30, "decay": 20.0}):
        args = _inputs(T, B=3, vector=vector, **kw)  # type: ignore[arg-type]
        keep = _padded_mask(3, T)
        mask = mx.array(keep)
        _close(gated_delta.update(**args, mask=mask), _reference(args, mask), mx.float32, keep)


@pytest.mark.cuda
def test_engine_matches_mlx_lm_cuda(tiny_models: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _engine_matches_mlx_lm(tiny_models, monkeypatch, "cuda_recurrence")
