"""Prompt chunks on the CPU: attention and the SwiGLU activation through numpy.

MLX's CPU backend evaluates transcendental functions one element at a time: `exp`,
`sigmoid` and `tanh` cost 25-30 ns an element on this project's 2-core CI machines,
against about 2 ns for numpy's vectorised `exp`. A prompt chunk's attention takes one
`exp` per score (heads x queries x keys, 75M a layer for a 4k-token prompt of
SmolLM2) and its SwiGLU one per hidden unit, so on the CPU these, not the matmuls, set
the time to the first token: 4k tokens took a minute (`bench/cpu_prefill.py`).

Here a chunk's attention runs in numpy, a tile of queries at a time: each tile's scores
(query rows of the grouped heads x the keys it can see) stay small enough for the cache,
a causal tile skips the keys after its last query (half the work of a fresh prompt),
and numpy's BLAS does both products. The tiles run on a thread per core (numpy releases
the GIL), BLAS held to one thread meanwhile so that the two do not oversubscribe the
cores; the SwiGLU's rows are split the same way. The result is the same arithmetic as MLX's
fallback (scaled scores, a max-subtracted softmax in float32); a fully masked row gets
MLX's uniform weights, not NaN. Decode steps over a long context (`DECODE_KEYS`) take the
same attention; shorter ones, compiled decode graphs and quantised KV keep MLX's own.

`PIPPIN_CPU_PREFILL`: `auto` (the default: on when MLX computes on the CPU), `0` (MLX's
own ops) or `1` (on whatever the device; tests use it to compare).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import mlx.core as mx
import numpy as np

# Score elements of one tile (query rows x keys, float32): 512K elements are 2 MiB,
# under the per-core L2 cache of the machines measured.
TILE_SCORES = 1 << 19
MAX_TILE = 256  # queries of one tile at most (short prompts)
MIN_TILE = 16
_MASKED = np.finfo(np.float32).min  # as MLX masks: finite, so a fully masked row is uniform


# Set while pippin's model runner calls the model: the SwiGLU route (bound in mlx-lm's
# modules, so seen by every caller in the process) changes nothing for anyone else.
_scope = threading.local()


@contextlib.contextmanager
def in_runner() -> Iterator[None]:
    before = getattr(_scope, "on", False)
    _scope.on = True
    try:
        yield
    finally:
        _scope.on = before


def wanted(mode: str) -> bool:
    """Whether prompt chunks take this path; `mode` is `KernelConfig.cpu_prefill`."""
    return mode == "1" or (mode == "auto" and mx.default_device() == mx.cpu)


# A decode step's attention goes through numpy too once its rows see this many keys: one
# query a row costs an exp per key, and past here those outweigh the round trip.
DECODE_KEYS = 1024


def applies(queries: mx.array, keys: mx.array, traced: bool = False) -> bool:
    """A prompt chunk (several queries a row), or a decode step over a long context that
    no compiled graph traces (a trace cannot leave MLX)."""
    if queries.ndim != 4 or traced:
        return False
    return queries.shape[2] > 1 or keys.shape[2] >= DECODE_KEYS


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


@functools.cache
def _pool() -> tuple[ThreadPoolExecutor, Any]:
    from threadpoolctl import ThreadpoolController

    return ThreadPoolExecutor(_cores(), thread_name_prefix="cpu-prefill"), ThreadpoolController()


def _run(tasks: list[Callable[[], None]]) -> None:
    """Every task, on a thread per core; BLAS on one thread each meanwhile."""
    if _cores() == 1 or len(tasks) == 1:
        for task in tasks:
            task()
        return
    pool, blas = _pool()
    with blas.limit(limits=1, user_api="blas"):
        for f in [pool.submit(task) for task in tasks]:
            f.result()


def _host(x: mx.array) -> np.ndarray:
    """`x` as float32 numpy (no copy when it already is float32 and contiguous)."""
    if x.dtype != mx.float32:
        x = x.astype(mx.float32)
    return np.asarray(x)


def _tile(rows_per_query: int, keys: int) -> int:
    t = TILE_SCORES // max(1, rows_per_query * keys)
    return int(min(MAX_TILE, max(MIN_TILE, t)))


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """`mx.fast.scaled_dot_product_attention` for a prompt chunk, in numpy.

    queries [B, Hq, L, D]; keys, values [B, Hkv, S, D]; mask "causal" (queries aligned to
    the last keys), a boolean or additive array broadcastable to [B, Hq, L, S], or None;
    `sinks` [Hq]: a logit per query head that takes a share of the softmax and no value.
    Returns [B, Hq, L, Dv] in the queries' dtype."""
    B, hq, L, D = queries.shape
    hkv, S = keys.shape[1], keys.shape[2]
    g = hq // hkv
    q = _host(queries)
    k, v = _host(keys), _host(values)
    m = None
    if isinstance(mask, mx.array):
        host = np.asarray(mask) if mask.dtype == mx.bool_ else _host(mask)
        m = np.broadcast_to(host, (B, hq, L, S))
    causal = mask == "causal" if isinstance(mask, str) else False
    sink = None if sinks is None else _host(sinks).reshape(hkv, g, 1, 1)
    out = np.empty((B, hq, L, v.shape[-1]), dtype=np.float32)
    T = _tile(g, S)
    upper = np.triu(np.ones((T, T), dtype=bool), 1)  # a causal tile's diagonal block
    scaled = q * np.float32(scale)

    def tile(b: int, h: int, a: int) -> None:
        e = min(L, a + T)
        n = e - a
        end = S - L + e if causal else S  # the keys this tile can see
        qt = scaled[b, h * g : (h + 1) * g, a:e].reshape(g * n, D)
        sc = (qt @ k[b, h, :end].T).reshape(g, n, end)
        if causal:
            diag = sc[:, :, end - n :]
            diag[:, upper[:n, :n]] = _MASKED
        elif m is not None:
            mt = m[b, h * g : (h + 1) * g, a:e, :end]
            if mt.dtype == np.bool_:
                np.putmask(sc, ~mt, _MASKED)
            else:
                sc += mt
        top = sc.max(axis=-1, keepdims=True)
        if sink is not None:
            top = np.maximum(top, sink[h])
        np.subtract(sc, top, out=sc)
        with np.errstate(under="ignore"):  # (numpy's error state is per thread)
            np.exp(sc, out=sc)
        total = sc.sum(axis=-1, keepdims=True)
        if sink is not None:
            total += np.exp(sink[h] - top)
        o = (sc.reshape(g * n, end) @ v[b, h, :end]).reshape(g, n, -1)
        np.divide(o, total, out=out[b, h * g : (h + 1) * g, a:e])

    # The last tiles of a causal chunk see the most keys: first, for an even finish.
    starts = sorted(range(0, L, T), reverse=causal)
    _run([functools.partial(tile, b, h, a) for a in starts for b in range(B) for h in range(hkv)])
    return mx.array(out).astype(queries.dtype)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu` (silu(gate) * x) in numpy: one vectorised exp an element."""
    gn = _host(gate).reshape(-1, gate.shape[-1])
    xn = _host(x).reshape(gn.shape)
    out = np.empty(gn.shape, dtype=np.float32)

    def rows(a: int, e: int) -> None:
        t = out[a:e]
        np.negative(gn[a:e], out=t)
        with np.errstate(over="ignore"):  # inf for very negative gates: gate / inf = -0
            np.exp(t, out=t)
        t += 1.0
        np.divide(gn[a:e], t, out=t)
        t *= xn[a:e]

    step = -(-len(gn) // _cores())
    _run([functools.partial(rows, a, a + step) for a in range(0, len(gn), step)])
    return mx.array(out.reshape(gate.shape)).astype(gate.dtype)


def routed_swiglu(original: Any) -> Any:
    """`original` (an mlx-lm module's `swiglu`) with prompt chunks through `swiglu`: a
    dense MLP's [B, L, hidden] with L > 1, inside `in_runner`. Decode steps (L = 1, which
    a compiled graph may trace) and MoE experts' shapes keep the original."""

    def swiglu_(gate: mx.array, x: mx.array) -> mx.array:
        chunk = gate.ndim == 3 and gate.shape[1] > 1 and gate.shape == x.shape
        if chunk and getattr(_scope, "on", False):
            return swiglu(gate, x)
        return original(gate, x)

    return swiglu_
