"""K-quant GGUF weights re-quantised to MLX's affine format against the same weights
dequantised: quality on real text, memory and speed.

Both come from one GGUF file through pippin's loader: dequantised (`PIPPIN_GGUF_REQUANT=0`;
float32 on the CPU) and re-quantised (`PIPPIN_GGUF_REQUANT=1`: Q4_K/Q5_K -> 4 bits, Q6_K/Q8_0
-> 8 bits, group size 64, kept packed). Over a few hundred tokens of real text (this
repository's docs), teacher-forced, it reports:

- the mean log-probability difference of the actual next token (re-quantised minus
  dequantised) and its mean absolute value;
- greedy agreement: positions where both models' most likely next token is the same;
- the weights' bytes, the load time (first: conversion into the cache; then cached),
  prefill time of the text and decode tokens/s (packed, as served).

`--quality-only` scores the re-quantised weights unpacked to float32 (the same values, so
the same log-probabilities to rounding, at BLAS speed) and skips the timings; `--group-size`
picks the re-quantisation's group size (several: one row each).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python bench/gguf_requant.py --gguf PATH.gguf --tokens 300
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from pippin.store import gguf_loader
from pippin.store.loader import _dequantize_for_cpu, load_model

REQUANT_GROUP = gguf_loader.REQUANT_GROUP_SIZE
TEXT = Path(__file__).resolve().parent.parent / "docs" / "architecture.md"


def measure(
    gguf: str, requant: bool, ids: list[int], decode: int, unpack: bool = False
) -> dict[str, object]:
    os.environ["PIPPIN_GGUF_REQUANT"] = "1" if requant else "0"  # read at load
    cached = (gguf_loader.cache_folder(Path(gguf), requant) / "config.json").exists()
    t0 = time.perf_counter()
    loaded = load_model(gguf)
    load_s = time.perf_counter() - t0
    model = loaded.model
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    if unpack:
        _dequantize_for_cpu(model)
    x = mx.array(ids)[None]
    t0 = time.perf_counter()
    logits = model(x).astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    prefill_s = time.perf_counter() - t0
    cache = make_prompt_cache(model)
    mx.eval(model(x[:, :32], cache=cache))
    token = x[:, 32:33]
    t0 = time.perf_counter()
    for _ in range(0 if unpack else decode):
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        mx.eval(token)
    decode_tps = decode / (time.perf_counter() - t0) if not unpack else float("nan")
    out = np.array(logprobs[0])
    del model, loaded, logits, logprobs, cache
    gc.collect()
    mx.clear_cache()
    return {
        "logprobs": out,
        "weights": weights,
        "load_s": load_s,
        "cached": cached,
        "prefill_s": prefill_s,
        "decode_tps": decode_tps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="a K-quant GGUF file (e.g. Q4_K_M)")
    ap.add_argument("--tokens", type=int, default=400, help="tokens of text scored")
    ap.add_argument("--decode", type=int, default=32, help="decode steps timed")
    ap.add_argument("--group-size", type=int, nargs="+", default=[REQUANT_GROUP])
    ap.add_argument("--quality-only", action="store_true")
    args = ap.parse_args()
    os.environ["PIPPIN_CPU_UNPACK"] = "auto"
    tokenizer = load_model(args.gguf, weights=False).tokenizer
    ids = tokenizer.encode(TEXT.read_text())[: args.tokens]
    print(f"device {mx.default_device()}, {len(ids)} tokens of {TEXT.name}")
    base = measure(args.gguf, False, ids, args.decode, unpack=args.quality_only)
    a = base["logprobs"]
    assert isinstance(a, np.ndarray)
    nxt = np.array(ids[1:])
    rows = np.arange(len(nxt))
    print(f"dequantised: mean next-token logprob {a[rows, nxt].mean():.4f}")
    runs = [("dequantised", base)]
    for group in args.group_size:
        gguf_loader.REQUANT_GROUP_SIZE = group  # read at conversion; cached per group size
        requant = measure(args.gguf, True, ids, args.decode, unpack=args.quality_only)
        b = requant["logprobs"]
        assert isinstance(b, np.ndarray)
        diff = b[rows, nxt] - a[rows, nxt]
        agree = float(np.mean(a[:-1].argmax(-1) == b[:-1].argmax(-1)))
        print(
            f"group {group}: mean logprob difference (requant - dequant) {diff.mean():+.4f} "
            f"nats, mean |difference| {np.abs(diff).mean():.4f} nats, greedy agreement "
            f"{agree:.1%} of {len(nxt)} positions"
        )
        runs.append((f"requant g{group}", requant))
    for name, r in runs:
        print(
            f"{name:15s} weights {int(r['weights']) / 2**20:7.1f} MiB, load "  # type: ignore[call-overload]
            f"{r['load_s']:5.1f} s ({'cached' if r['cached'] else 'converted'}), prefill "
            f"{r['prefill_s']:6.2f} s, decode {r['decode_tps']:6.1f} tok/s"
        )


if __name__ == "__main__":
    main()
