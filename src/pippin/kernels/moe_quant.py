"""Mixture-of-experts MLPs with affine-quantised experts on tensor cores (CUDA).

mlx-lm's `SwitchGLU` runs each projection through `mx.gather_qmm`, whose CUDA form is far
slower than a dense product of the same bytes (mlx issue #4339: about 24x). Here its class
becomes a subclass whose `__call__` sorts the (token, expert) pairs once and runs the three
projections through `quant_matvec.gather_qmv` (an expert's pairs within 16 rows: decode)
or `quant_matmul.gather_qmm`: the gate and up products read each token's
row for its pairs in expert order, the activation runs on those rows, and the down product
writes each pair's row back in the pairs' own order, so no gather or scatter op runs
between them. The experts' biases (gpt-oss) are added as mlx-lm adds them.

Where it applies: every projection a `QuantizedSwitchLinear` that `quant_matmul.applies`
takes (MLX affine, or MXFP4 as gpt-oss ships its experts), activations of the dtype it
takes them in, and prompt chunks of any size: a chunk whose blocks would not fit CUDA's
grid (`quant_matmul.gather_fits`: 512 experts at 8,192 tokens) runs in pieces that do.
Prompt chunks matter most: on an H100 MLX's `gather_qmm` read gpt-oss-20b's prompts at about
1,000 tokens/s.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import quant_matmul, quant_matvec

CLASSES = (("switch_layers", "SwitchGLU"),)
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# `warm` builds the templates of 1 to this many tokens a call (twice CUDA's default prompt
# chunk): a call of more that takes a new template waits for NVRTC once (about a second).
WARM_TOKENS = 16_384


def plan(module: nn.Module, base: type) -> mx.Dtype | None:
    """The activations' dtype for which the kernel runs `module`'s experts, or None."""
    layers = [getattr(module, p, None) for p in PROJECTIONS]
    if not all(type(m).__name__ == "QuantizedSwitchLinear" for m in layers):
        return None
    dtype = quant_matmul.activations(layers[0])
    return dtype if all(quant_matmul.applies(m, dtype) for m in layers) else None


def _fits(layer: Any, pairs: int, tokens: int) -> bool:
    if quant_matvec.takes(pairs, layer["weight"].shape[0]):
        return True
    e, n = layer["weight"].shape[:2]
    k = quant_matmul.in_features(layer)
    return quant_matmul.gather_fits(pairs, e, n, k, layer.bits, tokens)


def _project(
    layer: Any,
    x: mx.array,
    ids: mx.array,
    order: mx.array,
    tokens: int,
    gather_x: bool,
    scatter_out: bool,
    flat: mx.array,
) -> mx.array:
    few = quant_matvec.takes(ids.size, layer["weight"].shape[0])
    product = quant_matvec.gather_qmv if few else quant_matmul.gather_qmm
    y = product(
        x,
        layer["weight"],
        layer["scales"],
        layer.get("biases"),
        ids,
        order,
        tokens,
        layer.group_size,
        layer.bits,
        gather_x,
        scatter_out,
    )
    if "bias" in layer:
        y = y + layer["bias"][flat if scatter_out else ids]
    return y


def call(self: Any, x: mx.array, indices: mx.array) -> mx.array:
    dtype = getattr(self, "_pippin_plan", None)
    top_k = indices.shape[-1]
    tokens = indices.size // top_k
    if dtype is None or x.dtype != dtype or x.size != tokens * x.shape[-1]:
        return self._pippin_base.__call__(self, x, indices)
    rows = x.reshape(tokens, x.shape[-1])
    pairs = indices.reshape(tokens, top_k)
    piece = tokens
    while not all(_fits(getattr(self, q), piece * top_k, piece) for q in PROJECTIONS):
        piece = -(-piece // 2)  # a few experts' pairs always fit (the matvec form's)
    if piece == tokens:
        y = _experts(self, rows, pairs)
    else:
        y = mx.concatenate(
            [
                _experts(self, rows[i : i + piece], pairs[i : i + piece])
                for i in range(0, tokens, piece)
            ]
        )
    return y.reshape(*indices.shape, y.shape[-1])


def _experts(self: Any, rows: mx.array, indices: mx.array) -> mx.array:
    """The MLP of `rows` [T, D] through their experts `indices` [T, top_k]: [T * top_k, D]."""
    tokens = rows.shape[0]
    ids, order = quant_matmul.sort_pairs(indices)
    flat = indices.reshape(-1)
    up = _project(self.up_proj, rows, ids, order, tokens, True, False, flat)
    gate = _project(self.gate_proj, rows, ids, order, tokens, True, False, flat)
    return _project(
        self.down_proj, self.activation(up, gate), ids, order, tokens, False, True, flat
    )


def tiling(e: int, n: int, k: int, bits: int, tokens: int, top_k: int) -> tuple:
    """The product (`quant_matvec.gather_qmv` or `quant_matmul.gather_qmm`) and tiling a
    call of `tokens` tokens (`top_k` experts each) takes for a projection of `e` experts, N
    `n`, K `k`: with the dtype, packing and direction, what picks its template."""
    p = tokens * top_k
    if quant_matvec.takes(p, e):
        rows, tiles = quant_matvec.gather_plan(p, e, k, bits, tokens)
        return (quant_matvec.gather_qmv, rows > 8, tiles)
    return (quant_matmul.gather_qmm, *quant_matmul.gather_plan(p, e, n, k, bits, tokens)[:3])


def warm(model: nn.Module, top_k: int) -> int:
    """Build now every template the patched `SwitchGLU`s of `model` take for 1 to
    `WARM_TOKENS` tokens of `top_k` experts each (as `quant_matmul.warm` does for dense
    layers); how many products ran."""
    layers: dict[tuple, Any] = {}  # one projection of each shape, dtype, packing, direction
    for _, m in model.named_modules():
        if type(m).__dict__.get("__call__") is not call or m._pippin_plan is None:
            continue
        for q in PROJECTIONS:
            layer = getattr(m, q)
            packing = (layer["scales"].dtype, layer.bits, layer.group_size)  # MX or affine
            key = (layer["weight"].shape, m._pippin_plan, packing, q == "down_proj")
            layers.setdefault(key, layer)
    seen: set[tuple] = set()
    for (shape, dtype, packing, down), layer in layers.items():
        e, n = shape[:2]
        k = quant_matmul.in_features(layer)
        for tokens in range(1, WARM_TOKENS + 1):
            form = tiling(e, n, k, layer.bits, tokens, top_k)
            key = (form, dtype, packing, down)  # the template
            if key in seen:
                continue
            seen.add(key)
            p = tokens * top_k
            x = mx.zeros((p if down else tokens, k), dtype=dtype)
            ids = mx.zeros((p,), dtype=mx.uint32)
            order = mx.arange(p, dtype=mx.uint32)
            w, s, b = layer["weight"], layer["scales"], layer.get("biases")
            product = form[0]
            mx.eval(
                product(
                    x, w, s, b, ids, order, tokens, layer.group_size, layer.bits, not down, down
                )
            )
    return len(seen)
