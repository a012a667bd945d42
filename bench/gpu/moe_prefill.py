"""A mixture-of-experts model's prompt chunks on the GPU: mlx-lm's forward (its experts
through MLX's sorted `gather_qmm`) against the same forward with pippin's grouped expert
kernel (`moe_quant`), which takes prompt chunks of every size since 2026-12-07 (up to 256
tokens before).

On 2026-12-07 (H100) gpt-oss-20b-mxfp4 read a 512-token prompt in 480 ms over HTTP (pippin
and mlx_lm.server alike) and 64 such prompts in 26 s: about 1,000 prompt tokens/s. Per chunk
size: ms per forward (the model's hidden states, then the LM head on the last position),
prompt tokens/s, and how far the kernel's last-position logits are from mlx-lm's.

    python3 bench/gpu/moe_prefill.py /tmp/pippin-gpu-models/gpt-oss-20b-mxfp4
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)
import mlx.core as mx


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--reps", type=int, default=3)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
