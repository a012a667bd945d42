"""One MoE block at a real model's shape, held to its exact float32 output: the grouped
expert kernel and MLX's `gather_qmm` on the GPU, MLX's bf16 on the CPU
(`moe_prefill.block_check`), at each row count given.

Unlike `moe_prefill.py` it needs no model on disk: the model of `pippin.bench.models`'
config is built in memory with two layers, random weights, quantised as the named build is
(`gpt-oss-20b-mxfp4`: MXFP4 experts, the rest 8-bit; `qwen3-30b-a3b-4bit`: MLX affine
4-bit), so the check takes seconds of a device call rather than a model build.

    python3 bench/gpu/moe_block.py gpt-oss-20b-mxfp4 --rows 5,24,512,2048
"""

from __future__ import annotations

import argparse

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)
from moe_prefill import block_check


def two_layers(name: str) -> object:
    """The quantised mlx-lm model of `name` (a `pippin.bench.models` build name) with its
    first two layers alone (gpt-oss needs one of each attention kind), evaluated."""
    from pippin.bench.models import CONFIGS, compute_in_turn, quantised_as, random_model

    config = dict(CONFIGS[name.rpartition("-")[0]], num_hidden_layers=2)
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:2]
    model, _ = quantised_as(name, random_model(config, lazy=True), config)
    compute_in_turn(model)
    return model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", help="gpt-oss-20b-mxfp4, qwen3-30b-a3b-4bit, ...")
    ap.add_argument("--rows", default="5,24,512,2048")
    args = ap.parse_args()

    from pippin.kernels import patches
    from pippin.kernels.device import on_cuda

    if not on_cuda():
        print("not on CUDA: the grouped kernel does not run here")
        return 0
    model = two_layers(args.name)
    if not patches.quantised_experts(model):
        print("the grouped kernel does not take this model's experts")
        return 1
    for t in (int(r) for r in args.rows.split(",")):
        block_check(model, t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
