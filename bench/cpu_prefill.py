"""Long prompts on the CPU: time to the first token of one request, its prefill's FLOP
rate against a plain float32 matmul measured in the same run, the prefix cache's RAM hit,
and llama.cpp (llama-cpp-python, if installed) on the same GGUF file as the anchor.

Each configuration runs in a process of its own (the kernel switches are read at load),
with OpenBLAS preloaded as `pippin serve` does it (`pippin.blas`): `pippin` is the default
path; `mlx-ops` the same with `PIPPIN_CPU_PREFILL=0` (MLX's own attention and SwiGLU on
the CPU); `before` that and OpenBLAS's own choice of kernels (no `OPENBLAS_CORETYPE`),
which was pippin before 2026-12-06.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python bench/cpu_prefill.py --lengths 500 1000 2000 4000
    # the Qwen2.5-Coder-0.5B GGUF of the tests, and llama.cpp beside it:
    .venv/bin/python bench/cpu_prefill.py --llama-python /tmp/llamavenv/bin/python \\
        --model ~/.cache/pippin/test-data/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

(The CLI re-execs itself with OpenBLAS preloaded; a script must be started that way.)
Prompts are token ids cycling through the vocabulary, so every length is exact.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time


def prompt_ids(n: int, vocab: int) -> list[int]:
    return [(i * 7919) % (vocab - 200) + 100 for i in range(n)]


def matmul_gflops(rows: int, inner: int, cols: int) -> float:
    """The float32 FLOP rate of one plain MLX matmul of this shape (BLAS on the CPU)."""
    import mlx.core as mx

    a = mx.random.normal((rows, inner))
    b = mx.random.normal((inner, cols))
    mx.eval(a, b)
    for _ in range(3):
        mx.eval(a @ b)
    best = float("inf")
    for _ in range(7):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    return 2 * rows * inner * cols / best / 1e9


def model_flops(model: object, n: int) -> float:
    """FLOPs of one n-token prompt's forward: the layers' linear maps (2 per weight per
    token) and causal attention (4 * heads * head_dim * n^2 / 2 per layer); the LM head
    runs on the last token only (pippin's head rows)."""
    import mlx.nn as nn

    linear = 0
    modules = [m for layer in model.layers for _, m in layer.named_modules()]  # type: ignore[attr-defined]
    for m in modules:
        if isinstance(m, nn.QuantizedLinear):
            linear += m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits
        elif isinstance(m, nn.Linear):
            linear += m.weight.size
    args = model.args  # type: ignore[attr-defined]
    heads = args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    layers = len(model.layers)  # type: ignore[attr-defined]
    return 2 * linear * n + layers * 4 * heads * head_dim * n * n / 2


def run_pippin(model: str | None, lengths: list[int], chunk: int) -> dict:
    from pippin.bench.inproc import drive
    from pippin.engine.config import EngineConfig
    from pippin.engine.core import EngineCore
    from pippin.engine.types import SamplingParams
    from pippin.store import loader

    loaded = loader.load_model(model)
    # Past the model's own context (SmolLM2's is 8k) for the time only: RoPE runs on.
    config = EngineConfig(max_num_batched_tokens=chunk, max_model_len=max(lengths) + 64)
    core = EngineCore(loaded, config)
    vocab = loaded.model.args.vocab_size  # type: ignore[attr-defined]
    hidden = loaded.model.args.hidden_size  # type: ignore[attr-defined]
    inter = getattr(loaded.model.args, "intermediate_size", 4 * hidden)  # type: ignore[attr-defined]
    warm = SamplingParams(max_tokens=2, temperature=0.0)
    drive(core, [("warm", prompt_ids(64, vocab)[::-1], warm)])

    def rate() -> float:
        return max(matmul_gflops(chunk, hidden, 2 * inter), matmul_gflops(2048, 2048, 2048))

    out: dict = {"matmul_gflops": rate(), "rows": []}
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for n in lengths:
        ids = prompt_ids(n, vocab)
        cold = drive(core, [(f"c{n}", ids, one)])
        # The same prompt again: its blocks are cached (a RAM hit); then 32 tokens decoded
        # over that context.
        more = SamplingParams(max_tokens=33, temperature=0.0, ignore_eos=True)
        hit = drive(core, [(f"h{n}", ids, more)])
        flops = model_flops(loaded.model, n)
        out["rows"].append(
            {
                "tokens": n,
                "ttft_s": cold.first_token_s,
                "gflops": flops / cold.first_token_s / 1e9,
                "hit_s": hit.first_token_s,
                "decode_tok_s": 32 / hit.decode_s,
                "first": cold.tokens[f"c{n}"],
            }
        )
        print(json.dumps(out["rows"][-1]), file=sys.stderr, flush=True)
    out["matmul_gflops_after"] = rate()
    return out


def run_llama(gguf: str, lengths: list[int], threads: int, batch: int) -> dict:
    from llama_cpp import Llama  # type: ignore[import-not-found]

    llm = Llama(
        model_path=gguf,
        n_ctx=max(lengths) + 16,
        n_batch=batch,
        n_ubatch=batch,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    vocab = llm.n_vocab()
    llm.eval(prompt_ids(64, vocab)[::-1])
    rows = []
    for n in lengths:
        llm.reset()
        llm._ctx.kv_cache_clear()  # noqa: SLF001 - no prefix reuse: a cold prompt
        t = time.perf_counter()
        llm.eval(prompt_ids(n, vocab))
        rows.append({"tokens": n, "ttft_s": time.perf_counter() - t})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"rows": rows}


def child(kind: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--lengths", *map(str, args.lengths)]
    cmd += ["--chunk", str(args.chunk), "--threads", str(args.threads)]
    if args.model:
        cmd += ["--model", args.model]
    if kind == "llama":
        cmd[0] = args.llama_python
        cmd += ["--gguf", gguf_of(args.model)]
    res = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def gguf_of(model: str | None) -> str:
    if model:
        return model
    from pippin.store.loader import default_model_path

    return str(default_model_path())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="a GGUF file or model folder (default: the default model)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[500, 1000, 2000, 4000])
    ap.add_argument("--chunk", type=int, default=2048, help="tokens per prefill step")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--configs", nargs="+", default=["pippin", "mlx-ops", "before"])
    ap.add_argument("--llama-python", help="a Python with llama-cpp-python: adds llama.cpp")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        res = (
            run_llama(args.gguf, args.lengths, args.threads, args.chunk)
            if args.child == "llama"
            else run_pippin(args.model, args.lengths, args.chunk)
        )
        print(json.dumps(res))
        return
    from pippin import blas

    env = dict(os.environ)
    lib = blas.find_openblas()
    core = None
    if lib is not None:
        env["LD_PRELOAD"] = lib
        core = env.get("OPENBLAS_CORETYPE") or blas.core_override(lib)
    results: dict[str, dict] = {}
    configs = list(args.configs) + (["llama"] if args.llama_python else [])
    for kind in configs:
        e = dict(env, PIPPIN_CPU_PREFILL="0" if kind in ("mlx-ops", "before") else "auto")
        e.pop("OPENBLAS_CORETYPE", None)
        if core is not None and kind != "before":
            e["OPENBLAS_CORETYPE"] = core
        results[kind] = child(kind, args, e)
    print(f"OpenBLAS {lib}: kernels {core or 'its own choice'} (before: its own choice)")
    report(args, results)


def report(args: argparse.Namespace, results: dict[str, dict]) -> None:
    import mlx.core as mx

    print(
        f"model {args.model or 'default (SmolLM2-135M-Instruct Q4_1, unpacked to float32)'}; "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"mlx {mx.__version__}; chunk {args.chunk}; {time.strftime('%Y-%m-%d')}"
    )
    pip = results.get("pippin")
    if pip:
        mm = (pip["matmul_gflops"] + pip["matmul_gflops_after"]) / 2
        print(
            f"plain float32 matmul: {mm:.0f} GFLOP/s (the faster of [chunk x hidden] @ "
            "[hidden x 2 intermediate] and 2048^3, mean of before and after the prompts)"
        )
    head = (
        "| prompt tokens | "
        + " | ".join(f"{k} TTFT" for k in results)
        + " | pippin tok/s | pippin GFLOP/s (% of matmul) | RAM hit | decode tok/s after it"
        " | vs before | vs llama.cpp |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for i, n in enumerate(args.lengths):
        cells = [f"{results[k]['rows'][i]['ttft_s']:.2f} s" for k in results]
        extra = ["", "", "", "", "", ""]
        if pip:
            r = pip["rows"][i]
            extra[0] = f"{n / r['ttft_s']:.0f}"
            extra[1] = f"{r['gflops']:.0f} ({100 * r['gflops'] / mm:.0f}%)"
            extra[2] = f"{r['hit_s']:.3f} s"
            extra[3] = f"{r['decode_tok_s']:.1f}"
            base = "before" if "before" in results else "mlx-ops"
            if base in results:
                m = results[base]["rows"][i]
                extra[3] += f" ({base} {m['decode_tok_s']:.1f})"
                extra[4] = f"{m['ttft_s'] / r['ttft_s']:.1f}x faster"
            if "llama" in results:
                extra[5] = f"{r['ttft_s'] / results['llama']['rows'][i]['ttft_s']:.2f}x its time"
        print(f"| {n} | " + " | ".join(cells + extra) + " |")
    if pip and "mlx-ops" in results:
        same = all(
            a["first"] == b["first"] for a, b in zip(pip["rows"], results["mlx-ops"]["rows"])
        )
        print(f"first tokens equal to mlx-ops: {same}")


if __name__ == "__main__":
    main()
