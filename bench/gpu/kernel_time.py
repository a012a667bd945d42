"""Device time of a decode step's kernels, one kind at a time: pippin's against MLX's.

A single stream on the H200 spent 1.55 ms of device time a step in pippin against 0.88 ms
in mlx-lm (`probe_site` with `PIPPIN_PROBE_SYNC=2`): this says which kernel owes it.
For the shapes of `--model`'s config (default: Llama-3.2-1B's):

- each projection of a decode layer as pippin's fused matrix-vector kernel
  (`fused_layer.gemv`: norm + q/k/v; o_proj + residual; norm + gate/up + SwiGLU;
  down_proj + residual) and as MLX's ops compute the same;
- decode attention over `--context` tokens: pippin's paged kernel against
  `mx.fast.scaled_dot_product_attention` on contiguous keys, and the fused attention
  block (`fused_attention`: q/k/v split, RoPE, the KV write, attention) alone.

Each runs `--reps` times in one evaluation, its weights rotating through copies larger
than the GPU's L2 (a real step streams every layer's weights from memory). The launches are
independent: MLX's CUDA graphs may run them side by side, so the µs per launch is a
throughput. With `--chain` each launch's input depends on the previous launch's output
(`mx.depends`, no work on the device), as a step's kernels do: the µs per launch is then
the kernel's latency, start to end. Off CUDA, MLX's ops stand in for pippin's kernels (a
smoke test only).

    python3 bench/gpu/kernel_time.py --rows 1,8 --context 512,4096 [--chain]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)
import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gpu_bench import CONFIGS
from launches import Launch, after, copies, timed

from pippin.kernels import (
    device,
    fused_attention,
    fused_layer,
    paged_attention,
    patches,
)


def projection_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, int, bool, bool, bool]]:
    """A fused layer's projections of model config `cfg`: name -> (weight rows, input
    features, norm, SwiGLU, residual)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    return {
        "qkv": ((hq + 2 * hkv) * d, h, True, False, False),
        "o_proj": (h, hq * d, False, False, True),
        "gate_up": (2 * inter, h, True, True, False),
        "down": (h, inter, False, False, True),
    }


def projections(
    cfg: dict[str, Any], rows: int, reps: int, dtype: mx.Dtype, chain: bool
) -> list[dict]:
    kernel = fused_layer.gemv if device.on_cuda() else fused_layer.reference_gemv
    out = []
    for name, (n, k, norm, swiglu, res) in projection_shapes(cfg).items():
        weights = [
            (mx.random.normal((n, k)) * k**-0.5).astype(dtype)
            for _ in range(copies(n * k * dtype.size))
        ]
        rms = nn.RMSNorm(k)
        rms.weight = (1 + 0.1 * mx.random.normal((k,))).astype(dtype)
        plans = [fused_layer.Gemv(w, norm=rms if norm else None, swiglu=swiglu) for w in weights]
        x = mx.random.normal((rows, k)).astype(dtype)
        r = mx.random.normal((rows, plans[0].width)).astype(dtype) if res else None
        mx.eval(weights, x, r, rms.weight)

        def call(fn: Callable, p: fused_layer.Gemv, x=x, r=r) -> Launch:
            return lambda dep: fn(p, after(x, dep), r)

        us = timed([call(kernel, p) for p in plans], reps, chain)
        ref = timed([call(fused_layer.reference_gemv, p) for p in plans], reps, chain)
        gbs = n * k * dtype.size / us / 1e3
        out.append({"kernel": name, "rows": rows, "pippin_us": us, "mlx_us": ref, "GB/s": gbs})
        print(
            f"{name:8s} rows {rows:3d}  [{n:6d} x {k:5d}]  pippin {us:8.1f} µs ({gbs:6.0f} GB/s)"
            f"  mlx {ref:8.1f} µs",
            flush=True,
        )
    return out


