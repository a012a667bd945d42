"""Decode throughput in-process: pippin's paged engine against mlx-lm's BatchGenerator.

Answers whether gathering paged KV into dense tensors each step costs too much
against mlx-lm's contiguous batch cache. Random-weight Qwen3-shaped model.

    python bench/gpu/paged_vs_contiguous.py --batch 1 8 32 --prompt 128 --gen 64
"""

from __future__ import annotations

import argparse
import random

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models import qwen3

from pippin.bench.inproc import decode_rate, mlx_lm_batch_rate


def build(hidden: int, layers: int, vocab: int, dtype: mx.Dtype) -> qwen3.Model:
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=hidden * 3,
        num_attention_heads=hidden // 64 or 1,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=4096,
        rope_theta=1e6,
        head_dim=64,
        tie_word_embeddings=True,
    )
    model = qwen3.Model(args)
    model.update(
        tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(dtype), model.parameters())
    )
    mx.eval(model.parameters())
    return model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    model = build(a.hidden, a.layers, a.vocab, getattr(mx, a.dtype))
    random.seed(0)
    print(
        f"device={mx.default_device()} hidden={a.hidden} layers={a.layers} "
        f"prompt={a.prompt} gen={a.gen}"
    )
    print("batch | mlx-lm BatchGenerator tok/s | pippin engine tok/s | ratio")
    for b in a.batch:
        prompts = [[random.randrange(a.vocab) for _ in range(a.prompt)] for _ in range(b)]
        decode_rate(model, prompts[:1], 4)  # warm-up
        ref = mlx_lm_batch_rate(model, prompts, a.gen)
        ours = decode_rate(model, prompts, a.gen)
        print(f"{b} | {ref:.0f} | {ours:.0f} | {ours / ref:.2f}")


if __name__ == "__main__":
    main()
