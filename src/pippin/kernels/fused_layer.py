"""A small decode batch's transformer layer as five CUDA kernels.

A single stream's decode step on a GPU is bound by host time, not by the device: on the
H200 a 16-layer Llama-3.2-1B step costs the same with its layers 2,048 wide as 256 wide,
and MLX spends about 4 µs of host time per kernel it launches (measured by
`bench/gpu/gpu_probe.sh floor`), about 15 kernels a layer. For the layers of mlx-lm's
`llama`, `qwen2` and `qwen3` this module runs a decode batch of at most `MAX_ROWS` rows
through five:

1. the input RMSNorm and the fused q/k/v projection (`fused_proj`);
2. the attention block (`fused_attention`: q/k norms, RoPE, the KV write, attention);
3. the output projection plus the residual;
4. the post-attention RMSNorm, the fused gate/up projection and SwiGLU;
5. the down projection plus the residual.

Kernels 1, 3, 4 and 5 are one matrix-vector kernel (`gemv`) with the norm, SwiGLU and
residual as options: one warp per output row reads the weight row once for every row of
the batch, so the device still streams each weight once a step. Each rounds where mlx-lm's
ops round (to the model's dtype after the norm, the projection and each SwiGLU op), so
the results match theirs to the dtype's precision, not bit for bit.

Quantised layers (MLX affine, the layers `quant_matmul.applies` to) can take the same
five steps with `quant_matvec.fused` as the projections' kernel: the matrix-vector form of
the quantised product with the norm, SwiGLU and residual as options, for decode batches of
up to `QUANT_MAX_ROWS` (16) rows where the layer's own decode product takes that form
(`dense_quant`, `PIPPIN_QUANT_KERNEL`). Only when `PIPPIN_FUSED_LAYER` names them (`all`,
or projections): on an H200 it made one 4-bit 8B stream slower, 176.8 tok/s against 245.9
with mlx-lm's layer around pippin's products (`QUANT_KERNELS` is empty), most likely the
norm applied to the activations inside the product's loop (see docs/benchmarks.md).

Where it applies: every layer exactly mlx-lm's `TransformerBlock` of those families, its
attention fused by `fused_attention`, plain RMSNorms, projections all unquantised or all
quantised (a bias on q/k/v or the output projection is kept), an MLP of exactly SwiGLU.
Larger batches read each weight row for more rows than a warp holds in registers; they
keep mlx-lm's layer, whose matmuls suit them. By default the down projection runs as the
kernel, and gate/up for a lone row, the others as MLX's ops (`DEFAULT_KERNELS`: measured
fastest); quantised layers only when named (`QUANT_KERNELS`).
`PIPPIN_FUSED_LAYER=0` turns it off; `=qkv/o` (any of `PROJECTIONS`, each optionally
`:ROWS`, the most rows it runs for) runs only those projections as the kernel, MLX's ops
the rest. Off CUDA, tests run the same hook with `reference_gemv` (MLX's ops) standing in
for the kernel.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import (
    dense_quant,
    device,
    fused_attention,
    fused_proj,
    paged_attention,
    quant_matvec,
)

MAX_ROWS = 8  # the plain weights' kernel (`gemv`)
QUANT_MAX_ROWS = quant_matvec.MAX_ROWS  # quantised layers' (`quant_matvec.fused`)
_NWARPS = 4  # output rows per thread block
CLASSES = tuple((family, "TransformerBlock") for family in ("llama", "qwen2", "qwen3"))

_SOURCE = r"""
    // One warp per output row j (for SwiGLU two weight rows: the gate's j and the up's
    // j + N), NWARPS rows per block; the warp reads each weight row once for all B rows.
    // B is read at run time (registers sized for MAXB), so each projection compiles once
    // for a lone row (MAXB 1) and once for the rest.
    const int B = x_shape[0];
    constexpr int V = 16 / sizeof(T);  // elements per 16-byte load
    constexpr int R = SWIGLU ? 2 : 1;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int j = blockIdx.x * NWARPS + warp;
    __shared__ float inv_rms[MAXB];
    if (NORM) {
        for (int b = warp; b < B; b += NWARPS) {
            float ss = 0.f;
            for (int k = lane; k < K; k += 32) {
                const float t = static_cast<float>(x[(size_t)b * K + k]);
                ss += t * t;
            }
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
            if (lane == 0) inv_rms[b] = rsqrtf(ss / K + eps[0]);
        }
        __syncthreads();
    }
    if (j >= N) return;
    float acc[R][MAXB];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int b = 0; b < MAXB; ++b) acc[r][b] = 0.f;
    }
    #pragma unroll 2
    for (int k0 = lane * V; k0 < K; k0 += 32 * V) {
        float xs[MAXB][V];
        #pragma unroll
        for (int b = 0; b < MAXB; ++b) {
            if (b >= B) break;
            const uint4 raw = *reinterpret_cast<const uint4*>(x + (size_t)b * K + k0);
            const T* e = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int i = 0; i < V; ++i) xs[b][i] = static_cast<float>(e[i]);
        }
        if (NORM) {  // rounded as MLX's rms_norm returns it
            const uint4 raw = *reinterpret_cast<const uint4*>(g + k0);
            const T* gw = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int b = 0; b < MAXB; ++b) {
                if (b >= B) break;
                #pragma unroll
                for (int i = 0; i < V; ++i) {
                    const T y = static_cast<T>(xs[b][i] * inv_rms[b]);
                    xs[b][i] = static_cast<float>(static_cast<T>(
                        static_cast<float>(gw[i]) * static_cast<float>(y)));
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const uint4 raw = *reinterpret_cast<const uint4*>(w + (size_t)(j + r * N) * K + k0);
            const T* wr = reinterpret_cast<const T*>(&raw);
            #pragma unroll
            for (int i = 0; i < V; ++i) {
                const float wv = static_cast<float>(wr[i]);
                #pragma unroll
                for (int b = 0; b < MAXB; ++b) {
                    if (b < B) acc[r][b] += wv * xs[b][i];
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int b = 0; b < MAXB; ++b) {
            if (b >= B) break;
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[r][b] += __shfl_xor_sync(0xffffffff, acc[r][b], o);
        }
    }
    if (lane >= B) return;
    #pragma unroll
    for (int b = 0; b < MAXB; ++b) {
        if (b != lane) continue;  // lane b writes row b (registers stay statically indexed)
        float y = acc[0][b];
        if (BIAS) y += static_cast<float>(bias[j]);
        T out_v;
        if (SWIGLU) {
            const T gate = static_cast<T>(y);
            const T up = static_cast<T>(acc[1][b]);
            const float gf = static_cast<float>(gate);
            const T sig = static_cast<T>(1.f / (1.f + __expf(-gf)));
            const T act = static_cast<T>(gf * static_cast<float>(sig));
            out_v = static_cast<T>(static_cast<float>(act) * static_cast<float>(up));
        } else {
            out_v = static_cast<T>(y);
        }
        if (RES) {
            out_v = static_cast<T>(
                static_cast<float>(res[(size_t)b * N + j]) + static_cast<float>(out_v));
        }
        out[(size_t)b * N + j] = out_v;
    }
"""

_INPUTS = ("x", "w", "g", "eps", "bias", "res")


@dataclass
class Gemv:
    """One projection of a fused layer and what runs around it."""

    weight: mx.array  # [R * N, K] (packed for `quant`)
    bias: mx.array | None = None
    norm: nn.RMSNorm | None = None  # applied to the input first
    swiglu: bool = False  # rows [0, N) are the gate's, [N, 2N) the up's
    # The most rows it runs as the kernel; more (or 0: never), MLX's ops compute it.
    kernel_rows: int = 0
    # A quantised projection (`weight` is its packed weight): `quant_matvec.fused` is the
    # kernel, for the rows the layer's own product takes the matrix-vector form.
    quant: nn.QuantizedLinear | None = None

    def __post_init__(self) -> None:
        # The norm's epsilon as the kernel reads it, made once (not a new array per step).
        self.eps = mx.array([self.norm.eps if self.norm is not None else 0.0], dtype=mx.float32)

    @property
    def in_features(self) -> int:
        q = self.quant
        return q["scales"].shape[1] * q.group_size if q is not None else self.weight.shape[1]

    @property
    def width(self) -> int:
        """Output features (SwiGLU halves the weight's rows)."""
        rows = self.weight.shape[0]
        return rows // 2 if self.swiglu else rows


PROJECTIONS = ("qkv", "o", "gate_up", "down")
# Decode of 1-8 rows on the H200, Llama-3.2-1B, tok/s, median of 3 in turns
# (`bash bench/gpu/gpu_probe.sh rows`), none as the kernel / only down / gate/up
# and down / all four: 1 row 508 / 608 / 585 / 510; 2 rows 722 / 950 / 799 / 702; 4 rows
# 1,145 / 1,333 / 1,257 / 1,059; 8 rows 2,390 / 2,811 / 1,771 / 1,468. The gate/up kernel's
# time grows about 10 µs a row (each warp reads every row of x; bench/gpu/kernel_time.py), so
# from 2 rows on Llama loses with it. At one row it pays: only down / this default / gate/up
# and down, 1 row, Llama 472 / 521 / 521, Qwen3-0.6B 281 / 352 / 349 (same probe; at 2 rows
# Qwen3 gave 421 / 429 / 554, so its narrower layers would take gate/up for 2 rows too).
# Why the q/k/v and output kernels lose end to end is not known: timed alone, even as
# chained launches, they beat MLX's ops.
DEFAULT_KERNELS = {"gate_up": 1, "down": MAX_ROWS}
# Quantised layers: none by default (measured slower, above); `all` fuses every projection,
# so that a layer is five launches.
QUANT_KERNELS: dict[str, int] = {}


def projections(flag: str, quantised: bool = False) -> dict[str, int]:
    """The projections that run as the kernel, each with the most rows it does so for, by
    `flag` (`KernelConfig.fused_layer`, from `PIPPIN_FUSED_LAYER`): `DEFAULT_KERNELS` (1;
    `QUANT_KERNELS` for `quantised` layers), none (0), `all`, or names (such as `qkv/o`,
    or `gate_up:1/down` to cap one's rows), the others then computed by MLX's ops."""
    if flag == "0":
        return {}
    if flag in ("", "1"):
        return dict(QUANT_KERNELS if quantised else DEFAULT_KERNELS)
    if flag == "all":
        return dict.fromkeys(PROJECTIONS, QUANT_MAX_ROWS)
    chosen: dict[str, int] = {}
    for item in (n for n in re.split(r"[,/ ]", flag) if n):
        name, _, rows = item.partition(":")
        if name not in PROJECTIONS:
            raise ValueError(
                f"PIPPIN_FUSED_LAYER: unknown projection {name!r}; expected 0, 1, all or some "
                f"of {'/'.join(PROJECTIONS)}, each optionally with :ROWS"
            )
        if rows and not (rows.isdigit() and 1 <= int(rows) <= QUANT_MAX_ROWS):
            raise ValueError(
                f"PIPPIN_FUSED_LAYER: {item!r}: rows must be 1 to {QUANT_MAX_ROWS} (plain "
                f"weights: at most {MAX_ROWS} run as the kernel), as in {name}:1"
            )
        chosen[name] = int(rows) if rows else QUANT_MAX_ROWS
    return chosen


def _linear(m: Any) -> bool:
    return type(m) is nn.Linear and m.weight.dtype in (mx.bfloat16, mx.float16, mx.float32)


def _quantised(m: Any) -> bool:
    """A quantised projection `quant_matvec.fused` computes (any of `dense_quant`'s
    classes: the kernels' hook may be installed before or after this one)."""
    return dense_quant.applies(m) and dense_quant.kernel_dtype(m) is not None


@dataclass
class Plan:
    """A layer's four projections, in the order they run."""

    qkv: Gemv
    o: Gemv
    gate_up: Gemv
    down: Gemv
    dtype: mx.Dtype  # of the activations it computes

    @property
    def quantised(self) -> bool:
        return self.qkv.quant is not None

    def steps(self) -> list[tuple[Gemv, bool]]:
        """Each projection, with whether it adds the residual."""
        return [(self.qkv, False), (self.o, True), (self.gate_up, False), (self.down, True)]


def plan(layer: Any, base: type, flag: str) -> Plan | None:
    """The four projections of `layer` (of mlx-lm's class `base`), or None if it is not
    the layer this module fuses; `flag`: `projections`'."""
    attn, mlp = layer.self_attn, layer.mlp
    if getattr(attn, "_pippin_fused", None) is None:
        return None
    if type(mlp) is not getattr(importlib.import_module(base.__module__), "MLP", None):
        return None  # exactly the family's SwiGLU MLP
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(type(n) is nn.RMSNorm for n in norms):
        return None
    qkv = attn.q_proj.shared.fused
    gu = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj")]
    if not all(isinstance(p, fused_proj.Part) for p in gu) or gu[0].shared is not gu[1].shared:
        return None
    if [p.i for p in gu] != [0, 1]:
        return None
    gate_up = gu[0].shared.fused
    o, down = attn.o_proj, mlp.down_proj
    projs = (qkv, o, gate_up, down)
    quantised = all(_quantised(m) for m in projs)
    if not quantised and not all(_linear(m) for m in projs):
        return None
    if "bias" in gate_up or "bias" in down:
        return None
    (a0, a1), (b0, b1) = gu[0].shared.bounds
    if a0 != 0 or a1 != b0 or b1 - b0 != a1:
        return None
    chosen = projections(flag, quantised)
    if quantised and not chosen:
        return None  # mlx-lm's layer, its products pippin's kernels all the same
    dtype = qkv["scales"].dtype if quantised else qkv.weight.dtype
    quant = dict.fromkeys(PROJECTIONS) if not quantised else dict(zip(PROJECTIONS, projs))
    plan = Plan(
        Gemv(qkv.weight, qkv.get("bias"), norm=norms[0], quant=quant["qkv"]),
        Gemv(o.weight, o.get("bias"), quant=quant["o"]),
        Gemv(gate_up.weight, norm=norms[1], swiglu=True, quant=quant["gate_up"]),
        Gemv(down.weight, quant=quant["down"]),
        dtype,
    )
    vec = 16 // dtype.size  # the kernel reads 16 bytes at a time
    for name, (p, _) in zip(PROJECTIONS, plan.steps()):
        p.kernel_rows = min(chosen.get(name, 0), QUANT_MAX_ROWS if quantised else MAX_ROWS)
        k = p.in_features
        arrays = [*(a for a in (p.bias,) if a is not None)]
        arrays.append(p.quant["scales"] if p.quant else p.weight)
        if p.norm is not None:
            if p.norm.weight.shape != (k,):
                return None
            arrays.append(p.norm.weight)
        if any(a.dtype != dtype for a in arrays) or k % vec:
            return None
    return plan


def warm(model: nn.Module) -> None:
    """Build the kernels of `model`'s fused layers now, for one row and for several: each
    NVRTC build takes a fraction of a second, which a first request (and the first batch of
    two) would otherwise wait for. MLX builds each template once; the other layers' calls
    only run it."""
    for _, m in model.named_modules():
        plan: Plan | None = getattr(m, "_pippin_plan", None)
        for p, res in plan.steps() if plan is not None else []:
            # A quantised projection's templates: 1-8 rows, 9-16.
            for rows in (r for r in ((1, 9) if p.quant else (1, 2)) if _takes(p, r)):
                x = mx.zeros((rows, p.in_features), dtype=plan.dtype)
                mx.eval(gemv(p, x, mx.zeros((rows, p.width), dtype=x.dtype) if res else None))


def max_rows(model: nn.Module) -> int:
    """The most rows of a decode batch `model`'s fused layers take (0: none fused): up
    to `QUANT_MAX_ROWS` where the layers are quantised, `MAX_ROWS` where not; a larger
    batch keeps mlx-lm's layer."""
    for _, m in model.named_modules():
        plan: Plan | None = getattr(m, "_pippin_plan", None)
        if plan is not None:
            return QUANT_MAX_ROWS if plan.quantised else MAX_ROWS
    return 0


def call(self: Any, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
    plan: Plan = self._pippin_plan
    lay = getattr(cache, "layout", None)
    if not getattr(lay, "fused_layer", False) or x.dtype != plan.dtype:
        return super(type(self), self).__call__(x, mask, cache)
    B = x.shape[0]
    x2 = x.reshape(B, -1)
    qkv = _project(plan.qkv, x2)
    a = fused_attention.attend(self.self_attn, qkv.reshape(B, 1, -1), cache.pool.parts, lay)
    h = _project(plan.o, a.reshape(B, -1), res=x2)
    m = _project(plan.gate_up, h)
    return _project(plan.down, m, res=h).reshape(B, 1, -1)


def _project(p: Gemv, x: mx.array, res: mx.array | None = None) -> mx.array:
    if _takes(p, x.shape[0]):
        return as_kernel(p, x, res)
    return reference_gemv(p, x, res)


def _takes(p: Gemv, rows: int) -> bool:
    """Whether `rows` rows of projection `p` run as the kernel."""
    return rows <= p.kernel_rows and (p.quant is None or rows <= _quant_rows(p))


def _quant_rows(p: Gemv) -> int:
    """The most rows the fused kernel takes for a quantised layer: the matrix-vector
    form's, where the layer's own decode product takes that form (`dense_quant`; 0 without
    pippin's kernels, or with `PIPPIN_QUANT_KERNEL=mma`)."""
    return quant_matvec.MAX_ROWS if getattr(p.quant, dense_quant.MATVEC_ATTR, 0) else 0


def as_kernel(p: Gemv, x: mx.array, res: mx.array | None = None) -> mx.array:
    """A projection that runs as the kernel: `gemv`, or where tests force the references
    (off CUDA), `reference_gemv` in its place."""
    if paged_attention.force_reference:
        return reference_gemv(p, x, res)
    return gemv(p, x, res)


def gemv(p: Gemv, x: mx.array, res: mx.array | None = None) -> mx.array:
    """The kernel: [B, N] = (norm(x) if p.norm) @ p.weight.T (+ bias) (SwiGLU'd) (+ res)."""
    B, K = x.shape
    n = p.width
    norm = p.norm
    if p.quant is not None:
        w = norm.weight if norm is not None else None
        return quant_matvec.fused(x, p.quant, p.eps, w, p.swiglu, res)
    dummy = p.weight  # stands in for absent inputs (never read)
    out = device.cuda_kernel("pippin_fused_gemv", _INPUTS, _SOURCE)(
        inputs=[
            x,
            p.weight,
            norm.weight if norm is not None else dummy,
            p.eps,
            p.bias if p.bias is not None else dummy,
            res if res is not None else dummy,
        ],
        template=[
            ("T", x.dtype),
            ("MAXB", 1 if B == 1 else MAX_ROWS),
            ("K", K),
            ("N", n),
            ("NWARPS", _NWARPS),
            ("NORM", norm is not None),
            ("SWIGLU", p.swiglu),
            ("BIAS", p.bias is not None),
            ("RES", res is not None),
        ],
        grid=(-(-n // _NWARPS) * _NWARPS * 32, 1, 1),
        threadgroup=(_NWARPS * 32, 1, 1),
        output_shapes=[(B, n)],
        output_dtypes=[x.dtype],
    )
    return out[0]


def reference_gemv(p: Gemv, x: mx.array, res: mx.array | None = None) -> mx.array:
    """The same with MLX's ops, as mlx-lm's layer computes it: what the kernel must equal;
    the stand-in off CUDA."""
    if p.norm is not None:
        x = p.norm(x)
    if p.quant is not None:
        y = p.quant(x)  # with its bias
    elif p.bias is None:
        y = x @ p.weight.T
    else:
        y = mx.addmm(p.bias, x, p.weight.T)
    if p.swiglu:
        gate, up = mx.split(y, 2, axis=-1)
        y = nn.silu(gate) * up
    return y if res is None else res + y
