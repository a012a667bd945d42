"""The gated delta rule (Qwen3-Next / Qwen3.5, Kimi Linear, ...) off Metal: a CUDA kernel,
and on the CPU the chunkwise-parallel form in numpy.

mlx-lm's `gated_delta_update` has Metal kernels only; elsewhere it loops over a chunk's
tokens in Python, one compiled step (a full pass over the [B, Hv, Dv, Dk] state) per token
per layer: a 2k-token prompt chunk is ~2k launches a layer on CUDA, and minutes of state
passes for a long prompt on the CPU. `update` is a drop-in replacement (same arguments,
same results: y [B, T, Hv, Dv] in q's dtype, the state [B, Hv, Dv, Dk] in float32):

- On CUDA, one launch of `_SOURCE` per call, for every T (decode too): mlx-lm's Metal
  kernel ported (a warp reduces over Dk for one value row, the row's state in its lanes'
  registers, sequential over the tokens, the next token's inputs loaded ahead).
- On the CPU, for T >= `MIN_TOKENS`, the WY / UT-transform form of "Gated Delta Networks"
  (Yang et al., 2024; flash-linear-attention's `chunk_gated_delta_rule`): within chunks of
  `CHUNK` tokens the recurrence is a unit-lower-triangular solve and matmuls on BLAS, and
  only the state carries from chunk to chunk (`_head`). A thread per core takes a key
  head at a time (`cpu_prefill`'s pool, BLAS on one thread each).

A masked position (`mask` [B, T] False: a padded row's tail) leaves the state untouched,
as mlx-lm's ops path does; its y is 0 (as mlx-lm's Metal kernel writes; the ops path's
is unused garbage). Gates are scalar [B, T, Hv] or a vector over Dk [B, T, Hv, Dk]; GQA
takes Hv = r * Hk. `PIPPIN_GATED_DELTA=0` keeps mlx-lm's own everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g

from pippin.kernels import cpu_prefill, device

CHUNK = 64  # tokens a chunk: the solve is CHUNK^3, the state passes T / CHUNK
# Fewer tokens (decode, short verifies) keep mlx-lm's step loop: at Qwen3.5's shapes on
# the CPU the two are even at 8 tokens, the chunked form 2.7x quicker at 16.
MIN_TOKENS = 16
_BLOCK = 16  # rows of the solve's blocks; vector gates: pairwise decays within them
_LOG_FLOOR = -1e4  # a gate of 0 has log -inf; exp of this is 0 just the same, without NaNs
# Decays below e^_FLUSH (1e-26) and products below _TINY count as 0: a denormal float
# slows every BLAS product it enters ~10x on x86 (a strongly decaying head makes many),
# and beside the undecayed terms such values are lost in float32 rounding anyway.
_FLUSH = np.float32(-60)
_TINY = np.float32(1e-30)
_SPAN = np.float32(40)  # vector gates: see `_vector_scores`


def routed(original: Callable[..., Any], on_host: bool) -> Callable[..., Any]:
    """`original` (the `gated_delta_update` bound in an mlx-lm module) with calls inside
    pippin's model runner through `update`: on CUDA always, on the host (`on_host`:
    `cpu_prefill.wanted`) for prompt chunks. Everyone else's calls are untouched."""

    def gated_delta_update(
        q: mx.array,
        k: mx.array,
        v: mx.array,
        a: mx.array,
        b: mx.array,
        A_log: mx.array,
        dt_bias: mx.array,
        state: mx.array | None = None,
        mask: mx.array | None = None,
        *,
        use_kernel: bool = True,
        lower_bound: float | None = None,
        allow_neg_eigval: bool = False,
    ) -> tuple[mx.array, mx.array]:
        args = (q, k, v, a, b, A_log, dt_bias, state, mask)
        opts = {"lower_bound": lower_bound, "allow_neg_eigval": allow_neg_eigval}
        # (cpu_prefill's scope: set while pippin's runner calls the model)
        if use_kernel and getattr(cpu_prefill._scope, "on", False):
            if kernel_applies(q) or (on_host and q.shape[1] >= MIN_TOKENS):
                return update(*args, **opts)
        return original(*args, use_kernel=use_kernel, **opts)

    return gated_delta_update


