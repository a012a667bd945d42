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
import time
from pathlib import Path

import checkout  # noqa: F401  (src/ on the path, MLX settings)
import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import dense_quant, quant_matmul, quant_tiles

CHAIN = 32  # products evaluated at once, so that host time per evaluation is spread


def timed(fn, reps: int) -> float:  # type: ignore[no-untyped-def]
    """Median milliseconds of one `fn()`, timed as `CHAIN` of them evaluated together,
    after warm-up."""
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(CHAIN)])
        mx.synchronize()
        times.append(1e3 * (time.perf_counter() - t0) / CHAIN)
    return statistics.median(times)


def tilings(m: int, k: int, bits: int) -> list[quant_matmul.Tiles]:
    """Every tiling the kernel builds for `m` rows (row tiles up to the rows' need), with
    one iteration of weights in flight (`deeper` tries more on the fastest)."""
    out = []
    for mt in (1, 2, 4):
        if mt > 1 and 16 * mt // 2 >= m:
            continue  # half its rows or more would be padding
        for nt in (2, 4):  # one column tile a warp: never the fastest when tried
            for wn in (1, 2, 4, 8):
                for wk in (1, 2, 4, 8):
                    if quant_matmul.fits((mt, nt, wn, wk, 1), k, bits):
                        out.append((mt, nt, wn, wk, 1))
    return out


def deeper(best: list[quant_matmul.Tiles], k: int, bits: int) -> list[quant_matmul.Tiles]:
    """The same tilings with 2 and 4 iterations of weights in flight."""
    return [
        (*t[:4], d)
        for t in best
        for d in (2, 4)
        if quant_matmul.fits((*t[:4], d), k, bits)  # type: ignore[arg-type]
    ]


def sweep(args: argparse.Namespace) -> int:
    """Every tiling the kernel's registers and shared memory allow, per shape (`--shapes`,
    else `--n` x `--k`) and row count; with `--table`, the fastest of each written into
    that table (`kernels/quant_tiles`)."""
    mx.random.seed(0)
    shapes = (
        [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
        if args.shapes
        else [(args.n, args.k)]
    )
    res: dict = {"device": quant_tiles.device_name(), "shapes": {}}
    best_of: dict[str, dict[str, list[int]]] = {}
    for n, k in shapes:
        w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
        for bits in [int(b) for b in args.bits.split(",")]:
            wq, s, b = mx.quantize(w, group_size=64, bits=bits)
            key = f"{bits}:{n}x{k}"
            res["shapes"][key] = {}
            for m in [int(r) for r in args.rows.split(",")]:
                x = mx.random.normal((m, k)).astype(mx.bfloat16)
                mx.eval(wq, s, b, x)

                def time_of(tiles: quant_matmul.Tiles) -> float:
                    return timed(
                        lambda: quant_matmul.qmm(x, wq, s, b, 64, bits, tiles),  # noqa: B023
                        args.reps,
                    )

                times = {t: time_of(t) for t in tilings(m, k, bits)}
                for t in deeper(sorted(times, key=times.get)[:4], k, bits):
                    times[t] = time_of(t)
                chosen = quant_matmul.plan(m, n, k, bits)
                best = sorted(times, key=times.get)[:3]
                print(
                    f"SWEEP {key} rows={m}: plan {chosen} "
                    f"{times.get(chosen, float('nan')):.4f} ms; best "
                    + ", ".join(f"{t} {times[t]:.4f}" for t in best),
                    flush=True,
                )
                res["shapes"][key][m] = {
                    "plan": chosen,
                    "ms": {str(t): v for t, v in times.items()},
                }
                best_of.setdefault(key, {})[str(m)] = list(best[0])
        del w
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    if args.table:
        doc = json.loads(args.table.read_text()) if args.table.exists() else {}
        doc.setdefault("devices", [res["device"]])
        for key, by_rows in best_of.items():
            doc.setdefault("shapes", {}).setdefault(key, {}).update(by_rows)
        args.table.write_text(json.dumps(doc, indent=1, sort_keys=True))
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
        help="instead: time the kernel at every tiling (MT, NT, WN, WK, DEPTH) for each row count "
        "and print the fastest three beside `plan`'s choice (to tune `quant_matmul.plan`)",
    )
    ap.add_argument("--shapes", help="with --sweep: NxK,... instead of --n and --k")
    ap.add_argument(
        "--table",
        type=Path,
        help="with --sweep: merge each row count's fastest tiling into this table "
        "(`PIPPIN_QUANT_TILES`, `src/pippin/kernels/tuned/`)",
    )
    args = ap.parse_args()
    if args.sweep:
        return sweep(args)
    mx.random.seed(0)
    dense_layer = nn.Linear(args.k, args.n, bias=False)
    dense_layer.set_dtype(mx.bfloat16)
    mx.eval(dense_layer.parameters())
    rows = [int(r) for r in args.rows.split(",")]
    res: dict = {"k": args.k, "n": args.n, "device": str(mx.default_device()), "bits": {}}
    print(f"{args.k}x{args.n}, ms per product (median of {args.reps})")
    print(
        f"{'bits':>4} {'rows':>6} {'quantized':>10} {'kernel':>8} {'GB/s':>6} "
        f"{'dequant+mm':>11} {'bf16':>8}"
    )
    for bits in [int(b) for b in args.bits.split(",")]:
        q = nn.QuantizedLinear.from_linear(dense_layer, group_size=64, bits=bits)
        mx.eval(q.parameters())
        table = {}
        for m in rows:
            x = mx.random.normal((m, args.k)).astype(mx.bfloat16)
            mx.eval(x)
            t = {
                "quantized": timed(lambda: q(x), args.reps),  # noqa: B023
                "kernel": timed(lambda: quant_matmul.layer_qmm(q, x), args.reps),  # noqa: B023
                "dense": timed(lambda: dense_quant.dense(q, x), args.reps),  # noqa: B023
                "bf16": timed(lambda: dense_layer(x), args.reps),  # noqa: B023
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
