"""`pippin bench`: its flags, and the run from flags to table, JSON, CSV and plots."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from urllib.parse import urlsplit

from pippin.bench.workload import BUILTIN, Length, load_workload


def add_bench_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("servers")
    s.add_argument(
        "--url",
        action="append",
        metavar="[NAME=]URL",
        help="server to measure, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine); give it "
        "several times to compare servers in one run, interleaved, with ratios to the first "
        "(default: http://127.0.0.1:8000)",
    )
    s.add_argument(
        "--model",
        action="append",
        help="the 'model' field: once for all servers or once per --url (default: the first "
        "model each server lists)",
    )
    s.add_argument(
        "--api-key",
        default=os.environ.get("PIPPIN_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="sent as a Bearer token (default: $PIPPIN_API_KEY, else $OPENAI_API_KEY)",
    )
    w = p.add_argument_group("workload")
    w.add_argument(
        "--workload",
        default="short",
        metavar="NAME|FILE",
        help=f"built in ({', '.join(BUILTIN)}) or a JSON file (see docs/benchmarks.md) "
        "(default: %(default)s)",
    )
    w.add_argument("--api", choices=("chat", "completions"), help="override the workload's API")
    w.add_argument("--prompt-tokens", type=int, help="override: fixed prompt length")
    w.add_argument("--output-tokens", type=int, help="override: fixed output length")
    w.add_argument("--turns", type=int, help="override: turns per session")
    w.add_argument("--shared-prefix-ratio", type=float, help="override: shared prefix share")
    w.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that refuse the field)",
    )
    load = p.add_argument_group("load")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        metavar="N",
        help="closed-loop sweep: clients sending back to back (default: 1 4 16)",
    )
    mode.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        metavar="R",
        help="open-loop sweep: Poisson arrivals, R sessions per second on average",
    )
    load.add_argument(
        "--max-concurrency", type=int, help="with --request-rate: most requests in flight"
    )
    load.add_argument(
        "--num-requests",
        type=int,
        help="requests per window (default: 4 x concurrency, at least 8; or 10 s of arrivals)",
    )
    load.add_argument(
        "--client-processes",
        type=int,
        default=0,
        metavar="N",
        help="spread closed-loop clients over N processes (default: one per 64 clients)",
    )
    load.add_argument("--warmup", type=int, default=2, help="warm-up requests per server")
    load.add_argument(
        "--repetitions", type=int, default=1, help="windows per level and server (pooled)"
    )
    load.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    load.add_argument("--timeout", type=float, default=600, help="per request, in seconds")
    o = p.add_argument_group("output")
    o.add_argument("--json", type=Path, metavar="PATH", help="full results as JSON")
    o.add_argument("--csv", type=Path, metavar="PATH", help="the summary table as CSV")
    o.add_argument(
        "--plot",
        type=Path,
        metavar="PREFIX",
        help="PNG plots PREFIX-throughput.png and PREFIX-latency.png (needs pippin[bench])",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _targets(args: argparse.Namespace) -> list:
    from pippin.bench.runner import Target

    urls = args.url or ["http://127.0.0.1:8000"]
    models = args.model or [None]
    if len(models) not in (1, len(urls)):
        raise SystemExit("pippin bench: give --model once, or once per --url")
    targets = []
    for i, spec in enumerate(urls):
        name, sep, url = spec.partition("=")
        if not sep or "://" in name:
            name, url = "", spec
        url = url.rstrip("/").removesuffix("/v1")
        name = name or urlsplit(url).netloc
        model = models[i] if len(models) > 1 else models[0]
        targets.append(Target(name, url, model, args.api_key))
    if len({t.name for t in targets}) != len(targets):
        raise SystemExit("pippin bench: servers need distinct names (NAME=URL)")
    return targets


def run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from pippin.bench.report import aggregate, describe, table, write_csv, write_json
    from pippin.bench.runner import BenchConfig, run_benchmark

    try:
        workload = load_workload(args.workload)
    except ValueError as exc:
        raise SystemExit(f"pippin bench: {exc}") from None
    overrides = {
        "api": args.api,
        "turns": args.turns,
        "shared_prefix_ratio": args.shared_prefix_ratio,
        "prompt_tokens": Length.parse(args.prompt_tokens) if args.prompt_tokens else None,
        "output_tokens": Length.parse(args.output_tokens) if args.output_tokens else None,
        "ignore_eos": False if args.no_ignore_eos else None,
    }
    workload = replace(workload, **{k: v for k, v in overrides.items() if v is not None})
    rate = args.request_rate is not None
    cfg = BenchConfig(
        targets=_targets(args),
        workload=workload,
        mode="rate" if rate else "concurrency",
        levels=[float(x) for x in (args.request_rate if rate else args.concurrency or [1, 4, 16])],
        num_requests=args.num_requests,
        warmup=args.warmup,
        repetitions=args.repetitions,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        timeout=args.timeout,
        progress=not args.no_progress,
        client_processes=args.client_processes,
    )
    bench = asyncio.run(run_benchmark(cfg))
    rows = aggregate(bench)
    print(describe(bench))
    print()
    print(table(rows, cfg.mode, cfg.targets[0].name if len(cfg.targets) > 1 else None))
    failed = sum(r["failed"] for r in rows)
    if failed:
        errors = sorted({e for r in rows for e in r["errors"]})
        print(f"\n{failed} request(s) failed: {'; '.join(errors)}", file=sys.stderr)
    if args.json:
        write_json(args.json, bench, rows)
    if args.csv:
        write_csv(args.csv, rows)
    if args.plot:
        from pippin.bench.plots import plot

        for path in plot(rows, cfg.mode, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 1 if failed == sum(r["requests"] for r in rows) else 0
