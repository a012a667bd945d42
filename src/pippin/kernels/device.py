"""Where MLX computes, and MLX's custom CUDA kernels built once each."""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx


def on_cuda() -> bool:
    """Whether MLX computes on an NVIDIA GPU here."""
    return mx.default_device() == mx.gpu and _is_cuda()


def _is_cuda() -> bool:
    try:
        return bool(mx.cuda.is_available())  # type: ignore[attr-defined]
    except AttributeError:
        return not mx.metal.is_available()


@functools.cache
def cuda_kernel(name: str, input_names: tuple[str, ...], source: str, header: str = "") -> Any:
    """MLX's custom CUDA kernel `name` with one output, `out`; built once (MLX compiles it
    per template on first use). `header` holds device functions, outside the kernel."""
    return mx.fast.cuda_kernel(
        name=name,
        input_names=list(input_names),
        output_names=["out"],
        source=source,
        header=header,
    )