def attention(
    cfg: dict[str, Any],
    rows: int,
    context: int,
    reps: int,
    dtype: mx.Dtype,
    chain: bool,
    bs: int = 16,
) -> dict:
    h, hq, hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // hq
    nb = -(-context // bs)
    rng = np.random.default_rng(0)
    num_blocks = rows * nb + 1
    tables = mx.array(rng.permutation(num_blocks)[: rows * nb].reshape(rows, nb).astype(np.int32))
    offsets = mx.full((rows,), context - 1, dtype=mx.int32)
    pool_bytes = 2 * hkv * num_blocks * bs * d * dtype.size
    pools = [
        (
            mx.random.normal((hkv, num_blocks * bs, d)).astype(dtype),
            mx.random.normal((hkv, num_blocks * bs, d)).astype(dtype),
        )
        for _ in range(copies(pool_bytes))
    ]
    q = mx.random.normal((rows, hq, 1, d)).astype(dtype)
    kv = [
        (
            mx.random.normal((rows, hkv, context, d)).astype(dtype),
            mx.random.normal((rows, hkv, context, d)).astype(dtype),
        )
        for _ in range(len(pools))
    ]
    mx.eval(pools, kv, q, tables)
    kernel = (
        paged_attention.paged_decode_attention
        if device.on_cuda()
        else paged_attention.reference_decode_attention
    )
    scale = d**-0.5

    def ours(k: mx.array, v: mx.array) -> Launch:
        return lambda dep: kernel(after(q, dep), k, v, tables, offsets, scale, bs)

    def theirs(k: mx.array, v: mx.array) -> Launch:
        return lambda dep: mx.fast.scaled_dot_product_attention(after(q, dep), k, v, scale=scale)

    us = timed([ours(k, v) for k, v in pools], reps, chain)
    ref = timed([theirs(k, v) for k, v in kv], reps, chain)
    attn = _fused_block(cfg, dtype)
    t, o = np.array(tables), np.array(offsets)
    slots = mx.array(t[np.arange(rows), o // bs] * bs + o % bs, dtype=mx.int32)
    lay = SimpleNamespace(gather_blocks=tables, offsets=offsets, block_size=bs, write_slots=slots)
    qkv = mx.random.normal((rows, 1, (hq + 2 * hkv) * d)).astype(dtype)
    block = (
        fused_attention.fused_decode_attention if device.on_cuda() else fused_attention.reference
    )

    def fused(k: mx.array, v: mx.array) -> Launch:
        return lambda dep: block(attn, after(qkv, dep), [k, v], lay)

    fus = timed([fused(k, v) for k, v in pools], reps, chain)
    read = 2 * rows * hkv * context * d * dtype.size
    print(
        f"attention rows {rows:3d}  context {context:6d}  pippin {us:8.1f} µs "
        f"({read / us / 1e3:6.0f} GB/s)  mlx sdpa {ref:8.1f} µs  fused block {fus:8.1f} µs",
        flush=True,
    )
    return {
        "kernel": "attention",
        "rows": rows,
        "context": context,
        "pippin_us": us,
        "mlx_us": ref,
        "fused_block_us": fus,
    }


def _fused_block(cfg: dict[str, Any], dtype: mx.Dtype) -> Any:
    """A Llama attention module of `cfg`'s shape, fused as the engine fuses it."""
    from mlx_lm.models import llama

    h, hq, hkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=h,
        num_hidden_layers=1,
        intermediate_size=cfg["intermediate_size"],
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        head_dim=cfg.get("head_dim") or h // hq,
        rms_norm_eps=1e-5,
        vocab_size=32,
        rope_theta=500000.0,
    )
    attn = llama.Attention(args)
    attn.set_dtype(dtype)
    assert patches.fuse_projections(attn) == 1 and patches.fuse_attention(attn)
    return attn


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, help="a model folder whose config.json to take")
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--context", default="512,4096")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chain", action="store_true", help="each launch after the previous one")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.model:
        cfg = json.loads((args.model / "config.json").read_text())
    else:
        cfg = CONFIGS["llama-3.2-1b"]
    dtype = getattr(mx, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    tiny = mx.zeros((8,), dtype)
    floor = timed([lambda dep: after(tiny, dep) * 2], args.reps, args.chain)
    print(f"{'chained' if args.chain else 'independent'} launches; a tiny op: {floor:.1f} µs")
    results: list[dict] = [{"kernel": "floor", "us": floor}]
    for r in rows:
        results += projections(cfg, r, args.reps, dtype, args.chain)
    for r in rows:
        for c in (int(c) for c in args.context.split(",")):
            results.append(attention(cfg, r, c, args.reps, dtype, args.chain))
    if args.out:
        out = {"device": str(mx.default_device()), "chain": args.chain, "results": results}
        args.out.write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
