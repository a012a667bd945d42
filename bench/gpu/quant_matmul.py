"""One projection of the 8B shape at a range of rows: MLX's quantised matmul against
pippin's tensor-core kernel (`pippin.kernels.quant_matmul`) against dequantise + dense
matmul (`pippin.kernels.dense_quant`) against the bf16 matmul.

Prints a table of milliseconds per product (and the kernel's weight bandwidth) and, for
each bit width, the fewest rows from which the dense path beats the kernel at every
measured size (`PIPPIN_DENSE_QUANT_ROWS`); writes the figures to `--out` as JSON. Usage
(bench/gpu/README.md):

    python3 bench/gpu/quant_matmul.py --out $OUT/quant_matmul.json [--n 4096 --k 4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

import checkout  # noqa: F401  (src/ on the path, MLX settings)
import launches
import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import dense_quant, device, quant_matmul, quant_matvec

CHAIN = 32  # products evaluated at once, so that host time per evaluation is spread


def _ints(text: str) -> tuple[int, ...]:
    """A comma-separated flag's integers (`--bits`, `--rows`, `--nt`, `--staged`)."""
    return tuple(int(v) for v in text.split(","))


def copies(nbytes: int) -> int:
    """Copies of a weight of `nbytes` to read in turn (`launches.copies`), no more than one
    evaluation takes."""
    return min(CHAIN, launches.copies(nbytes))


def timed(fns, reps: int, x: mx.array) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of one product `fn(x)` over `reps` evaluations of `CHAIN` of
    them (`fns`: one per copy of the weight, taken in turn), each product after the one
    before (`launches.timed`)."""
    chained = [lambda dep, f=f: f(launches.after(x, dep)) for f in fns]
    return statistics.median(launches.timed(chained, CHAIN) / 1e3 for _ in range(reps))


def _qmm(
    x: mx.array, q: tuple, bits: int, tiles: tuple[int, int, int] | None, staged: bool = False
) -> mx.array:
    return quant_matmul.qmm(x, *q, 64, bits, tiles, staged)


def quantised_copies(n: int, k: int, bits: int) -> list[tuple[mx.array, ...]]:
    """Random N x K weights, quantised (group size 64), in as many copies as `copies`
    takes to read them from memory."""
    ws = []
    for _ in range(copies(n * k * bits // 8)):
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        ws.append(mx.quantize(w, group_size=64, bits=bits))
        mx.eval(ws[-1])
    return ws


def fastest(times: dict) -> str:
    """The three fastest tilings of `times` (tiling: ms), for a sweep's line."""
    return ", ".join(f"{t} {times[t]:.4f}" for t in sorted(times, key=times.get)[:3])


def tilings(
    m: int, k: int, bits: int, nts: tuple[int, ...], staged: tuple[int, ...] = (0,)
) -> list[tuple[tuple[int, int, int], bool]]:
    """Every tiling ((MT, NT, WK), x staged in shared memory) the kernel builds for `m` rows
    (row tiles up to the rows' need), with column tiles `nts` per warp, staged or not."""
    return [
        ((mt, nt, wk), bool(xs))
        for mt in (1, 2, 4)
        if mt == 1 or 16 * mt // 2 < m  # else half its rows or more would be padding
        for nt in nts
        for wk in (1, 2, 4, 8)
        for xs in staged
        if quant_matmul.fits((mt, nt, wk), k, bits, bool(xs))
    ]


def _name(tiling: tuple[tuple[int, int, int], bool]) -> str:
    return f"{tiling[0]}{' xs' if tiling[1] else ''}"


