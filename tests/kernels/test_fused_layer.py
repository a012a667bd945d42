"""The fused decode layer (`kernels/fused_layer.py`).

Its CUDA kernel runs only on an NVIDIA GPU; there it must equal `reference_gemv`, MLX's
own ops. Everywhere else the hook (the layer swap, which weights each projection reads,
the residuals) is tested with the references standing in.
"""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support.engine_runs import greedy_logprobs, loaded_model
from test_fused_attention import (
    LLAMA3_SCALING,
    _kernel_path,
    _runner,
    assert_same_greedy,
)

from pippin.kernels import fused_layer
from pippin.store.loaded import LoadedModel


@pytest.fixture(autouse=True)
def _fused_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPPIN_FUSED_ATTENTION", "1")
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "all")  # every projection as the kernel


def _prompts(seed: int, count: int, longest: int, most: int) -> tuple[list[list[int]], list[int]]:
    """`count` random prompts of 2 to `longest` tokens and each one's max_tokens, 5 to
    `most`."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, 200) for _ in range(rng.randrange(2, longest))] for _ in range(count)
    ]
    return prompts, [rng.randrange(5, most) for _ in prompts]


@pytest.mark.parametrize("compiled", ["1", "0"])
@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("llama", {}),
        ("llama", {"rope_scaling": LLAMA3_SCALING, "attention_bias": True}),
        ("qwen3", {}),
    ],
)
def test_engine_decode_fused_layer_matches_unfused(
    tiny_models, arch: str, overrides: dict, compiled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same greedy tokens and logprobs with the layers fused as without, for batches
    small enough to take them and batches too large to."""
    monkeypatch.setenv("PIPPIN_COMPILE", compiled)
    loaded = loaded_model(tiny_models(arch, head_dim=32, **overrides))
    prompts, gens = _prompts(0, 12, 40, 40)
    name = "gemv" if _kernel_path(monkeypatch) == "fused_decode_attention" else "reference_gemv"

    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "0")
    base = greedy_logprobs(loaded, prompts, gens, top=2)
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "all")
    rows: list[int] = []
    real = getattr(fused_layer, name)

    def counting(p: fused_layer.Gemv, x: mx.array, res: mx.array | None = None) -> mx.array:
        rows.append(x.shape[0])
        return real(p, x, res)

    monkeypatch.setattr(fused_layer, name, counting)
    fused = greedy_logprobs(loaded, prompts, gens, top=2)
    assert rows and max(rows) <= fused_layer.MAX_ROWS
    assert_same_greedy(base, fused)


