"""Quantised projections: which product each input takes.

MLX's CUDA `quantized_matmul` suits a few rows (decode): it reads each packed weight once.
For many rows (prompt chunks) it is far slower than cuBLAS on the same weights unpacked
(on an H100 one 4096x14336 product at 256 rows took 3.7x the bf16 time, growing with the
rows), so a quantised 8B model's prompts ran at a twentieth of the bf16 model's speed.

Here each `nn.QuantizedLinear` (MLX affine, or MXFP4, MXFP8 and NVFP4 without a global
scale) becomes a subclass that, for an input of at least
`rows` rows, unpacks its weight with `mx.dequantize` (into the model's dtype, a temporary
that MLX's allocator reuses layer after layer, so the model keeps its quantised size) and
runs a dense matmul; fewer rows keep the quantised product. Plain MLX ops, so the same
path runs (and is tested) on the CPU; the results differ from the quantised product only
by the rounding of the unpacked weight to the model's dtype.

On CUDA the inputs below that bound take pippin's tensor-core kernels where they apply to
the layer (`PIPPIN_QUANT_KERNEL`): `quant_matvec` up to 8 rows, `quant_matmul` above; MLX's
quantised product elsewhere, and for one row of an 8-bit layer (`quant_matvec.MLX_ROWS`).

Installed by `patches.quantised_products` when `PIPPIN_DENSE_QUANT` or the kernel asks for
it (`PIPPIN_DENSE_QUANT_ROWS`) and taken back by `patches.undo`.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import quant_matmul, quant_matvec
from pippin.kernels.device import on_cuda

ROWS_ATTR = "_pippin_dense_rows"
KERNEL_ATTR = "_pippin_kernel_dtype"  # the activations' dtype `quant_matmul` takes, or None
MATVEC_ATTR = "_pippin_matvec_rows"  # inputs of up to this many rows take `quant_matvec`
# MLX's modes whose weight `mx.dequantize` unpacks from the layer's own arrays (nvfp4 with
# a global scale aside: `applies`).
MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")


def wanted(mode: str) -> bool:
    """`KernelConfig.dense_quant`: auto (CUDA only), 1 (everywhere) or 0."""
    return mode == "1" or (mode == "auto" and on_cuda())


def applies(m: nn.Module) -> bool:
    if not isinstance(m, nn.QuantizedLinear) or m.get("global_scale") is not None:
        return False
    return getattr(m, "mode", "affine") in MODES


def dense(layer: nn.QuantizedLinear, x: mx.array) -> mx.array:
    """`layer(x)` through the unpacked weight: in its scales' dtype (affine), else in
    x's (the floating-point modes' scales are uint8)."""
    mode = getattr(layer, "mode", "affine")
    w = mx.dequantize(
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        group_size=layer.group_size,
        bits=layer.bits,
        mode=mode,
        dtype=None if mode == "affine" else x.dtype,
    )
    if "bias" in layer:
        return mx.addmm(layer["bias"], x, w.T)
    return x @ w.T


def call(self: nn.QuantizedLinear, x: mx.array) -> mx.array:
    rows = x.size // x.shape[-1] if x.ndim else 0
    if rows >= getattr(self, ROWS_ATTR):
        return dense(self, x)
    kernel = getattr(self, KERNEL_ATTR, None)
    if kernel is not None and x.dtype == kernel and quant_matvec.MLX_ROWS.get(self.bits, 0) < rows:
        if rows <= getattr(self, MATVEC_ATTR, 0):
            return quant_matvec.layer_qmv(self, x)
        if rows <= quant_matmul.MAX_ROWS:
            return quant_matmul.layer_qmm(self, x)
    return nn.QuantizedLinear.__call__(self, x)


def kernel_dtype(layer: nn.QuantizedLinear) -> mx.Dtype | None:
    """The activations' dtype for which `quant_matmul` computes `layer`, or None: affine
    and MXFP4 layers, K ending mid-iteration included (gpt-oss's 2,880)."""
    dtype = quant_matmul.activations(layer)
    return dtype if quant_matmul.applies(layer, dtype) else None


@functools.cache
def subclass(base_attr: str) -> type:
    """`nn.QuantizedLinear` with `call`; `base_attr` names the attribute that records the
    base class (so that `patches.undo` restores it)."""
    return type(
        "DenseChunkQuantizedLinear",
        (nn.QuantizedLinear,),
        {"__call__": call, base_attr: nn.QuantizedLinear},
    )