def sweep(args: argparse.Namespace) -> int:
    """Every tiling the kernel's registers and shared memory allow, per shape (`--shapes`,
    else `--n` x `--k`) and row count, the weights read from memory (`copies`)."""
    mx.random.seed(0)
    shapes = (
        [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
        if args.shapes
        else [(args.n, args.k)]
    )
    res: dict = {"device": str(mx.default_device()), "shapes": {}}
    for n, k in shapes:
        for bits in _ints(args.bits):
            ws = quantised_copies(n, k, bits)
            key = f"{bits}:{n}x{k}"
            res["shapes"][key] = {}
            for m in _ints(args.rows):
                x = mx.random.normal((m, k)).astype(mx.bfloat16)
                mx.eval(x)
                times = {
                    _name(tiling): timed(
                        [partial(_qmm, q=q, bits=bits, tiles=tiling[0], staged=tiling[1])
                         for q in ws],
                        args.reps,
                        x,
                    )
                    for tiling in tilings(m, k, bits, _ints(args.nt), _ints(args.staged))
                }  # fmt: skip
                chosen = _name((quant_matmul.plan(m, n, k, bits), False))
                print(
                    f"SWEEP {key} rows={m}: plan {chosen} "
                    f"{times.get(chosen, float('nan')):.4f} ms; best {fastest(times)}",
                    flush=True,
                )
                res["shapes"][key][m] = {"plan": chosen, "ms": times}
            del ws
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    return 0


_READ = r"""
    // Every 16 bytes of w once (a grid-stride loop), xor-ed: the copy rate a product of
    // these weights could reach.
    const size_t n = w_shape[0] * (size_t)w_shape[1] / 4;
    const uint4* v = reinterpret_cast<const uint4*>(w);
    uint32_t a = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const uint4 q = v[i];
        a ^= q.x ^ q.y ^ q.z ^ q.w;
    }
    for (int o = 16; o > 0; o >>= 1) a ^= __shfl_xor_sync(0xffffffffu, a, o);
    if ((threadIdx.x & 31) == 0)
        out[(blockIdx.x * (size_t)blockDim.x + threadIdx.x) / 32] = a;
"""


def read_all(w: mx.array, dep: mx.array | None) -> mx.array:
    """`_READ` over `w`, 8 blocks of 512 threads a multiprocessor."""
    threads = 132 * 8 * 512
    (out,) = device.cuda_kernel("bench_read", ("w",), _READ)(
        inputs=[w if dep is None else mx.depends(w, dep)],
        template=[],
        grid=(threads, 1, 1),
        threadgroup=(512, 1, 1),
        output_shapes=[(threads // 32,)],
        output_dtypes=[mx.uint32],
    )
    return out


def matvec_tilings(k: int, bits: int) -> list[tuple[int, int, int]]:
    """(WK, U, CT): 4 steps in flight with one column tile only (registers)."""
    steps = k // (512 // bits)
    return [
        (wk, u, ct)
        for wk in (1, 2, 4, 8)
        for u in (1, 2, 4)
        for ct in (1, 2, 4)
        if wk <= steps and (u < 4 or ct == 1)
    ]


def matvec_sweep(args: argparse.Namespace) -> int:
    """Per shape and row count (at most `quant_matvec.MAX_ROWS`): MLX's product, the
    matmul form at its plan, the matvec form at every tiling (WK, U, CT), and a plain read of
    the packed weights, each read from memory and chained (`launches`)."""
    mx.random.seed(0)
    res: dict = {"device": str(mx.default_device()), "shapes": {}}
    for n, k in [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]:
        for bits in _ints(args.bits):
            ws = quantised_copies(n, k, bits)
            key = f"{bits}:{n}x{k}"
            nbytes = n * k * (bits / 8 + 4 / 64)
            read = statistics.median(
                launches.timed([partial(read_all, q[0]) for q in ws], CHAIN) / 1e3
                for _ in range(args.reps)
            )
            print(f"READ {key}: {read:.4f} ms ({n * k * bits / 8 / read / 1e6:.0f} GB/s)")
            res["shapes"][key] = {"read_ms": read}
            for m in _ints(args.rows):
                x = mx.random.normal((m, k)).astype(mx.bfloat16)
                mx.eval(x)
                mlx = timed(
                    [
                        lambda x, q=q, bits=bits: mx.quantized_matmul(
                            x, *q, transpose=True, group_size=64, bits=bits
                        )
                        for q in ws
                    ],
                    args.reps,
                    x,
                )
                mma = timed([partial(_qmm, q=q, bits=bits, tiles=None) for q in ws], args.reps, x)
                times = {
                    tiles: timed(
                        [partial(quant_matvec.qmv, w=q[0], scales=q[1], biases=q[2],
                                 group_size=64, bits=bits, tiles=tiles) for q in ws],
                        args.reps,
                        x,
                    )
                    for tiles in matvec_tilings(k, bits)
                }  # fmt: skip
                chosen = quant_matvec.plan(k, bits, m)
                print(
                    f"MATVEC {key} rows={m}: mlx {mlx:.4f} mma {mma:.4f} plan {chosen} "
                    f"{times[chosen]:.4f} ms ({nbytes / times[chosen] / 1e6:.0f} GB/s); best "
                    f"{fastest(times)}",
                    flush=True,
                )
                res["shapes"][key][m] = {
                    "mlx": mlx,
                    "mma": mma,
                    "plan": chosen,
                    "ms": {str(t): v for t, v in times.items()},
                }
            del ws
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4096, help="input width")
    ap.add_argument("--n", type=int, default=14336, help="output width")
    ap.add_argument("--rows", default="1,8,16,32,64,128,256,512,2048")
    ap.add_argument("--bits", default="4,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="instead: time the kernel at every tiling (MT, NT, WK) for each row count and "
        "print the fastest three beside `plan`'s choice (to tune `quant_matmul.plan`)",
    )
    ap.add_argument("--shapes", help="with --sweep: NxK,... instead of --n and --k")
    ap.add_argument("--nt", default="1,2,4", help="with --sweep: the column tiles per warp")
    ap.add_argument(
        "--staged", default="0", help="with --sweep: 0,1 also times x staged in shared memory"
    )
    ap.add_argument(
        "--matvec",
        action="store_true",
        help="instead: the matvec form (quant_matvec) at every tiling (WK, U, CT) beside MLX's "
        "product, the matmul form and a plain read of the weights, over --shapes",
    )
    args = ap.parse_args()
    if args.matvec:
        return matvec_sweep(args)
    if args.sweep:
        return sweep(args)
    mx.random.seed(0)
    dense_layer = nn.Linear(args.k, args.n, bias=False)
    dense_layer.set_dtype(mx.bfloat16)
    mx.eval(dense_layer.parameters())
    rows = _ints(args.rows)
    res: dict = {"k": args.k, "n": args.n, "device": str(mx.default_device()), "bits": {}}
    print(f"{args.k}x{args.n}, ms per product (median of {args.reps})")
    print(
        f"{'bits':>4} {'rows':>6} {'quantized':>10} {'kernel':>8} {'GB/s':>6} "
        f"{'dequant+mm':>11} {'bf16':>8}"
    )
    dense_layers = [dense_layer] + [
        nn.Linear(args.k, args.n, bias=False) for _ in range(copies(args.n * args.k * 2) - 1)
    ]
    for d in dense_layers[1:]:
        d.set_dtype(mx.bfloat16)
        mx.eval(d.parameters())
    for bits in _ints(args.bits):
        qs = [
            nn.QuantizedLinear.from_linear(dense_layers[i % len(dense_layers)], 64, bits)
            for i in range(copies(args.n * args.k * bits // 8))
        ]
        mx.eval([q.parameters() for q in qs])
        table = {}
        for m in rows:
            x = mx.random.normal((m, args.k)).astype(mx.bfloat16)
            mx.eval(x)
            t = {
                "quantized": timed(qs, args.reps, x),
                "kernel": timed([partial(quant_matmul.layer_qmm, q) for q in qs], args.reps, x),
                "dense": timed([partial(dense_quant.dense, q) for q in qs], args.reps, x),
                "bf16": timed(dense_layers, args.reps, x),
            }
            table[m] = t
            # Bytes of packed weights, scales and biases the product must read.
            gbs = (args.n * args.k * (bits / 8 + 4 / 64)) / (t["kernel"] * 1e6)
            print(
                f"{bits:>4} {m:>6} {t['quantized']:>10.3f} {t['kernel']:>8.3f} {gbs:>6.0f} "
                f"{t['dense']:>11.3f} {t['bf16']:>8.3f}",
                flush=True,
            )
        # The fewest rows from which dense wins at every larger measured size.
        cross = next(
            (m for i, m in enumerate(rows) if all(
                table[r]["dense"] < table[r]["kernel"] for r in rows[i:]
            )),
            None,
        )  # fmt: skip
        print(f"CROSSING bits={bits} rows={cross}", flush=True)
        res["bits"][bits] = {"rows": table, "crossing": cross}
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
