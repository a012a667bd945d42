"""The 1-16 row W4A16 / W8A16 product (`kernels.quant_matvec`) against MLX's own
`quantized_matmul` on CUDA, by `test_quant_matmul`'s measure: every row count, packing and
activation dtype, the splits of K its plan and a sweep take, partial column tiles; and the
patched model takes it for decode rows."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_quant_matmul import _case, _check

from pippin.kernels import dense_quant, quant_matmul, quant_matvec


@pytest.mark.cuda
@pytest.mark.parametrize("m", range(1, quant_matvec.MAX_ROWS + 1))
@pytest.mark.parametrize("bits", [4, 8])
def test_every_row_count(m: int, bits: int) -> None:
    _check(m, 200, 1024, bits, 64, mx.bfloat16, quant_matvec.qmv)  # a partial column tile


@pytest.mark.cuda
@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 128), (8, 32), (8, 128)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_every_packing_and_dtype(bits: int, gs: int, dtype: mx.Dtype) -> None:
    for m in (1, 5, 11):
        _check(m, 96, 512, bits, gs, dtype, quant_matvec.qmv)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "tiles",
    [(1, 1, 1), (1, 4, 1), (2, 3, 2), (4, 2, 4), (8, 1, 2), (8, 4, 1), (4, 1, 4), (2, 2, 3)],
)
def test_every_split_of_k(tiles: tuple[int, int, int]) -> None:
    """Warps on K, steps in flight and column tiles per warp; K's steps (16 at 4 bits) a
    multiple of neither, the columns (72, 40) of no whole block at 2-4 tiles."""
    product = partial(quant_matvec.qmv, tiles=tiles)
    for m in (1, 8, 13):
        _check(m, 72, 2048, 4, 64, mx.bfloat16, product)
    _check(2, 40, 1152, 8, 64, mx.bfloat16, product)
    _check(16, 40, 1152, 8, 64, mx.bfloat16, product)


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(6144, 4096), (28672, 4096), (4096, 14336), (1024, 128)])
def test_model_shapes(n: int, k: int) -> None:
    """The 8B shape's projections at `plan`'s splits, and a K of one step."""
    for m in (1, 4, 16):
        _check(m, n, k, 4, 64, mx.bfloat16, quant_matvec.qmv)


@pytest.mark.cuda
def test_rows_are_independent_and_agree_with_the_matmul_form() -> None:
    wq, s, b = _case(160, 512, 4, 64, mx.bfloat16)
    x = mx.random.normal((15, 512)).astype(mx.bfloat16)
    full = np.array(quant_matvec.qmv(x, wq, s, b, 64, 4).astype(mx.float32))
    mma = np.array(quant_matmul.qmm(x, wq, s, b, 64, 4).astype(mx.float32))
    assert np.allclose(full, mma, atol=2e-2)
    for i in (0, 3, 9, 14):
        one = np.array(quant_matvec.qmv(x[i : i + 1], wq, s, b, 64, 4).astype(mx.float32))
        assert np.allclose(one[0], full[i], atol=1e-2), i


def test_patched_layers_take_it_up_to_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows go to the matvec form, 9 or more to the matmul form."""
    from pippin.kernels import patches

    lin = nn.Linear(256, 64, bias=False)
    lin.set_dtype(mx.bfloat16)
    model = nn.Sequential(nn.QuantizedLinear.from_linear(lin, group_size=64, bits=4))
    patches.quantised_products(model, 256, kernel=True)
    layer = model.layers[0]
    assert getattr(layer, dense_quant.MATVEC_ATTR) == quant_matvec.DENSE_ROWS == 8
    calls: list[str] = []
    monkeypatch.setattr(quant_matvec, "layer_qmv", lambda m, x: calls.append("mv") or x[..., :64])
    monkeypatch.setattr(quant_matmul, "layer_qmm", lambda m, x: calls.append("mm") or x[..., :64])
    layer(mx.zeros((1, 256), dtype=mx.bfloat16))
    layer(mx.zeros((8, 256), dtype=mx.bfloat16))
    layer(mx.zeros((9, 256), dtype=mx.bfloat16))
    assert calls == ["mv", "mv", "mm"]
    patches.quantised_products(model, 256, kernel=True, matvec=False)
    layer(mx.zeros((1, 256), dtype=mx.bfloat16))
    assert calls[-1] == "mm"


def test_one_row_of_an_8_bit_layer_keeps_mlx_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """MLX's one-row `qmv` beats the matvec form at 8 bits (`MLX_ROWS`); 2 rows take the
    kernel, and 4-bit layers take it from one row."""
    from pippin.kernels import patches

    calls: list[str] = []
    monkeypatch.setattr(quant_matvec, "layer_qmv", lambda m, x: calls.append("mv") or x[..., :64])
    for bits in (8, 4):
        lin = nn.Linear(256, 64, bias=False)
        lin.set_dtype(mx.bfloat16)
        model = nn.Sequential(nn.QuantizedLinear.from_linear(lin, group_size=64, bits=bits))
        patches.quantised_products(model, 256, kernel=True)
        layer = model.layers[0]
        x = mx.random.normal((1, 256)).astype(mx.bfloat16)
        got = layer(x)
        if bits == 8:
            assert calls == [] and got.shape == (1, 64)
            assert mx.array_equal(got, nn.QuantizedLinear.__call__(layer, x))
            layer(mx.zeros((2, 256), dtype=mx.bfloat16))
            assert calls == ["mv"]
        else:
            assert calls == ["mv", "mv"]