def test_installed_on_every_layer(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_path(monkeypatch)
    runner = _runner(tiny_models("qwen3", head_dim=32))
    assert runner.fused_layer
    layers = runner.model.model.layers
    assert all(type(m).__name__ == "FusedQwen3TransformerBlock" for m in layers)
    plan = layers[0]._pippin_plan
    assert plan.gate_up.swiglu and plan.qkv.norm is layers[0].input_layernorm
    assert plan.down.weight is layers[0].mlp.down_proj.weight


def test_not_installed_without_fused_attention(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernel_path(monkeypatch)
    monkeypatch.setenv("PIPPIN_FUSED_ATTENTION", "0")
    assert not _runner(tiny_models("llama", head_dim=32)).fused_layer


def _quantised(tiny_models, bits: int = 4, only_mlp: bool = False) -> LoadedModel:
    """A tiny Llama, affine-quantised with bf16 scales, in widths the quantised kernels
    take (K a multiple of 128)."""
    path = tiny_models(
        "llama", head_dim=32, hidden_size=128, intermediate_size=256, num_attention_heads=4
    )
    loaded = loaded_model(path)

    def mlp(name: str, m: nn.Module) -> bool:
        return isinstance(m, nn.Linear) and ".mlp." in name

    nn.quantize(loaded.model, group_size=64, bits=bits, class_predicate=mlp if only_mlp else None)
    loaded.model.set_dtype(mx.bfloat16)
    return loaded


def test_installed_on_quantised_weights(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    """Quantised layers take the same five steps when asked, every projection as the
    quantised kernel with `all`; by default (`QUANT_KERNELS`: none) mlx-lm's layer."""
    _kernel_path(monkeypatch)
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "1")
    assert not _runner(_quantised(tiny_models)).fused_layer
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "all")
    runner = _runner(_quantised(tiny_models))
    assert runner.fused_layer
    layer = runner.model.model.layers[0]
    plan = layer._pippin_plan
    assert plan.quantised and plan.dtype == mx.bfloat16
    assert plan.down.quant is layer.mlp.down_proj and plan.o.quant is layer.self_attn.o_proj
    assert plan.gate_up.swiglu and plan.gate_up.quant is layer.mlp.gate_proj.shared.fused
    assert plan.qkv.in_features == 128 and plan.down.in_features == 256
    assert [p.kernel_rows for p, _ in plan.steps()] == [fused_layer.QUANT_MAX_ROWS] * 4
    assert runner.fused_rows == fused_layer.QUANT_MAX_ROWS == 16


def test_plain_layers_cap_the_kernel_at_their_rows(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`all` asks every projection for 16 rows; the plain weights' kernel takes 8."""
    _kernel_path(monkeypatch)
    runner = _runner(tiny_models("llama", head_dim=32))
    plan = runner.model.model.layers[0]._pippin_plan
    assert [p.kernel_rows for p, _ in plan.steps()] == [fused_layer.MAX_ROWS] * 4
    assert runner.fused_rows == fused_layer.MAX_ROWS


def test_rows_beyond_the_kernels_are_refused() -> None:
    assert fused_layer.projections("qkv:16/o") == {"qkv": 16, "o": 16}
    with pytest.raises(ValueError, match="rows must be 1 to 16"):
        fused_layer.projections("down:17")


def test_not_installed_on_partly_quantised_layers(
    tiny_models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer with quantised and plain projections keeps mlx-lm's layer."""
    _kernel_path(monkeypatch)
    assert not _runner(_quantised(tiny_models, only_mlp=True)).fused_layer


@pytest.mark.parametrize("bits", [4, 8])
def test_engine_decode_quantised_fused_layer_matches_unfused(
    tiny_models, bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quantised form: the same greedy tokens and logprobs fused as not, the decode
    rows through the fused projections (on CUDA `quant_matvec.fused`, elsewhere the
    layer's own product with the norm, SwiGLU and residual around it)."""
    loaded = _quantised(tiny_models, bits)
    name = "gemv" if _kernel_path(monkeypatch) == "fused_decode_attention" else "reference_gemv"
    # 14 at once: decode batches of 9-16 rows too (the matvec form's second operand).
    prompts, gens = _prompts(1, 14, 30, 30)
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "0")
    base = greedy_logprobs(loaded, prompts, gens, top=2)
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "all")
    seen: list[tuple[int, bool]] = []
    real = getattr(fused_layer, name)

    def counting(p: fused_layer.Gemv, x: mx.array, res: mx.array | None = None) -> mx.array:
        seen.append((x.shape[0], p.quant is not None))
        return real(p, x, res)

    monkeypatch.setattr(fused_layer, name, counting)
    fused = greedy_logprobs(loaded, prompts, gens, top=2)
    assert seen and all(quant for _, quant in seen)
    assert fused_layer.MAX_ROWS < max(rows for rows, _ in seen) <= fused_layer.QUANT_MAX_ROWS
    assert_same_greedy(base, fused)


@pytest.mark.cuda
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("K,N", [(64, 96), (256, 40), (1024, 512)])
@pytest.mark.parametrize(
    "norm,swiglu,bias,res",
    [
        (True, False, False, False),
        (True, False, True, False),
        (False, False, True, True),
        (False, False, False, True),
        (True, True, False, False),
    ],
)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_kernel_matches_reference(
    B: int, K: int, N: int, norm: bool, swiglu: bool, bias: bool, res: bool, dtype: mx.Dtype
) -> None:
    rng = np.random.default_rng(B * K + N)
    rows = 2 * N if swiglu else N

    def arr(*shape: int, scale: float = 1.0) -> mx.array:
        return mx.array(rng.standard_normal(shape) * scale, dtype=dtype)

    rms = nn.RMSNorm(K, eps=1e-5)
    rms.weight = arr(K, scale=0.5) + 1
    p = fused_layer.Gemv(
        arr(rows, K, scale=K**-0.5), arr(rows) if bias else None, rms if norm else None, swiglu
    )
    x = arr(B, K, scale=3.0)
    r = arr(B, N) if res else None
    with mx.stream(mx.cpu):  # exact float32 products (cuBLAS may round them through TF32)
        ref = fused_layer.reference_gemv(p, x, r)
        mx.eval(ref)
    got = fused_layer.gemv(p, x, r)
    assert got.shape == ref.shape == (B, N) and got.dtype == dtype
    a, b = np.array(got.astype(mx.float32)), np.array(ref.astype(mx.float32))
    tol = 3e-2 if dtype == mx.bfloat16 else 1e-4
    assert np.allclose(a, b, atol=tol, rtol=tol), np.abs(a - b).max()


def test_some_projections_as_mlx_ops(tiny_models, monkeypatch: pytest.MonkeyPatch) -> None:
    """PIPPIN_FUSED_LAYER=qkv/down: those two as the kernel, the output projection and
    gate/up as MLX's ops (to compare them on a GPU): the same greedy decode. `gate_up:1`
    runs gate/up as the kernel for a lone row only. By default down is the kernel, and
    gate/up for one row. A bad name or row count is refused when the engine starts."""
    _kernel_path(monkeypatch)
    loaded = loaded_model(tiny_models("llama", head_dim=32))
    prompts, gens = _prompts(1, 5, 30, 25)
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "0")
    base = greedy_logprobs(loaded, prompts, gens, top=2)
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "qkv/down")
    assert_same_greedy(base, greedy_logprobs(loaded, prompts, gens, top=2))
    plan = _runner(loaded).model.model.layers[0]._pippin_plan
    assert [p.kernel_rows for p, _ in plan.steps()] == [8, 0, 0, 8]

    # Which rows each projection runs as the kernel for (the reference stands in off CUDA).
    seen: list[tuple[bool, int]] = []
    real = fused_layer.as_kernel

    def counting(p: fused_layer.Gemv, x: mx.array, res: mx.array | None = None) -> mx.array:
        seen.append((p.swiglu, x.shape[0]))
        return real(p, x, res)

    monkeypatch.setattr(fused_layer, "as_kernel", counting)
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "gate_up:1/down")
    assert_same_greedy(base, greedy_logprobs(loaded, prompts, gens, top=2))
    gate_up_rows = {rows for swiglu, rows in seen if swiglu}
    down_rows = {rows for swiglu, rows in seen if not swiglu}
    assert gate_up_rows == {1}, gate_up_rows
    assert max(down_rows) > 1, down_rows  # batches of several rows ran, down as the kernel

    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "1")
    plan = _runner(loaded).model.model.layers[0]._pippin_plan
    assert [p.kernel_rows for p, _ in plan.steps()] == [0, 0, 1, 8]
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "qkv/attn")
    with pytest.raises(ValueError, match=r"unknown projection 'attn'"):
        _runner(loaded)
    for bad in ("down:0", "down:17", "down:x"):  # 9-16: quantised layers' rows
        monkeypatch.setenv("PIPPIN_FUSED_LAYER", bad)
        with pytest.raises(ValueError, match=r"rows must be 1 to 16"):
            _runner(loaded)


