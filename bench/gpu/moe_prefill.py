"""A mixture-of-experts model's prompt chunks on the GPU: mlx-lm's forward (its experts
through MLX's sorted `gather_qmm`) against the same forward with pippin's grouped expert
kernel (`moe_quant`), which takes prompt chunks of every size since 2026-12-07 (up to 256
tokens before).

On 2026-12-07 (H100) gpt-oss-20b-mxfp4 read a 512-token prompt in 480 ms over HTTP (pippin
and mlx_lm.server alike) and 64 such prompts in 26 s: about 1,000 prompt tokens/s. Per chunk
size: ms per forward (the model's hidden states, then the LM head on the last position),
prompt tokens/s, and how far the kernel's last-position logits are from mlx-lm's. On
2026-12-07 (H100) the kernel read them 8-11x faster, its logits 15% (of the largest) off
MLX's at 512 tokens, 1.3% at 8,192; MLX's own forward is no reference on CUDA (it gave NaN
for tiny MoE models), so last, one MoE block is held to its exact float32 output computed on
the CPU at each of `--block-tokens` rows (a decode batch's, taking the matvec form, a short
and a long chunk's): the kernel's error beside `gather_qmm`'s and bf16's.

    python3 bench/gpu/moe_prefill.py /tmp/pippin-gpu-models/gpt-oss-20b-mxfp4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)
import mlx.core as mx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--block-tokens",
        default="5,24,512",
        help="rows of the block checks (decode rows take the matvec form, chunks the matmul's)",
    )
    args = ap.parse_args()

    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from pippin.kernels import patches
    from pippin.kernels.device import on_cuda

    model, _ = load(str(args.model))
    sizes = [int(t) for t in args.tokens.split(",")]
    vocab = model.args.vocab_size
    tokens = mx.random.randint(0, vocab, (1, max(sizes)), key=mx.random.key(0))

    def forward(t: int) -> mx.array:
        cache = make_prompt_cache(model)
        h = model.model(tokens[:, :t], cache=cache)
        return model.lm_head(h[:, -1:]) if hasattr(model, "lm_head") else h[:, -1:]

    def timed(t: int) -> tuple[float, mx.array]:
        out = forward(t)
        mx.eval(out)  # builds the kernels' templates for this size
        times = []
        for _ in range(args.reps):
            mx.synchronize()
            t0 = time.perf_counter()
            out = forward(t)
            mx.eval(out)
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2] * 1e3, out.astype(mx.float32)

    base = {t: timed(t) for t in sizes}
    for t, (ms, _) in base.items():
        print(f"mlx-lm   {t:6d} tokens {ms:9.1f} ms {t / ms * 1e3:9.0f} tok/s", flush=True)
    if not on_cuda():
        print("not on CUDA: the grouped kernel does not run here")
        return 0
    if not patches.quantised_experts(model):
        print("the grouped kernel does not take this model's experts")
        return 1
    for t in sizes:
        ms, out = timed(t)
        ref = base[t][1]
        err = mx.abs(out - ref).max().item() / max(mx.abs(ref).max().item(), 1e-6)
        same = (out.argmax(-1) == ref.argmax(-1)).all().item()
        print(
            f"kernel   {t:6d} tokens {ms:9.1f} ms {t / ms * 1e3:9.0f} tok/s "
            f"{base[t][0] / ms:5.2f}x  logits max err {err:.4f} (of max |logit|), "
            f"argmax {'same' if same else 'DIFFERS'}",
            flush=True,
        )
    for t in (int(r) for r in args.block_tokens.split(",")):
        block_check(model, t)
    return 0


def block_check(model: Any, t: int) -> None:
    """One patched MoE block on a chunk of `t` rows: the grouped kernel and MLX's
    `gather_qmm` (both on the GPU) and MLX's bf16 forward on the CPU, each against the block's
    exact float32 output on the CPU (MLX's own forward of some tiny MoE models gave NaN on
    an H100, so no GPU result is the reference)."""
    import numpy as np

    from pippin.kernels.quant_matmul import in_features

    block = next(m for _, m in model.named_modules() if hasattr(m, "_pippin_plan"))
    base = block._pippin_base
    hidden = in_features(block.gate_proj)
    e = block.gate_proj["weight"].shape[0]
    top_k = model.args.num_experts_per_tok
    x = mx.random.normal((t, hidden), key=mx.random.key(1)).astype(mx.bfloat16)
    scores = mx.random.normal((t, e), key=mx.random.key(2))
    indices = mx.argpartition(-scores, kth=top_k - 1, axis=-1)[:, :top_k].astype(mx.uint32)
    ours = np.array(block(x, indices).astype(mx.float32))
    gpu_mlx = np.array(base.__call__(block, x, indices).astype(mx.float32))
    weights = block.parameters()
    with mx.stream(mx.cpu):
        cpu_mlx = np.array(base.__call__(block, x, indices).astype(mx.float32))
        block.set_dtype(mx.float32)
        exact = np.array(base.__call__(block, x.astype(mx.float32), indices))
    block.update(weights)  # the next check's GPU runs read the weights as loaded
    top = np.abs(exact).max()
    for name, y in (("kernel (GPU)", ours), ("gather_qmm (GPU)", gpu_mlx), ("bf16 (CPU)", cpu_mlx)):
        print(
            f"block {t} rows, {name:17s} max err {np.abs(y - exact).max() / top:.4f} of max |exact|"
            f"{'  NaN' if np.isnan(y).any() else ''}",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
