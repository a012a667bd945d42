"""GPU benchmark in one command: pippin against mlx-lm on random-weight bf16 models.

Builds (once) random-weight bfloat16 models with the configurations of Llama-3.2-1B and
Qwen3-0.6B (`pippin.bench.models`), then, per model:

1. the machine's copy bandwidth and the single-stream decode bound it implies
   (weight bytes read per decode step against that bandwidth);
2. in-process decode: mlx-lm's `generate_step` (single stream) and `BatchGenerator`,
   pippin's `EngineCore` (single stream and batches), same prompts, prefill excluded;
3. over HTTP with `pippin bench --serve`: pippin and `mlx_lm.server` started on the same
   folder, streaming chat completions, 512-token prompts, 256 output tokens with
   `ignore_eos` (pippin; mlx_lm.server has no such field and may stop early, which the
   results count), concurrency 1, 16, 64, 256: aggregate output tokens/s, TTFT and
   inter-token latency percentiles, ratios to pippin.

Everything lands in `--out-dir` (results JSON, Markdown tables, server logs). On the
GPU machine (bench/gpu/README.md):

    python3 bench/gpu/gpu_bench.py --out-dir $OUT

`PIPPIN_PAGED_KERNEL=0` in the environment measures pippin without the paged-attention
kernel (the portable gather path).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from checkout import REPO_ROOT

from pippin.bench import models
from pippin.bench.models import CONFIGS, build_model  # noqa: F401  (the probes import them)


def random_model(config: dict[str, Any], bf16: bool = True) -> Any:
    """An mlx-lm model of `config` with seeded random weights (bf16, else float32)."""
    return models.random_model(config, "bfloat16" if bf16 else "float32")


def copy_bandwidth() -> float:
    """Bytes per second of a large elementwise pass (read + write)."""
    import mlx.core as mx

    x = mx.zeros((1 << 30,), dtype=mx.bfloat16)  # 2 GiB
    mx.eval(x)
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        y = x + 1
        mx.eval(y)
        dt = time.perf_counter() - t0
        best = max(best, 2 * x.nbytes / dt)
        del y
    return best


def in_process(path: Path, batches: list[int], prompt: int, gen: int) -> dict[str, Any]:
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    from pippin.bench.inproc import decode_rate, in_turns, mlx_lm_batch_rate, mlx_lm_decode

    model, _ = load(str(path))
    vocab = model.args.vocab_size
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    rng = random.Random(0)
    res: dict[str, Any] = {"weight_bytes": weight_bytes, "prompt": prompt, "gen": gen}

    p = [rng.randrange(vocab) for _ in range(prompt)]
    # The median of 3 runs each, in turns: one mlx-lm run alone varied 250-430 tok/s.
    mids = in_turns(
        {
            "mlx_lm": lambda g: mlx_lm_decode(model, p, g),
            "pippin": lambda g: decode_rate(model, [p], g),
        },
        gen,
        3,
    )
    res["mlx_lm_single"], res["pippin_single"] = mids["mlx_lm"], mids["pippin"]
    res["batches"] = {}
    for b in batches:
        prompts = [[rng.randrange(vocab) for _ in range(prompt)] for _ in range(b)]
        decode_rate(model, prompts, 4)
        ours = decode_rate(model, prompts, gen)
        ref = mlx_lm_batch_rate(model, prompts, gen)
        res["batches"][b] = {"mlx_lm": ref, "pippin": ours}
        print(f"  batch {b}: mlx-lm {ref:.0f} tok/s, pippin {ours:.0f} tok/s", flush=True)
    return res


def http(path: Path, name: str, args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """`pippin bench` starting each of `--servers` on the model folder, in one run."""
    serve = {
        "pippin": f"pippin:{path} {args.pippin_args}",
        "mlx_lm": f"mlx_lm:{path}",
        "vllm_mlx": f"vllm_mlx:{path}",
    }
    cmd = [sys.executable, "-m", "pippin.cli", "bench"]
    for server in args.servers.split(","):
        cmd += ["--serve", serve[server]]
    cmd += [
        "--prompt-tokens", str(args.prompt),
        "--output-tokens", str(args.gen),
        "--concurrency", *args.concurrency.split(","),
        "--repetitions", str(args.repetitions),
        "--requests-per-client", str(args.requests_per_client),
        "--warmup", "32",
        "--blas", "none",
        "--no-progress",
        "--json", str(out_dir / f"http-{name}.json"),
        "--md", str(out_dir / f"http-{name}.md"),
        "--log-dir", str(out_dir / f"logs-{name}"),
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "src"), env.get("PYTHONPATH", "")])
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False, timeout=args.http_timeout, env=env)
    f = out_dir / f"http-{name}.json"
    return json.loads(f.read_text()) if f.exists() else {"error": "no results"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", type=Path, default=Path(os.environ.get("OUT", ".tmp/gpu")))
    ap.add_argument("--model-root", type=Path, default=Path("/tmp/pippin-gpu-models"))
    ap.add_argument("--models", default="llama-3.2-1b,qwen3-0.6b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--servers", default="pippin,mlx_lm")
    ap.add_argument("--pippin-args", default="--max-model-len 4096")
    ap.add_argument("--batches", default="32,128,256", help="in-process batch sizes")
    ap.add_argument("--skip-in-process", action="store_true")
    # One request per client makes each window at concurrency 256 a single wave of prompts,
    # whose figure moves by a third between runs: more requests per client average waves.
    ap.add_argument("--requests-per-client", type=int, default=1)
    ap.add_argument("--repetitions", type=int, default=1)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--http-timeout", type=float, default=900)
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    import mlx.core as mx

    results: dict[str, Any] = {
        "device": str(mx.default_device()),
        "device_info": {k: str(v) for k, v in mx.device_info().items()},
        "env": {k: v for k, v in os.environ.items() if k.startswith("PIPPIN_")},
        "argv": sys.argv,
        "models": {},
    }
    bw = copy_bandwidth()
    results["copy_bandwidth_Bps"] = bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    for name in [m for m in args.models.split(",") if m]:
        t0 = time.perf_counter()
        path = build_model(name, args.model_root)
        print(f"[{name}] model at {path} ({time.perf_counter() - t0:.0f} s)", flush=True)
        r: dict[str, Any] = {}
        if not args.skip_in_process:
            batches = [int(b) for b in args.batches.split(",") if b]
            r["in_process"] = ip = in_process(path, batches, args.prompt, args.gen)
            gc.collect()  # the engines' KV pools go before the servers need the GPU
            mx.clear_cache()
            bound = bw / ip["weight_bytes"]
            ip["single_stream_bound"] = bound
            print(
                f"[{name}] weights {ip['weight_bytes'] / 1e9:.2f} GB: single-stream bound "
                f"{bound:.0f} tok/s; mlx-lm {ip['mlx_lm_single']:.0f}, pippin "
                f"{ip['pippin_single']:.0f} tok/s in-process",
                flush=True,
            )
        if not args.skip_http:
            r["http"] = http(path, name, args, args.out_dir)
        results["models"][name] = r
        (args.out_dir / "gpu_bench.json").write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