@pytest.mark.cuda
@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("bits,K,N", [(4, 1024, 200), (8, 256, 96), (4, 4096, 1024)])
@pytest.mark.parametrize(
    "norm,swiglu,bias,res",
    [
        (True, False, True, False),
        (False, False, True, True),
        (False, False, False, True),
        (True, True, False, False),
    ],
)
def test_quantised_kernel_matches_reference(
    B: int, bits: int, K: int, N: int, norm: bool, swiglu: bool, bias: bool, res: bool
) -> None:
    """`quant_matvec.fused` against MLX's ops around the layer's quantised product, in
    float32 (MLX's bf16 quantised product on the CPU is itself 5-15% off at these widths)."""
    rng = np.random.default_rng(B * K + N + bits)
    dtype = mx.bfloat16

    def arr(*shape: int, scale: float = 1.0) -> mx.array:
        return mx.array(rng.standard_normal(shape) * scale, dtype=dtype)

    rows = 2 * N if swiglu else N
    lin = nn.QuantizedLinear.from_linear(nn.Linear(K, rows, bias=bias), group_size=64, bits=bits)
    lin.set_dtype(dtype)
    rms = nn.RMSNorm(K, eps=1e-5)
    rms.weight = arr(K, scale=0.5) + 1
    p = fused_layer.Gemv(lin.weight, None, rms if norm else None, swiglu, quant=lin)
    x = arr(B, K, scale=3.0)
    r = arr(B, N) if res else None
    lin32 = nn.QuantizedLinear(K, rows, bias=bias, group_size=64, bits=bits)
    lin32.update(lin.parameters())
    lin32.set_dtype(mx.float32)
    rms32 = nn.RMSNorm(K, eps=1e-5)
    rms32.weight = rms.weight.astype(mx.float32)
    p32 = fused_layer.Gemv(lin32.weight, None, rms32 if norm else None, swiglu, quant=lin32)
    with mx.stream(mx.cpu):
        f32 = (a.astype(mx.float32) if a is not None else None for a in (x, r))
        ref = fused_layer.reference_gemv(p32, *f32)
        mx.eval(ref)
    got = fused_layer.gemv(p, x, r)
    assert got.shape == ref.shape == (B, N) and got.dtype == dtype
    a, b = np.array(got.astype(mx.float32)), np.array(ref)
    assert np.abs(a - b).max() <= 0.02 * np.abs(b).max() + 0.02, np.abs(a - b).max()
