"""The W4A16 / W8A16 tensor-core product (`kernels.quant_matmul`) against MLX's own
`quantized_matmul`, on CUDA, for every plan the kernel picks (1, 2 and 4 row tiles, 2 and
4 column tiles, 1-8 warps on K), every packing it takes and both activation dtypes; and
where it declines a layer (off CUDA the layers keep MLX's product: `test_dense_quant`)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pippin.kernels import quant_matmul, quant_matvec


def _case(n: int, k: int, bits: int, gs: int, dtype: mx.Dtype, seed: int = 0):  # type: ignore[no-untyped-def]
    key = mx.random.key(seed)
    w = (mx.random.normal((n, k), key=key) * 0.05).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=gs, bits=bits)
    return wq, s, b


def _check(
    m: int, n: int, k: int, bits: int, gs: int, dtype: mx.Dtype, product=quant_matmul.qmm
) -> None:  # type: ignore[no-untyped-def]
    """`product` (`qmm`'s arguments) against the exact product of the same quantised
    weights, no further off than twice MLX's own error plus 1% of the largest output."""
    wq, s, b = _case(n, k, bits, gs, dtype)
    x = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
    got = product(x, wq, s, b, gs, bits).astype(mx.float32)
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits)
    # The exact product of the same quantised weights, in float32.
    w32 = mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), group_size=gs, bits=bits)
    exact = np.array(x.astype(mx.float32) @ w32.T)
    err = np.abs(np.array(got) - exact).max()
    mlx_err = np.abs(np.array(ref.astype(mx.float32)) - exact).max()
    scale = np.abs(exact).max()
    assert got.shape == (m, n)
    assert err <= 2 * mlx_err + 0.01 * scale, (m, n, k, bits, gs, dtype, err, mlx_err, scale)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32, 40, 64, 100, 256])
@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 64)])
def test_every_row_plan(m: int, bits: int, gs: int) -> None:
    _check(m, 200, 1024, bits, gs, mx.bfloat16)  # 200 columns: a partial column tile


@pytest.mark.cuda
@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 128), (8, 32), (8, 128)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_every_packing_and_dtype(bits: int, gs: int, dtype: mx.Dtype) -> None:
    for m in (1, 24, 80):
        _check(m, 96, 512, bits, gs, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(4096, 4096), (28672, 4096), (4096, 14336), (1024, 128)])
def test_model_shapes(n: int, k: int) -> None:
    """The 8B shape's projections (many blocks: few warps on K) and a short K (one
    iteration: one warp)."""
    for m in (1, 8, 64):
        _check(m, n, k, 4, 64, mx.bfloat16)


@pytest.mark.cuda
def test_rows_of_a_batch_are_independent() -> None:
    """A row's result does not depend on the rows beside it (the tiles' padding rows read
    as zeros and are never written)."""
    wq, s, b = _case(160, 512, 4, 64, mx.bfloat16)
    x = mx.random.normal((37, 512)).astype(mx.bfloat16)
    full = np.array(quant_matmul.qmm(x, wq, s, b, 64, 4).astype(mx.float32))
    for i in (0, 16, 36):
        one = np.array(quant_matmul.qmm(x[i : i + 1], wq, s, b, 64, 4).astype(mx.float32))
        assert np.allclose(one[0], full[i], atol=1e-2), i


def test_applies_only_where_the_kernel_computes_it() -> None:
    def layer(bits: int, gs: int, k: int = 256, dtype: mx.Dtype = mx.bfloat16) -> nn.Module:
        lin = nn.Linear(k, 64, bias=False)
        lin.set_dtype(dtype)
        return nn.QuantizedLinear.from_linear(lin, group_size=gs, bits=bits)

    assert quant_matmul.applies(layer(4, 64), mx.bfloat16)
    assert quant_matmul.applies(layer(8, 32), mx.bfloat16)
    assert quant_matmul.applies(layer(4, 64, dtype=mx.float16), mx.float16)
    assert not quant_matmul.applies(layer(4, 64), mx.float16)  # scales of another dtype
    assert not quant_matmul.applies(layer(4, 64, dtype=mx.float32), mx.float32)
    assert not quant_matmul.applies(layer(3, 64), mx.bfloat16)
    assert not quant_matmul.applies(layer(4, 64, k=192), mx.bfloat16)  # K % 128
    assert not quant_matmul.applies(nn.Linear(256, 64), mx.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [4, 8])
