"""Compiling pippin's custom CUDA kernels without a GPU: NVRTC from NVIDIA's pip wheels.

MLX builds a custom kernel (`mx.fast.cuda_kernel`) by wrapping its source in a
`__global__` function: one `const T* name` parameter per input (and `name_shape` where the
source reads it), the outputs, and each template argument as a `constexpr` (or a `using`
for a dtype) at the top of the body (`mlx/backend/cuda/custom_kernel.cpp`). `Recorder`
stands in for `kernels.device.cuda_kernel` and records every launch the real launch code
makes; `compile_launch` wraps a launch's source the same way and compiles it for the
H100/H200 (sm_90, so ptxas also checks registers and shared memory). What it cannot check
is the result: the CUDA-only tests do that on a GPU. Used by
`tests/kernels/test_cuda_kernels_compile.py` (every kernel compiles) and
`bench/gpu/kernel_regs.py` (registers and spills of each build).
"""

from __future__ import annotations

import ctypes
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

_CTYPES = {
    mx.bfloat16: "__nv_bfloat16",
    mx.float16: "__half",
    mx.float32: "float",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
    mx.uint8: "uint8_t",
}

# Stands in for MLX's device headers (which its wheel embeds in libmlx): only what the
# kernels use. MLX's Shape is a fixed-size array of int32 passed by value.
_HEADER = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef int int32_t;
typedef unsigned int uint32_t;
typedef unsigned char uint8_t;
struct Shape {
    int32_t v[10];
    __device__ int32_t operator[](int i) const { return v[i]; }
};
"""


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def nvrtc() -> tuple[ctypes.CDLL, Path] | None:
    """NVRTC and the CUDA headers, from `nvidia-cuda-nvrtc-cu12` and
    `nvidia-cuda-runtime-cu12`; None where they are not installed."""
    try:
        lib_dir = _package_dir("nvidia.cuda_nvrtc")
        inc_dir = _package_dir("nvidia.cuda_runtime")
    except ModuleNotFoundError:
        return None
    if lib_dir is None or inc_dir is None:
        return None
    libs = sorted((lib_dir / "lib").glob("libnvrtc.so.*"))
    if not libs or not (inc_dir / "include" / "cuda_bf16.h").exists():
        return None
    return ctypes.CDLL(str(libs[0])), inc_dir / "include"


@dataclass
class Launch:
    name: str
    input_names: tuple[str, ...]
    source: str
    input_dtypes: list[mx.Dtype]
    template: list[tuple[str, Any]]
    output_dtypes: list[mx.Dtype]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    header: str = ""


class Recorder:
    """`kernels.device.cuda_kernel`'s stand-in: records each launch, returns zeros."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []

    def __call__(
        self, name: str, input_names: tuple[str, ...], source: str, header: str = ""
    ) -> Any:
        def launch(
            *,
            inputs: list[mx.array],
            template: list[tuple[str, Any]],
            grid: tuple[int, int, int],
            threadgroup: tuple[int, int, int],
            output_shapes: list[tuple[int, ...]],
            output_dtypes: list[mx.Dtype],
        ) -> list[mx.array]:
            assert len(inputs) == len(input_names), (name, input_names)
            self.launches.append(
                Launch(
                    name,
                    input_names,
                    source,
                    [a.dtype for a in inputs],
                    template,
                    output_dtypes,
                    grid,
                    threadgroup,
                    header,
                )
            )
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        return launch


def kernel_text(launch: Launch) -> str:
    """The source MLX compiles for `launch` (one output, `out`)."""
    lines = [_HEADER, launch.header, "namespace mlx { namespace core { namespace cu {"]
    lines.append("__global__ void k(")
    for n, dt in zip(launch.input_names, launch.input_dtypes):
        lines.append(f"    const {_CTYPES[dt]}* {n},")
        if f"{n}_shape" in launch.source:
            lines.append(f"    const __grid_constant__ Shape {n}_shape,")
    lines.append(f"    {_CTYPES[launch.output_dtypes[0]]}* out) {{")
    for k, v in launch.template:
        if isinstance(v, bool):
            lines.append(f"  constexpr bool {k} = {'true' if v else 'false'};")
        elif isinstance(v, int):
            lines.append(f"  constexpr int {k} = {v};")
        else:
            lines.append(f"  using {k} = {_CTYPES[v]};")
    return "\n".join(lines) + "\n" + launch.source + "\n}\n}}}\n"


def compile_launch(
    lib: ctypes.CDLL, include: Path, launch: Launch, options: tuple[str, ...] = ()
) -> tuple[bool, str]:
    """(compiled, NVRTC's log) for `launch`, built for sm_90; `options` go to NVRTC too
    (`--ptxas-options=-v` puts registers and spills in the log)."""
    prog = ctypes.c_void_p()
    text = kernel_text(launch).encode()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), text, b"k.cu", 0, None, None) != 0:
        return False, "nvrtcCreateProgram failed"
    opts = [b"--gpu-architecture=sm_90", f"--include-path={include}".encode(), b"-std=c++17"]
    opts += [o.encode() for o in options]
    result = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return result == 0, log.value.decode(errors="replace")