def kernel_applies(q: mx.array) -> bool:
    """Whether the CUDA kernel takes these queries ([B, T, Hk, Dk])."""
    return q.shape[-1] % 32 == 0 and hasattr(mx.fast, "cuda_kernel") and device.on_cuda()


def update(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
    *,
    lower_bound: float | None = None,
    allow_neg_eigval: bool = False,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_update`: the CUDA kernel where it applies, else the chunked
    form in numpy. q, k [B, T, Hk, Dk] (normalised, q scaled); v [B, T, Hv, Dv]; a, b
    [B, T, Hv] (a [B, T, Hv, Dk] for vector gates); state [B, Hv, Dv, Dk] or None."""
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if kernel_applies(q):
        if lower_bound is None:
            g = compute_g(A_log, a, dt_bias)
        else:
            g = compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
        return cuda_recurrence(q, k, v, g, beta, state, mask)
    log_g = _log_gates(a, A_log, dt_bias, lower_bound)
    return chunked(q, k, v, log_g, beta, state, mask)


# --- the CPU: chunkwise-parallel form ----------------------------------------------


def _log_gates(
    a: mx.array, A_log: mx.array, dt_bias: mx.array, lower_bound: float | None
) -> np.ndarray:
    """log g of mlx-lm's `compute_g` / `compute_lower_bound_g`, in numpy (vector gates
    have an element per key dim: MLX's exp would cost 25 ns each). Float32, [B, T, Hv(, Dk)]."""
    A = np.exp(cpu_prefill._host(A_log))
    if lower_bound is None:
        x = cpu_prefill._host(a + dt_bias)  # added in MLX, in their dtype, as mlx-lm does
        # softplus (np.logaddexp is 5x slower)
        sp = np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0)
        return -A * sp
    x = A * (cpu_prefill._host(a) + cpu_prefill._host(dt_bias))
    with np.errstate(over="ignore"):
        return np.float32(lower_bound) / (1 + np.exp(-x))


def chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_g: np.ndarray,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """The recurrence in chunks of `CHUNK` tokens, in numpy. `log_g` [B, T, Hv] or
    [B, T, Hv, Dk]: the gates' logs; beta [B, T, Hv]. Returns (y, state) as `update`."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    r = Hv // Hk
    qn, kn, vn = cpu_prefill._host(q), cpu_prefill._host(k), cpu_prefill._host(v)
    bn = cpu_prefill._host(beta)
    lg = np.maximum(log_g.reshape(B, T, Hv, -1), _LOG_FLOOR)  # [..., 1] for scalar gates
    if mask is not None:  # a masked token: decay 1, no write
        keep = np.asarray(mask.astype(mx.bool_))
        lg = np.where(keep[:, :, None, None], lg, np.float32(0))
        bn = np.where(keep[:, :, None], bn, np.float32(0))
    s0 = None if state is None else cpu_prefill._host(state)
    y = np.empty((B, T, Hv, Dv), dtype=np.float32)
    s1 = np.empty((B, Hv, Dv, Dk), dtype=np.float32)
    n = -(-T // CHUNK)

    def padded(x: np.ndarray) -> np.ndarray:
        """[T, ...] as [chunks, CHUNK, ...], zeros after T (decay 1, beta 0: no effect)."""
        out = np.zeros((n * CHUNK, *x.shape[1:]), dtype=x.dtype)
        out[:T] = x
        return out.reshape(n, CHUNK, *x.shape[1:])

    def group(b: int, hk: int) -> None:
        qc, kc = padded(qn[b, :, hk]), padded(kn[b, :, hk])
        shared = None
        if lg.shape[-1] == 1:  # scalar gates: q.k and k.k serve the group's r value heads
            shared = (qc @ kc.transpose(0, 2, 1), kc @ kc.transpose(0, 2, 1))
        for hv in range(hk * r, (hk + 1) * r):
            h0 = np.zeros((Dk, Dv), dtype=np.float32) if s0 is None else s0[b, hv].T
            per_head = (padded(x[b, :, hv]) for x in (vn, lg, bn))
            yc, h = _head(qc, kc, *per_head, h0, shared)
            y[b, :, hv] = yc.reshape(-1, Dv)[:T]
            s1[b, hv] = h.T

    cpu_prefill._run([functools.partial(group, b, hk) for b in range(B) for hk in range(Hk)])
    if mask is not None:
        y[~keep] = 0
    return mx.array(y).astype(q.dtype), mx.array(s1)


def _head(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    lg: np.ndarray,
    beta: np.ndarray,
    h: np.ndarray,
    shared: tuple[np.ndarray, np.ndarray] | None,
) -> tuple[np.ndarray, np.ndarray]:
    """One value head's outputs [n, C, Dv] and final state H = S^T [Dk, Dv], from its
    chunks q, k [n, C, Dk], v [n, C, Dv], log gates [n, C, 1 or Dk], beta [n, C] and
    initial state `h`; `shared`: the chunks' q.k^T and k.k^T (scalar gates).

    With H the state as [Dk, Dv] and, within a chunk, G_t the gates' product up to t,
    the token writes u_t = beta_t (v_t - (g_t H_{t-1})^T k_t) make
    H_t = G_t H_0 + sum_{j<=t} (G_t / G_j) k_j u_j^T. Written out, U = U0 - W H_0 with
    (I + A) [U0 | W] = [beta V | beta G K], A_tj = beta_t (G_t / G_j) k_t.k_j (j < t);
    then Y = (G Q) H_0 + P U, P_tj = (G_t / G_j) q_t.k_j (j <= t), and the chunk's last
    state H_C = G_C H_0 + (K G_C / G)^T U. All but the last three products are the same
    for every chunk at once; those three carry H from chunk to chunk.
    """
    n, C, _ = k.shape
    gam = np.cumsum(lg, axis=1, dtype=np.float64)  # log G: [n, C, 1 or Dk]
    if shared is not None:  # scalar: the decays G_t / G_j, a [C, C] per chunk
        diff = (gam[:, :, None, 0] - gam[:, None, :, 0]).astype(np.float32)
        decay = np.tril(_decay(np.minimum(diff, 0)))  # above the diagonal: dropped
        p, a = shared[0] * decay, shared[1] * decay
    else:
        p, a = _vector_scores(q, k, gam)
    a *= beta[:, :, None]
    G = _decay(gam.astype(np.float32))
    rhs = np.concatenate([beta[..., None] * v, (beta[..., None] * G) * k], axis=-1)
    x = _unit_lower_solve(a, rhs)
    dv = v.shape[-1]
    u0 = x[..., :dv]
    wq = np.concatenate([x[..., dv:], q * G], axis=1)  # [W; G Q]: one product with H
    last = gam[:, -1:]  # [n, 1, 1 or Dk]
    kd = (k * _decay((last - gam).astype(np.float32))).transpose(0, 2, 1)
    g_last = _decay(last[:, 0, :, None].astype(np.float32))  # [n, 1 or Dk, 1]: rows of H
    y = np.empty_like(v)
    for c in range(n):
        wh = wq[c] @ h
        u = u0[c] - wh[:C]
        y[c] = wh[C:] + p[c] @ u
        h = g_last[c] * h + kd[c] @ u
    return y, h


def _decay(log: np.ndarray) -> np.ndarray:
    """exp of the float32 log-decays `log` (<= 0; overwritten), 0 below e^`_FLUSH`."""
    log[log < _FLUSH] = -np.inf
    return np.exp(log, out=log)


def _flush(x: np.ndarray) -> np.ndarray:
    """`x` with entries below `_TINY` set to 0 (in place)."""
    x[np.abs(x) < _TINY] = 0
    return x


def _unit_lower_solve(a: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """(I + a)^-1 rhs for `a` [n, C, C] (only its strictly lower part is read), rhs
    [n, C, m]: forward substitution by blocks of `_BLOCK` rows (LAPACK's solvers take ~0.5
    ms for one 64 x 64 system: these batched matmuls are 5x quicker). The blocks' own
    inverses go row by row, every block of every chunk at once. Each block's result is
    flushed before the later ones read it: the rows of a strongly decaying chunk shrink
    with its decay, and would otherwise turn denormal along the substitution."""
    n, C, _ = a.shape
    nb, s = C // _BLOCK, _BLOCK
    assert C == nb * s, (C, s)
    d = a.reshape(n, nb, s, nb, s)[:, np.arange(nb), :, np.arange(nb), :]  # [nb, n, s, s]
    inv = np.zeros_like(d)
    inv[..., np.arange(s), np.arange(s)] = 1
    for i in range(1, s):
        inv[..., i, :i] = -(d[..., i : i + 1, :i] @ inv[..., :i, :i])[..., 0, :]
    _flush(inv)
    x = np.empty_like(rhs)
    for i in range(nb):
        r = rhs[:, i * s : (i + 1) * s]
        if i:
            r = r - a[:, i * s : (i + 1) * s, : i * s] @ x[:, : i * s]
        x[:, i * s : (i + 1) * s] = _flush(inv[i] @ r)
    return x


def _vector_scores(q: np.ndarray, k: np.ndarray, gam: np.ndarray) -> tuple[np.ndarray, ...]:
    """Vector gates: P_tj = sum_d q_td k_jd exp(gam_td - gam_jd) and the same of k for
    A (j <= t; 0 above), each [n, C, C], as matmuls of (q_t e^{gam_t - ref}) and (k_j
    e^{ref - gam_j}) for a reference `ref` per block of `_BLOCK` keys. The rows after a
    block factor through its last position (both factors <= 1); the block's own rows
    through its first (one factor up to e^_SPAN), in the chunks whose block decays by no
    more than that in any dim, and pair by pair in the others."""
    n, C, D = k.shape
    p, a = (np.zeros((n, C, C), dtype=np.float32) for _ in range(2))
    for s in range(0, C, _BLOCK):
        e = min(C, s + _BLOCK)
        g = gam[:, s:e]
        rel = (g - g[:, :1]).astype(np.float32)  # <= 0, decreasing: float32 near 0
        grow = np.exp(-np.maximum(rel, -_SPAN))
        right = (k[:, s:e] * grow).transpose(0, 2, 1)
        shrink = _decay(rel.copy())
        p[:, s:e, s:e] = (q[:, s:e] * shrink) @ right
        a[:, s:e, s:e] = (k[:, s:e] * shrink) @ right
        steep = np.flatnonzero(rel[:, -1].min(axis=-1) < -_SPAN)
        if steep.size:  # [chunks, t, j, D]; above the diagonal: dropped
            r = rel[steep]
            kd = _decay(np.minimum(r[:, :, None, :] - r[:, None, :, :], 0))
            kd *= k[steep, None, s:e]
            p[steep, s:e, s:e] = np.einsum("ntd,ntjd->ntj", q[steep, s:e], kd)
            a[steep, s:e, s:e] = np.einsum("ntd,ntjd->ntj", k[steep, s:e], kd)
        if e < C:
            ref = gam[:, e - 1 : e]
            right = (k[:, s:e] * _decay((ref - g).astype(np.float32))).transpose(0, 2, 1)
            left = _decay((gam[:, e:] - ref).astype(np.float32))
            p[:, e:, s:e] = (q[:, e:] * left) @ right
            a[:, e:, s:e] = (k[:, e:] * left) @ right
    return np.tril(p), np.tril(a, -1)


# --- CUDA --------------------------------------------------------------------------

_NWARPS = 4  # value rows a thread block

# One warp per (row, value head, value dim): lane i holds the state's elements
# i, i + 32, ... of that value row (coalesced loads of k, q and vector gates), reduces
# k.S and q.S with shuffles, and steps through the tokens; the next token's inputs are
# loaded before this one's reductions. Output `out`: the final state [B, Hv, Dv, Dk],
# then y [B, T, Hv, Dv], both float32.
_SOURCE = r"""
    constexpr int NPL = Dk / 32;
    constexpr int RG = (Dv + NW - 1) / NW;
    const int lane = threadIdx.x % 32;
    const int n = blockIdx.x / RG;  // b * Hv + hv
    const int dv = (blockIdx.x % RG) * NW + threadIdx.x / 32;
    if (dv >= Dv) return;
    const int b = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);
    const int L = q_shape[1];
    const size_t tok0 = (size_t)b * L;

    const auto* q_ = q + (tok0 * Hk + hk) * Dk + lane;
    const auto* k_ = k + (tok0 * Hk + hk) * Dk + lane;
    const auto* v_ = v + (tok0 * Hv + hv) * Dv + dv;
    const auto* beta_ = beta + tok0 * Hv + hv;
    const auto* g_ = VEC ? g + (tok0 * Hv + hv) * Dk + lane : g + tok0 * Hv + hv;
    constexpr int GS = VEC ? Hv * Dk : Hv;  // a token's stride in g
    float* y_ = out + (size_t)q_shape[0] * Hv * Dv * Dk + (tok0 * Hv + hv) * Dv + dv;

    float st[NPL];
    const auto* s_in = state_in + ((size_t)n * Dv + dv) * Dk + lane;
    #pragma unroll
    for (int i = 0; i < NPL; ++i) st[i] = static_cast<float>(s_in[i * 32]);

    float kn[NPL], qn[NPL], gn[VEC ? NPL : 1], vn = 0.f, bn = 0.f;
    bool on = true;
    auto load = [&](int t) {
        #pragma unroll
        for (int i = 0; i < NPL; ++i) {
            kn[i] = static_cast<float>(k_[(size_t)t * Hk * Dk + i * 32]);
            qn[i] = static_cast<float>(q_[(size_t)t * Hk * Dk + i * 32]);
            if constexpr (VEC) gn[i] = static_cast<float>(g_[(size_t)t * GS + i * 32]);
        }
        if constexpr (!VEC) gn[0] = static_cast<float>(g_[(size_t)t * GS]);
        vn = static_cast<float>(v_[(size_t)t * Hv * Dv]);
        bn = static_cast<float>(beta_[(size_t)t * Hv]);
        MASK_LOAD
    };
    if (L > 0) load(0);
    for (int t = 0; t < L; ++t) {
        float kc[NPL], qc[NPL], gc[VEC ? NPL : 1];
        #pragma unroll
        for (int i = 0; i < NPL; ++i) {
            kc[i] = kn[i];
            qc[i] = qn[i];
            if constexpr (VEC) gc[i] = gn[i];
        }
        if constexpr (!VEC) gc[0] = gn[0];
        const float vc = vn, bc = bn;
        const bool onc = on;
        if (t + 1 < L) load(t + 1);
        if (!onc) {  // masked: the state stays, y is 0
            if (lane == 0) y_[(size_t)t * Hv * Dv] = 0.f;
            continue;
        }
        float kv = 0.f;
        #pragma unroll
        for (int i = 0; i < NPL; ++i) {
            st[i] *= gc[VEC ? i : 0];
            kv += st[i] * kc[i];
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) kv += __shfl_xor_sync(0xffffffff, kv, o);
        const float delta = (vc - kv) * bc;
        float acc = 0.f;
        #pragma unroll
        for (int i = 0; i < NPL; ++i) {
            st[i] += kc[i] * delta;
            acc += st[i] * qc[i];
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
        if (lane == 0) y_[(size_t)t * Hv * Dv] = acc;
    }
    float* s_out = out + ((size_t)n * Dv + dv) * Dk + lane;
    #pragma unroll
    for (int i = 0; i < NPL; ++i) s_out[i * 32] = st[i];
"""


def cuda_recurrence(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    mask: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """mlx-lm's `gated_delta_kernel` (g [B, T, Hv] or [B, T, Hv, Dk], beta [B, T, Hv]) as
    one CUDA launch. Returns (y in q's dtype, the state in float32)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    assert Dk % 32 == 0 and Hv % Hk == 0, (q.shape, v.shape)
    if state is None:
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    names = ("q", "k", "v", "g", "beta", "state_in")
    inputs = [q, k, v, g, beta, state]
    if mask is not None:  # as int32: MLX's kernels take no bool pointers in every build
        names += ("mask",)
        inputs.append(mask.astype(mx.int32))
    n_state = B * Hv * Dv * Dk
    # (a plain function's discarded `if constexpr` branch is still compiled: no `mask` name
    # may appear in the unmasked build)
    load = "on = mask[tok0 + t] != 0;" if mask is not None else ""
    source = _SOURCE.replace("MASK_LOAD", load)
    out = device.cuda_kernel("pippin_gated_delta", names, source)(
        inputs=inputs,
        template=[
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            ("NW", _NWARPS),
            ("VEC", g.ndim == 4),
        ],
        grid=(B * Hv * -(-Dv // _NWARPS) * _NWARPS * 32, 1, 1),
        threadgroup=(_NWARPS * 32, 1, 1),
        output_shapes=[(n_state + B * T * Hv * Dv,)],
        output_dtypes=[mx.float32],
    )[0]
    y = out[n_state:].reshape(B, T, Hv, Dv).astype(q.dtype)
    return y, out[:n_state].reshape(B, Hv, Dv, Dk)
