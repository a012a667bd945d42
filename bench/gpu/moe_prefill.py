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


BF16_ROWS = 64  # MLX's quantised gather on the CPU: minutes past a few hundred rows


class _Exact:
    """A quantised expert projection (mlx-lm's `QuantizedSwitchLinear`) in float32 with
    numpy's BLAS, one product per expert: MLX's own quantised gather on the CPU took more
    than 200 s for one real-shape block at 512 rows (H100 host, 2026-12-08)."""

    def __init__(self, layer: Any) -> None:
        import numpy as np

        mode = getattr(layer, "mode", "affine")
        scales, biases = layer["scales"], layer.get("biases")
        if mode == "affine":  # unrounded: the groups' scales and biases meet q in float32
            scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        with mx.stream(mx.cpu):
            w = mx.dequantize(
                layer["weight"], scales, biases, layer.group_size, layer.bits, mode=mode,
                dtype=mx.float32,
            )  # fmt: skip
            self.w = np.array(w)
            self.bias = np.array(layer["bias"].astype(mx.float32)) if "bias" in layer else None

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        import numpy as np

        ids = np.array(indices)
        rows = np.broadcast_to(np.array(x.astype(mx.float32))[..., 0, :], (*ids.shape, x.shape[-1]))
        flat, out_ids = rows.reshape(-1, x.shape[-1]), ids.reshape(-1)
        out = np.zeros((flat.shape[0], self.w.shape[1]), dtype=np.float32)
        for e in np.unique(out_ids):
            sel = out_ids == e
            out[sel] = flat[sel] @ self.w[e].T + (0 if self.bias is None else self.bias[e])
        return mx.array(out.reshape(*ids.shape, 1, -1))


def exact_output(block: Any, base: Any, x: mx.array, indices: mx.array) -> Any:
    """The block's output (mlx-lm's own forward, `base`) with its expert projections in
    float32 (`_Exact`), x taken as float32: a numpy array."""
    import numpy as np

    names = ("gate_proj", "up_proj", "down_proj")
    layers = {q: getattr(block, q) for q in names}
    try:
        for q in names:
            object.__setattr__(block, q, _Exact(layers[q]))
        with mx.stream(mx.cpu):
            return np.array(base.__call__(block, x.astype(mx.float32), indices))
    finally:
        for q in names:  # the module's own children show through again
            object.__delattr__(block, q)


def block_check(model: Any, t: int) -> None:
    """One patched MoE block on a chunk of `t` rows: the grouped kernel and MLX's
    `gather_qmm` (both on the GPU), and up to `BF16_ROWS` rows MLX's bf16 forward on the CPU,
    each against the block's exact float32 output on the CPU (`exact_output`; MLX's own
    forward of some tiny MoE models gave NaN on an H100, so no GPU result is the
    reference)."""
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
    results = [
        ("kernel (GPU)", np.array(block(x, indices).astype(mx.float32))),
        ("gather_qmm (GPU)", np.array(base.__call__(block, x, indices).astype(mx.float32))),
    ]
    if t <= BF16_ROWS:
        with mx.stream(mx.cpu):
            results.append(
                ("bf16 (CPU)", np.array(base.__call__(block, x, indices).astype(mx.float32)))
            )
    exact = exact_output(block, base, x, indices)
    top = np.abs(exact).max()
    for name, y in results:
        print(
            f"block {t} rows, {name:17s} max err {np.abs(y - exact).max() / top:.4f} of max |exact|"
            f"{'  NaN' if np.isnan(y).any() else ''}",
            flush=True,
        )


if __name__ == "__main__":
    raise SystemExit(main())
