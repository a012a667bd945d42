"""Every environment variable pippin reads, in one place, each with its default, its
parser and a line of documentation (vLLM's ``envs.py`` is the model).

Nothing else in pippin reads the environment: code asks this module (``envs.PIPPIN_X``),
and the engine's settings are read from it once, into `EngineConfig`, when the engine
is configured. The speed switches below are for measuring (`bench/gpu/gpu_probe.sh`
turns them one by one); a user's choices are CLI flags (`pippin serve --help`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _flag(name: str, default: str) -> Callable[[], str]:
    return lambda: os.environ.get(name, default)


def _on(name: str) -> Callable[[], bool]:
    """On unless set to 0."""
    return lambda: os.environ.get(name, "1") != "0"


def _path(name: str) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or None


# name -> (reader, documentation)
VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    # --- serving ---
    "PIPPIN_API_KEY": (
        _path("PIPPIN_API_KEY"),
        "The API key of `pippin serve` when --api-key is not given (and of `pippin bench`).",
    ),
    "PIPPIN_CACHE_DIR": (
        _path("PIPPIN_CACHE_DIR"),
        "Where dequantised GGUF weights are cached (default $XDG_CACHE_HOME/pippin, "
        "else ~/.cache/pippin).",
    ),
    "XDG_CACHE_HOME": (_path("XDG_CACHE_HOME"), "The user's cache folder (freedesktop)."),
    "OPENAI_API_KEY": (
        _path("OPENAI_API_KEY"),
        "The key `pippin bench` sends when neither --api-key nor PIPPIN_API_KEY is set.",
    ),
    # --- model loading ---
    "PIPPIN_CPU_UNPACK": (
        _flag("PIPPIN_CPU_UNPACK", "auto"),
        "auto: on the CPU, unpack quantised weights to float32 when they fit a quarter of "
        "the memory (BLAS matmuls, much faster prefill); 0: keep them packed.",
    ),
    "PIPPIN_GGUF_REQUANT": (
        _flag("PIPPIN_GGUF_REQUANT", "auto"),
        "How GGUF tensors MLX cannot read (K-quants, Q5_0, ...) are kept. auto: re-quantised "
        "to MLX's affine 4/8-bit (group size 64) on GPUs and Macs, dequantised on the CPU; "
        "1: re-quantised everywhere; 0: dequantised everywhere. Cached either way.",
    ),
    # --- platform ---
    "PIPPIN_NO_OPENBLAS": (
        lambda: bool(os.environ.get("PIPPIN_NO_OPENBLAS")),
        "Set: do not re-exec with the system's OpenBLAS preloaded (Linux CPU).",
    ),
    "PIPPIN_BLAS_PRELOADED": (
        _path("PIPPIN_BLAS_PRELOADED"),
        "Set by pippin itself when it re-executed with OpenBLAS preloaded (the library).",
    ),
    "OPENBLAS_CORETYPE": (
        _path("OPENBLAS_CORETYPE"),
        "OpenBLAS's own: the kernel family it runs. pippin sets it on re-exec when the "
        "preloaded OpenBLAS picked narrower kernels than the CPU runs (pippin.blas).",
    ),
    "MLX_MAX_OPS_PER_BUFFER": (
        _path("MLX_MAX_OPS_PER_BUFFER"),
        "MLX's own: ops per CUDA graph. pippin sets 400 on CUDA when it is unset.",
    ),
    # --- speed switches, for measuring (read once into EngineConfig.kernels) ---
    "PIPPIN_PAGED_KERNEL": (
        _flag("PIPPIN_PAGED_KERNEL", "auto"),
        "auto: the paged-attention CUDA kernel for decode batches where it pays "
        "(sliding windows and attention sinks too: gpt-oss, Gemma 3); "
        "0: never (the gather path); 1: for every decode batch.",
    ),
    "PIPPIN_PAGED_SPLIT": (
        _on("PIPPIN_PAGED_SPLIT"),
        "0: long contexts of few decode rows on the gather path instead of the paged "
        "kernel with each row's context split over thread blocks (flash-decoding).",
    ),
    "PIPPIN_PREFILL_ATTENTION": (
        _flag("PIPPIN_PREFILL_ATTENTION", "auto"),
        "auto: prompt chunks' attention composed of plain ops on CUDA (no cuDNN plan per "
        "shape); composed: everywhere; fused: MLX's fused attention always.",
    ),
    "PIPPIN_CPU_PREFILL": (
        _flag("PIPPIN_CPU_PREFILL", "auto"),
        "auto: on the CPU, prompt chunks' attention and SwiGLU run in numpy (vectorised "
        "exp; MLX's CPU exp is 10x slower); 0: MLX's own ops; 1: numpy on any device.",
    ),
    "PIPPIN_GATED_DELTA": (
        _on("PIPPIN_GATED_DELTA"),
        "0: the gated delta rule (Qwen3-Next/3.5, Kimi Linear) as mlx-lm runs it off Metal, "
        "a step a token; else one CUDA kernel a call, and on the CPU (with "
        "PIPPIN_CPU_PREFILL) prompt chunks in numpy's chunkwise-parallel form.",
    ),
    "PIPPIN_FUSED_ATTENTION": (
        _on("PIPPIN_FUSED_ATTENTION"),
        "0: decode attention without the fused norms/RoPE/KV-write kernel.",
    ),
    "PIPPIN_FUSED_LAYER": (
        _flag("PIPPIN_FUSED_LAYER", "1"),
        "Which projections of a small decode batch run as the fused gemv kernel: 1 (the "
        "default set; none for quantised layers), 0 (none), all, or names such as "
        "gate_up:1/down (NAME[:ROWS]; quantised layers up to 16 rows).",
    ),
    "PIPPIN_FUSED_PROJ": (
        _on("PIPPIN_FUSED_PROJ"),
        "0: q/k/v and gate/up as separate matmuls instead of one each.",
    ),
    "PIPPIN_HEAD_ROWS": (
        _on("PIPPIN_HEAD_ROWS"),
        "0: the LM head on every position of a prompt chunk, not just the sampled ones.",
    ),
    "PIPPIN_DENSE_QUANT": (
        _flag("PIPPIN_DENSE_QUANT", "auto"),
        "1: quantised layers run prompt chunks (many rows) as a dense product of the unpacked "
        "weight; auto (the default): on CUDA only; 0: never.",
    ),
    "PIPPIN_DENSE_QUANT_ROWS": (
        lambda: int(os.environ.get("PIPPIN_DENSE_QUANT_ROWS") or 256),
        "The fewest rows (tokens of a step) that take that dense product (default 256).",
    ),
    "PIPPIN_QUANT_KERNEL": (
        _flag("PIPPIN_QUANT_KERNEL", "auto"),
        "auto (the default): on CUDA, quantised layers' products of up to 256 rows (below "
        "PIPPIN_DENSE_QUANT_ROWS) run pippin's W4A16/W8A16 tensor-core kernels (1-8 rows the "
        "matvec form, more the matmul); mma: the matmul form for all; 0: MLX's quantised "
        "matmul.",
    ),
    "PIPPIN_MOE_KERNEL": (
        _flag("PIPPIN_MOE_KERNEL", "1"),
        "1 (the default): on CUDA, mixture-of-experts MLPs with quantised experts (affine or "
        "MXFP4) run them through the kernel's grouped form; 0: MLX's gather_qmm.",
    ),
    "PIPPIN_COMPILE": (
        _flag("PIPPIN_COMPILE", "auto"),
        "auto: decode steps as one compiled MLX graph on CUDA only; 0: never; 1: always.",
    ),
    "PIPPIN_WARM_DECODE": (
        lambda: int(os.environ.get("PIPPIN_WARM_DECODE") or 0),
        "N > 0: before the engine is ready, the compiled decode step (CUDA) is traced for "
        "every padded batch size up to --max-num-seqs and every table width of contexts up "
        "to N tokens, so that no step waits on a trace mid-serving; 0 (the default): each "
        "shape is traced when a step first takes it.",
    ),
    "PIPPIN_FREEZE_HEAP": (
        _on("PIPPIN_FREEZE_HEAP"),
        "1 (the default): once a process's engine or API has started, its Python objects "
        "leave the garbage collector's scans (`pippin.heap`); 0: they stay.",
    ),
    # --- not pippin's own ---
    "SSL_CERT_FILE": (
        _path("SSL_CERT_FILE"),
        "A PEM file of the CAs that remote media's https certificates are checked against, "
        "instead of the public ones (as Python, curl and httpx take it); see also "
        "--media-ca-bundle.",
    ),
    "SSL_CERT_DIR": (
        _path("SSL_CERT_DIR"),
        "A folder of hashed CA certificates (OpenSSL's c_rehash layout), taken as "
        "SSL_CERT_FILE is; both may be set.",
    ),
    "CUDA_VISIBLE_DEVICES": (
        _path("CUDA_VISIBLE_DEVICES"),
        "The GPUs this process may use; `--tensor-parallel` with NCCL gives each local "
        "rank one of them, in order (all GPUs in order when unset).",
    ),
}


def __getattr__(name: str) -> Any:
    entry = VARIABLES.get(name)
    if entry is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return entry[0]()


def __dir__() -> list[str]:
    return list(VARIABLES)
