"""Prefix cache tiers: TTFT of a long shared prefix cold, from memory, and from the SSD
tier after a restart, over HTTP.

For each repetition a fresh prefix of exactly ``--prefix-tokens`` tokens (random token
ids, so the count does not depend on the tokenizer) is sent three times, each time with
another short suffix after it, as a streaming completions request:

- **cold**: the first request; nothing is cached.
- **memory hit**: the same prefix again on the same server.
- **SSD hit**: after the server was stopped (it writes its cached blocks to
  ``--ssd-cache-dir`` at shutdown) and started again, so nothing is in memory.

TTFT is the time from sending the request to the first streamed chunk with text. The
last chunk's usage says how many prompt tokens were cached. Run by hand, never as a test:

    .venv/bin/python bench/cache_bench.py --model random:tiny-qwen3 --out .tmp/cache_bench.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pippin.bench.servers import Server, pippin_server

# Token ids every model's vocabulary has (clear of the special ids at the start).
ID_RANGE = (300, 5000)


def make_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*ID_RANGE) for _ in range(n)]


def ttft(server: Server, model: str, prompt: str | list[int]) -> tuple[float, int, int]:
    """(seconds to the first text chunk, prompt tokens, cached tokens)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 4,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first: float | None = None
    usage: dict[str, Any] = {}
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as client:
        with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("choices"):
                    first = time.perf_counter() - t0
                if chunk.get("usage"):
                    usage = chunk["usage"]
    assert first is not None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return first, usage["prompt_tokens"], cached


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        default=None,
        help="model to serve, or random:NAME (pippin.bench.models; default: pippin's default)",
    )
    p.add_argument("--prefix-tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--ssd-cache-dir", default=None, help="default: a fresh temporary folder")
    p.add_argument("--server-args", default="", help="more `pippin serve` flags")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()

    ssd = args.ssd_cache_dir or tempfile.mkdtemp(prefix="pippin-ssd-bench-")
    serve_args = ["--ssd-cache-dir", ssd, "--max-model-len", str(args.prefix_tokens + 512)]
    serve_args += args.server_args.split()
    prefixes = [make_ids(1000 + r, args.prefix_tokens) for r in range(args.reps)]
    rows: dict[str, list[tuple[float, int, int]]] = {"cold": [], "memory": [], "ssd": []}

    with pippin_server(*serve_args, model=args.model or "") as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        ttft(server, model, "warm up the process")  # first-call costs are not the cache's
        for r, prefix in enumerate(prefixes):
            rows["cold"].append(ttft(server, model, prefix + make_ids(r * 10 + 1, 8)))
            rows["memory"].append(ttft(server, model, prefix + make_ids(r * 10 + 2, 8)))
        mem_stats = httpx.get(f"{server.url}/v1/cache/stats").json()
    t0 = time.perf_counter()
    with pippin_server(*serve_args, model=args.model or "") as server:
        restart_s = time.perf_counter() - t0
        ttft(server, model, "warm up the process")
        for r, prefix in enumerate(prefixes):
            rows["ssd"].append(ttft(server, model, prefix + make_ids(r * 10 + 3, 8)))
        ssd_stats = httpx.get(f"{server.url}/v1/cache/stats").json()

    med = {k: statistics.median(x[0] for x in v) for k, v in rows.items()}
    print(f"prefix {args.prefix_tokens} tokens, {args.reps} reps, model {model}")
    print("| case | TTFT median | × cold | prompt tokens | cached tokens |")
    print("|---|---|---|---|---|")
    for k, label in (("cold", "cold"), ("memory", "memory hit"), ("ssd", "SSD hit after restart")):
        _, prompt_tokens, cached = rows[k][0]
        print(
            f"| {label} | {med[k] * 1000:,.0f} ms | {med[k] / med['cold']:.3f} | "
            f"{prompt_tokens} | {cached} |"
        )
    print(f"server restart to healthy: {restart_s:.1f}s")
    print(f"SSD tier after the SSD run: {json.dumps(ssd_stats['ssd'])}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {"rows": rows, "median": med, "memory_stats": mem_stats, "ssd_stats": ssd_stats},
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
