"""The speed switches of the kernels and of pippin's changes to mlx-lm, read once."""

from __future__ import annotations

from dataclasses import dataclass

from pippin import envs


@dataclass(frozen=True)
class KernelConfig:
    # The one switch: False runs mlx-lm's model code exactly as it ships (no CUDA kernel,
    # no fused projection, no patch at all; `pippin serve --no-kernels`).
    enabled: bool = True
    # The rest are for measuring one change at a time; see `pippin.envs` for each.
    paged_kernel: str = "auto"  # auto | 0 | 1
    paged_split: bool = True  # long contexts of few rows: the kernel split (flash-decoding)
    prefill_attention: str = "auto"  # auto | composed | fused
    cpu_prefill: str = "auto"  # prompt chunks' attention and SwiGLU in numpy: auto | 0 | 1
    gated_delta: bool = True  # the gated delta rule: CUDA kernel, chunked on the CPU
    fused_attention: bool = True
    fused_layer: str = "1"  # see fused_layer.projections
    fused_proj: bool = True
    head_rows: bool = True
    compile: str = "auto"  # the decode step as one compiled graph: auto | 0 | 1
    # Its shapes traced before the engine is ready, for contexts up to this many tokens
    # (0: each when first taken). For measuring whether traces mid-serving cost throughput
    # (`decode traces` in pippin bench's tables).
    warm_decode: int = 0
    # Quantised layers: inputs of at least `dense_quant_rows` rows as a dense product. On an
    # H100 (docs/benchmarks.md, "Quantised weights on tensor cores") dense beats the kernel
    # from 256-512 rows, and 64 streams' TTFT p50 fell from 3.7 s to 1.2 s with it.
    dense_quant: str = "auto"  # auto (CUDA) | 1 | 0
    dense_quant_rows: int = 256
    # Quantised layers' fewer rows through pippin's tensor-core kernels: auto (CUDA: 1-8
    # rows `quant_matvec`, more `quant_matmul`) | mma (`quant_matmul` for all) | 0.
    quant_kernel: str = "auto"
    # Quantised experts through the kernel's grouped form (CUDA): 1 | 0 (MLX's `gather_qmm`).
    # On by default since an H100 held one MoE block of gpt-oss-20b and Qwen3-30B-A3B as
    # close to its exact output as `gather_qmm` (bench/gpu/moe_block.py, 2026-12-08).
    moe_kernel: str = "1"

    @classmethod
    def from_env(cls) -> KernelConfig:
        return cls(
            paged_kernel=envs.PIPPIN_PAGED_KERNEL,
            paged_split=envs.PIPPIN_PAGED_SPLIT,
            prefill_attention=envs.PIPPIN_PREFILL_ATTENTION,
            cpu_prefill=envs.PIPPIN_CPU_PREFILL,
            gated_delta=envs.PIPPIN_GATED_DELTA,
            fused_attention=envs.PIPPIN_FUSED_ATTENTION,
            fused_layer=envs.PIPPIN_FUSED_LAYER,
            fused_proj=envs.PIPPIN_FUSED_PROJ,
            head_rows=envs.PIPPIN_HEAD_ROWS,
            compile=envs.PIPPIN_COMPILE,
            warm_decode=envs.PIPPIN_WARM_DECODE,
            dense_quant=envs.PIPPIN_DENSE_QUANT,
            dense_quant_rows=envs.PIPPIN_DENSE_QUANT_ROWS,
            quant_kernel=envs.PIPPIN_QUANT_KERNEL,
            moe_kernel=envs.PIPPIN_MOE_KERNEL,
        )