def test_patched_model_on_cuda_takes_the_kernel_and_stays_as_close_to_exact(
    tiny_models, bits: int
) -> None:
    """A quantised tiny Llama in bf16, decode-shaped input (5 rows of one token): the
    kernel's logits are as close to the exact (float32) ones as MLX's quantised matmul's,
    and `undo` gives MLX's back."""
    from support.engine_runs import loaded_model

    from pippin.kernels import dense_quant, patches
    from pippin.kernels.config import KernelConfig

    model = loaded_model(tiny_models("llama")).model
    nn.quantize(model, group_size=64, bits=bits)
    model.set_dtype(mx.bfloat16)
    tokens = mx.random.randint(3, model.args.vocab_size, (5, 1), key=mx.random.key(1))
    model.set_dtype(mx.float32)
    exact = np.array(model(tokens))
    model.set_dtype(mx.bfloat16)
    mlx = np.array(model(tokens).astype(mx.float32))
    patched = patches.apply(model, KernelConfig(), {}, {}, None)
    assert patched.quant_kernel > 0
    assert any(getattr(m, dense_quant.KERNEL_ATTR, None) for _, m in model.named_modules())
    ours = np.array(model(tokens).astype(mx.float32))
    patches.undo(model)
    assert np.array_equal(np.array(model(tokens).astype(mx.float32)), mlx)
    mlx_err, our_err = (np.abs(y - exact).max() for y in (mlx, ours))
    assert our_err <= 1.5 * mlx_err + 0.01 * np.abs(exact).max()
    top = exact.argmax(-1)
    assert (ours.argmax(-1) == top).mean() >= (mlx.argmax(-1) == top).mean() - 0.2


def _experts(e: int, n: int, k: int, bits: int, dtype: mx.Dtype = mx.bfloat16):  # type: ignore[no-untyped-def]
    w = (mx.random.normal((e, n, k), key=mx.random.key(e)) * 0.05).astype(dtype)
    return mx.quantize(w, group_size=64, bits=bits)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 5, 40, 130])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("product", [quant_matmul.gather_qmm, quant_matvec.gather_qmv])
def test_grouped_product_matches_gather_qmm(tokens: int, bits: int, product) -> None:  # type: ignore[no-untyped-def]
    """Each token's rows through its top-k experts: the token rows gathered (gate/up) and
    the pair rows scattered back (down), against `mx.gather_qmm` on the same pairs; both
    forms (the matvec one in blocks of 8 or 16 pairs of an expert)."""
    e, top_k, n, k = 16, 4, 256, 256  # n: the down product's K, a whole 4-bit iteration
    wq, s, b = _experts(e, n, k, bits)
    x = mx.random.normal((tokens, k), key=mx.random.key(3)).astype(mx.bfloat16)
    # Distinct experts per token, as a router's top-k gives them (some experts idle).
    scores = mx.random.normal((tokens, e), key=mx.random.key(4))
    indices = mx.argpartition(-scores, kth=top_k - 1, axis=-1)[:, :top_k].astype(mx.uint32)
    ref = mx.gather_qmm(
        x[:, None, None, :], wq, s, b, rhs_indices=indices, transpose=True, group_size=64, bits=bits
    )  # [tokens, top_k, 1, n]
    ref = np.array(ref.reshape(tokens * top_k, n).astype(mx.float32))
    ids, order = quant_matmul.sort_pairs(indices)
    # Gate/up: token rows in, sorted pair rows out.
    sorted_out = product(x, wq, s, b, ids, order, tokens, 64, bits, True, False)
    back = np.empty_like(ref)
    back[np.array(order)] = np.array(sorted_out.astype(mx.float32))
    scale = np.abs(ref).max()
    assert np.abs(back - ref).max() <= 0.02 * scale
    # Down: sorted pair rows in, rows in the pairs' own order out.
    pairs = mx.array(back, dtype=mx.bfloat16)[order]  # the inputs, in sorted order
    k2 = n
    wq2, s2, b2 = _experts(e, 128, k2, bits)
    got = product(pairs, wq2, s2, b2, ids, order, tokens, 64, bits, False, True)
    want = mx.gather_qmm(
        mx.array(back, dtype=mx.bfloat16).reshape(tokens, top_k, 1, k2),
        wq2,
        s2,
        b2,
        rhs_indices=indices,
        transpose=True,
        group_size=64,
        bits=bits,
    ).reshape(tokens * top_k, 128)
    want = np.array(want.astype(mx.float32))
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() <= 0.02 * np.abs(want).max()


@pytest.mark.cuda
def test_moe_model_takes_the_grouped_kernel_and_keeps_its_logits(tiny_models) -> None:
    """A quantised tiny Qwen3-MoE (widths the kernel takes): the patched `SwitchGLU` runs,
    and its logits stay as close to the exact ones as mlx-lm's `gather_qmm`'s."""
    from support.engine_runs import loaded_model

    from pippin.kernels import patches
    from pippin.kernels.config import KernelConfig

    path = tiny_models("qwen3_moe", hidden_size=256, moe_intermediate_size=128)
    model = loaded_model(path).model
    nn.quantize(model, group_size=64, bits=4)
    model.set_dtype(mx.bfloat16)
    for shape in ((5, 1), (1, 24)):  # a decode batch, a prompt chunk
        tokens = mx.random.randint(3, model.args.vocab_size, shape, key=mx.random.key(2))
        model.set_dtype(mx.float32)
        exact = np.array(model(tokens))
        model.set_dtype(mx.bfloat16)
        mlx = np.array(model(tokens).astype(mx.float32))
        patched = patches.apply(model, KernelConfig(moe_kernel="1"), {}, {}, None)
        assert patched.moe_kernel
        ours = np.array(model(tokens).astype(mx.float32))
        patches.undo(model)
        mlx_err, our_err = (np.abs(y - exact).max() for y in (mlx, ours))
        assert our_err <= 1.5 * mlx_err + 0.01 * np.abs(exact).max(), shape
