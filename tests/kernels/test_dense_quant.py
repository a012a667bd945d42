"""Quantised layers run prompt chunks as a dense product of the unpacked weight
(`kernels.dense_quant`, installed by `patches.quantised_products`): the same logits as
MLX's quantised matmul within rounding, decode rows untouched, and `undo` takes it back."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from support.engine_runs import greedy_logprobs, loaded_model, random_prompts

from pippin.kernels import dense_quant, patches
from pippin.kernels.config import KernelConfig


def _dense(**kw: str | int) -> KernelConfig:
    """The dense path alone: pippin's CUDA kernel off, so few rows take MLX's product."""
    return KernelConfig(quant_kernel="0", **kw)  # type: ignore[arg-type]


OFF = _dense(dense_quant="0")


def _quantised(bits: int, bias: bool, dtype: mx.Dtype) -> nn.QuantizedLinear:
    mx.random.seed(bits)
    lin = nn.Linear(128, 192, bias=bias)
    lin.set_dtype(dtype)
    return nn.QuantizedLinear.from_linear(lin, group_size=64, bits=bits)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_product_matches_the_quantised_one(bits: int, bias: bool) -> None:
    q = _quantised(bits, bias, mx.float32)
    x = mx.random.normal((3, 17, 128))
    # float32: the unpacked weight is the quantised values exactly; only summation order differs.
    assert np.allclose(np.array(dense_quant.dense(q, x)), np.array(q(x)), atol=1e-4)
    # bf16: as far from the exact product (float32) as MLX's quantised matmul is, give or
    # take the rounding of the unpacked weight.
    qb = _quantised(bits, bias, mx.bfloat16)
    xb = x.astype(mx.bfloat16)
    exact = np.array(_as_float32(qb)(xb.astype(mx.float32)))
    dense_err = np.abs(np.array(dense_quant.dense(qb, xb).astype(mx.float32)) - exact).max()
    quant_err = np.abs(np.array(qb(xb).astype(mx.float32)) - exact).max()
    assert dense_err <= 2 * quant_err + 0.01 * np.abs(exact).max()


def _as_float32(q: nn.QuantizedLinear) -> nn.QuantizedLinear:
    """`q` with float32 scales, biases and bias: the same quantised values, exact sums."""
    out = nn.QuantizedLinear(
        q.weight.shape[1] * 32 // q.bits, q.weight.shape[0], "bias" in q, q.group_size, q.bits
    )
    out.update({k: v.astype(mx.float32) if v.dtype != mx.uint32 else v for k, v in q.items()})
    return out


def _quantised_model(tiny_models, bits: int = 4):  # type: ignore[no-untyped-def]
    loaded = loaded_model(tiny_models("llama"))
    nn.quantize(loaded.model, group_size=64, bits=bits)
    mx.eval(loaded.model.parameters())
    return loaded


def _tokens(model: nn.Module, n: int) -> mx.array:
    return mx.random.randint(3, model.args.vocab_size, (1, n), key=mx.random.key(n))


def _dense_layers(model: nn.Module) -> int:
    return sum(
        isinstance(m, dense_quant.subclass("_pippin_base")) for _, m in model.named_modules()
    )


def test_patched_model_gives_the_same_logits_and_undo_restores_it(tiny_models) -> None:
    loaded = _quantised_model(tiny_models)
    model = loaded.model
    tokens = _tokens(model, 12)
    before = np.array(model(tokens))

    # Few rows (decode): MLX's quantised product untouched, bit for bit.
    patched = patches.apply(model, _dense(dense_quant="1", dense_quant_rows=13), {}, {}, None)
    assert patched.dense_quant == _dense_layers(model) > 0
    assert np.array_equal(np.array(model(tokens)), before)
    patches.undo(model)

    # Many rows (a prompt chunk): the dense product, the same logits within rounding.
    patched = patches.apply(model, _dense(dense_quant="1", dense_quant_rows=12), {}, {}, None)
    assert patched.dense_quant > 0
    assert np.allclose(np.array(model(tokens)), before, atol=1e-4)
    patches.undo(model)
    assert _dense_layers(model) == 0
    assert not any(hasattr(m, dense_quant.ROWS_ATTR) for _, m in model.named_modules())
    assert np.array_equal(np.array(model(tokens)), before)

    # The one switch: nothing changed at all.
    assert patches.apply(model, KernelConfig(enabled=False), {}, {}, None).dense_quant == 0
    assert _dense_layers(model) == 0


@pytest.mark.parametrize("bits", [4, 8])
def test_engine_decodes_the_same_with_dense_prompt_chunks(tiny_models, bits: int) -> None:
    loaded = _quantised_model(tiny_models, bits)
    prompts = random_prompts(loaded.model.args.vocab_size, 3, seed=5)
    # Chunks of up to 48 rows take the dense product, decode steps (3 rows) the quantised one.
    run = dict(max_num_batched_tokens=48)
    off = greedy_logprobs(loaded, prompts, kernels=OFF, **run)
    assert _dense_layers(loaded.model) == 0
    on = greedy_logprobs(
        loaded, prompts, kernels=_dense(dense_quant="1", dense_quant_rows=4), **run
    )
    assert _dense_layers(loaded.model) > 0
    assert off.keys() == on.keys()
    for rid in off:
        assert [t for t, _ in on[rid]] == [t for t, _ in off[rid]]
        assert np.allclose([lp for _, lp in on[rid]], [lp for _, lp in off[rid]], atol=1e-3)
    patches.undo(loaded.model)


@pytest.mark.cuda
def test_auto_is_on_on_cuda_and_as_close_to_exact_in_bf16(tiny_models) -> None:
    loaded = _quantised_model(tiny_models)
    model = loaded.model
    model.set_dtype(mx.bfloat16)  # the scales and biases, as mlx-community ships them
    tokens = _tokens(model, 64)
    model.set_dtype(mx.float32)  # the same quantised values, float32 arithmetic
    exact = np.array(model(tokens))
    model.set_dtype(mx.bfloat16)
    quantised = np.array(model(tokens).astype(mx.float32))
    kernels = _dense(dense_quant="auto", dense_quant_rows=16)
    assert patches.apply(model, kernels, {}, {}, None).dense_quant > 0
    dense = np.array(model(tokens).astype(mx.float32))
    patches.undo(model)
    # bf16 rounding moves both paths off the exact logits; the dense one no further.
    quant_err, dense_err = (np.abs(y - exact).max() for y in (quantised, dense))
    assert dense_err <= 1.5 * quant_err + 0.01 * np.abs(exact).max()
    top = exact.argmax(-1)
    assert (dense.argmax(-1) == top).mean() >= (quantised.argmax(-1) == top).mean() - 0.05


def test_dense_layers_take_the_kernel_for_k_tails_and_mxfp4() -> None:
    """A dense layer whose K ends mid-iteration, and an MXFP4 one, take the kernel as the
    experts' do (checked on a GPU: `test_k_ending_mid_iteration`, `test_mxfp4`); other
    modes and widths keep MLX's product."""

    def layer(k: int, bits: int = 4, mode: str = "affine", gs: int = 64) -> nn.QuantizedLinear:
        lin = nn.Linear(k, 64, bias=False)
        lin.set_dtype(mx.bfloat16)
        return nn.QuantizedLinear.from_linear(lin, group_size=gs, bits=bits, mode=mode)

    assert dense_quant.kernel_dtype(layer(256)) == mx.bfloat16
    assert dense_quant.kernel_dtype(layer(192, bits=8)) == mx.bfloat16  # 3 x 64 at 8 bits
    assert dense_quant.kernel_dtype(layer(320)) == mx.bfloat16  # 2.5 x 128
    assert dense_quant.kernel_dtype(layer(256, mode="mxfp4", gs=32)) == mx.bfloat16
    assert dense_quant.kernel_dtype(layer(256, bits=8, mode="mxfp8", gs=32)) is None
    assert dense_quant.kernel_dtype(layer(256, bits=3)) is None


@pytest.mark.parametrize("mode", ["mxfp4", "mxfp8", "nvfp4"])
def test_floating_point_modes_unpack_too(mode: str) -> None:
    """MXFP4 (gpt-oss), MXFP8 and NVFP4 layers: the dense product in the activations'
    dtype equals the quantised one within rounding, so their prompt chunks take it too."""
    lin = nn.Linear(128, 96, bias=True)
    lin.set_dtype(mx.bfloat16)
    q = nn.QuantizedLinear.from_linear(lin, mode=mode)
    assert dense_quant.applies(q)
    x = mx.random.normal((2, 9, 128), key=mx.random.key(5))
    # float32 activations: the unpacked weight exactly, only the sums' order differs.
    assert np.allclose(np.array(dense_quant.dense(q, x)), np.array(q(x)), atol=1e-4)
    xb = x.astype(mx.bfloat16)
    got = dense_quant.dense(q, xb)
    assert got.dtype == mx.bfloat16
    exact = np.array(q(x))
    scale = np.abs(exact).max()
    assert np.abs(np.array(got.astype(mx.float32)) - exact).max() <= 0.02 * scale
