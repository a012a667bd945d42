"""The gated delta rule alone on the CPU: mlx-lm's path (`gated_delta_update`, a compiled
step a token off Metal) against pippin's chunked form (`pippin.kernels.gated_delta`), for
one layer of Qwen3.5 / Qwen3-Next shapes (Hv=32 value heads, Hk=16 key heads, Dk=Dv=128,
a float32 state), one row, a prompt chunk of T tokens from a zero state.

    .venv/bin/python bench/gated_delta.py --lengths 512 2048 8192
    .venv/bin/python bench/gated_delta.py --vector   # Kimi Linear's gates over Dk

Inputs are random (q, k l2-normalised as the models do) in --dtype; each time is the best
of --repeat runs (mlx-lm's once past --max-ref tokens: it takes minutes there), and the
two outputs are compared. mlx-lm's path keeps every step's state alive until its result
is evaluated (2 MB a token at these shapes: a 8192-token call needs ~17 GB), so past
--ref-chunk tokens it runs as calls of that many tokens, the state evaluated and carried
between them, as the engine's prompt chunks would (marked `*`). Where the device is a
GPU the same comparison runs there (pippin's side: the CUDA kernel).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np
from mlx_lm.models import gated_delta as mlx_gd

from pippin.kernels import gated_delta


def inputs(T: int, hv: int, hk: int, d: int, dtype: mx.Dtype, vector: bool) -> tuple:
    rng = np.random.default_rng(0)
    q, k = (mx.array(rng.standard_normal((1, T, hk, d)), dtype=dtype) for _ in range(2))
    q, k = mlx_gd.normalize_qk(q, k, inv_scale=d**-0.5, eps=1e-6)
    v = mx.array(rng.standard_normal((1, T, hv, d)), dtype=dtype)
    gate = (1, T, hv, d) if vector else (1, T, hv)
    a = mx.array(rng.standard_normal(gate), dtype=dtype)
    b = mx.array(rng.standard_normal((1, T, hv)), dtype=dtype)
    A_log = mx.array(rng.uniform(0, 2, (hv, 1) if vector else (hv,)), dtype=mx.float32)
    dt_bias = mx.array(rng.standard_normal((hv, d) if vector else (hv,)), dtype=dtype)
    args = (q, k, v, a, b, A_log, dt_bias)
    mx.eval(*args)
    return args


def best(fn: Callable[[], tuple[mx.array, mx.array]], repeat: int) -> tuple[float, tuple]:
    out: tuple = ()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        mx.eval(*out)
        times.append(time.perf_counter() - t)
    return min(times), out


def mlx_lm_path(args: tuple, chunk: int) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_update` over the T tokens, `chunk` at a time."""
    q, k, v, a, b, A_log, dt_bias = args
    ys, state = [], None
    for s in range(0, q.shape[1], chunk):
        part = (x[:, s : s + chunk] for x in (q, k, v, a, b))
        y, state = mlx_gd.gated_delta_update(*part, A_log, dt_bias, state)
        mx.eval(y, state)
        ys.append(y)
    return mx.concatenate(ys, axis=1), state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--hv", type=int, default=32)
    p.add_argument("--hk", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--vector", action="store_true", help="gates over Dk (Kimi Linear)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-ref", type=int, default=2048, help="mlx-lm's path once past this")
    p.add_argument("--ref-chunk", type=int, default=512, help="mlx-lm's calls at most this long")
    a = p.parse_args()
    dtype = getattr(mx, a.dtype)
    print(
        f"device {mx.default_device()}, Hv={a.hv} Hk={a.hk} Dk=Dv={a.dim} {a.dtype} "
        f"{'vector' if a.vector else 'scalar'} gates, B=1, best of {a.repeat}"
    )
    print(f"{'T':>6} {'mlx-lm s':>10} {'pippin s':>10} {'speedup':>8} {'max |dy|':>9}")
    for T in a.lengths:
        args = inputs(T, a.hv, a.hk, a.dim, dtype, a.vector)
        ours, got = best(lambda args=args: gated_delta.update(*args), a.repeat)
        ref_repeat = a.repeat if T <= a.max_ref else 1
        theirs, want = best(lambda args=args: mlx_lm_path(args, a.ref_chunk), ref_repeat)
        dy = float(mx.max(mx.abs(got[0].astype(mx.float32) - want[0].astype(mx.float32))))
        mark = "*" if T > a.ref_chunk else " "
        print(f"{T:>6} {theirs:>9.3f}{mark} {ours:>10.3f} {theirs / ours:>7.1f}x {dy:>9.2e}")


if __name__ == "__main__":
    main()
