"""`pippin bench`: its flags, and the run from flags to table, JSON, CSV and plots."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pippin import envs
from pippin.bench.workload import BUILTIN, Length, Workload, load_workload


class _Server(argparse.Action):
    """--url and --serve into one list, in the order given (ratios are to the first)."""

    def __call__(self, parser: Any, ns: argparse.Namespace, value: Any, opt: Any = None) -> None:
        ns.servers = [*(ns.servers or []), (self.dest, value)]


def _numbers(kind: type) -> Any:
    """A number or a comma-separated list of them (vllm-mlx writes sweeps as '1,4')."""

    def parse(text: str) -> list[Any]:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number or list of numbers: {text!r}") from None

    return parse


class _Flatten(argparse.Action):
    def __call__(self, parser: Any, ns: argparse.Namespace, values: Any, opt: Any = None) -> None:
        setattr(ns, self.dest, [x for v in values for x in v])


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.set_defaults(servers=None)
    s = p.add_argument_group("servers")
    s.add_argument(
        "--url",
        action=_Server,
        metavar="[NAME=]URL",
        help="a running server to measure, e.g. http://127.0.0.1:8000 (a trailing /v1 is "
        "fine). Give --url and --serve several times to compare servers in one run, "
        "interleaved, with ratios to the first (default: http://127.0.0.1:8000)",
    )
    s.add_argument(
        "--serve",
        action=_Server,
        metavar="SPEC",
        help="a server to start, measure and stop: '[VAR=VALUE ...] [NAME=]KIND:MODEL "
        "[FLAGS ...]' with KIND pippin, mlx_lm, vllm_mlx or cmd, MODEL a path, a Hub id or "
        "random:NAME (tiny-qwen3, tiny-qwen3.5, llama-3.2-1b, llama-3.1-8b, qwen3-0.6b, "
        "qwen3-30b-a3b, qwen3.5-9b, "
        "gpt-oss-20b, each optionally "
        "-4bit or -8bit, gpt-oss-20b also -mxfp4: random weights, built once), "
        "e.g. --serve 'pippin:random:tiny-qwen3 --max-model-len 4096' --serve "
        "mlx_lm:random:tiny-qwen3 (see docs/benchmarks.md)",
    )
    s.add_argument(
        "--model",
        action="append",
        help="the 'model' field: once for all --url servers or once per --url (default: "
        "the first model each server lists)",
    )
    s.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="KIND=PATH",
        help="the Python that runs --serve servers of KIND (default: this one)",
    )
    s.add_argument(
        "--model-root",
        type=Path,
        metavar="DIR",
        help="where random:NAME models are built (default: ~/.cache/pippin/bench-models)",
    )
    s.add_argument(
        "--blas",
        default="auto",
        metavar="auto|none|PATH",
        help="Linux: the BLAS every --serve server's MLX gets: auto (the OpenBLAS pippin "
        "preloads, preloaded into the peers too), none (no preload, pippin's neither), or a "
        "library (default: %(default)s)",
    )
    s.add_argument(
        "--startup-timeout",
        type=float,
        default=600,
        metavar="S",
        help="seconds a --serve server may take to answer (default: %(default)s)",
    )
    s.add_argument(
        "--no-pause-idle",
        action="store_true",
        help="leave idle --serve servers running (by default they are paused with SIGSTOP "
        "while another server is measured)",
    )
    s.add_argument("--log-dir", type=Path, help="--serve servers' logs (default: a temp folder)")
    s.add_argument(
        "--api-key",
        default=envs.PIPPIN_API_KEY or envs.OPENAI_API_KEY,
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
    w.add_argument(
        "--system-tokens",
        type=int,
        metavar="N",
        help="agent: the system prompt's tokens, tools included (default: 12000)",
    )
    w.add_argument(
        "--tool-tokens",
        type=int,
        metavar="N",
        help="agent: each tool result's tokens (default: 300)",
    )
    w.add_argument(
        "--answer-tokens",
        type=int,
        dest="output_tokens",
        metavar="N",
        help="agent: the cap on each answer (max_tokens; the same as --output-tokens; "
        "default: 100)",
    )
    w.add_argument("--shared-prefix-ratio", type=float, help="override: shared prefix share")
    w.add_argument(
        "--tokenizer",
        metavar="PATH|none",
        help="prompt lengths in tokens of this tokenizer.json (or folder with one), or llama3 "
        "(the real Llama 3 tokenizer); default: the workload's, else the first --serve model "
        "folder that has one (a GGUF: pippin's conversion of it), else a word (editing: "
        "4 characters) a token",
    )
    w.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="do not send ignore_eos (for servers that refuse the field)",
    )
    load = p.add_argument_group("load")
    mode = load.add_mutually_exclusive_group()
    mode.add_argument(
        "--concurrency",
        type=_numbers(int),
        nargs="+",
        action=_Flatten,
        metavar="N",
        help="closed-loop sweep: clients sending back to back, as '1 4 16' or '1,4,16' "
        "(default: 1 4 16; the agent workload: 4)",
    )
    mode.add_argument(
        "--sessions",
        type=_numbers(int),
        nargs="+",
        action=_Flatten,
        dest="concurrency",
        metavar="S",
        help="the same as --concurrency, named for the agent workload: S sessions at once, "
        "each a client sending its turns one after another (default there: 4)",
    )
    mode.add_argument(
        "--request-rate",
        type=_numbers(float),
        nargs="+",
        action=_Flatten,
        metavar="R",
        help="open-loop sweep: Poisson arrivals, R sessions per second on average",
    )
    load.add_argument(
        "--max-concurrency", type=int, help="with --request-rate: most requests in flight"
    )
    load.add_argument(
        "--num-requests",
        type=int,
        help="requests per window (default: --requests-per-client x concurrency, at least 8; "
        "or 10 s of arrivals)",
    )
    load.add_argument(
        "--requests-per-client",
        type=float,
        default=4,
        metavar="K",
        help="closed loop: requests per client a window (default: %(default)s)",
    )
    load.add_argument(
        "--stagger-ms",
        type=float,
        metavar="MS",
        help="closed loop: delay between the starts of a window's clients (default: 3 with "
        "an mlx_lm server started, else 0)",
    )
    load.add_argument(
        "--connect-retries",
        type=int,
        metavar="N",
        help="retries of a refused or reset connect, counted in the results (default: 20 "
        "with an mlx_lm server started, else 3)",
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
        "--md",
        type=Path,
        metavar="PATH",
        help="the command, the machine, versions and servers, and the table, as Markdown",
    )
    o.add_argument(
        "--plot",
        type=Path,
        metavar="PREFIX",
        help="PNG plots PREFIX-throughput.png and PREFIX-latency.png (needs pippin[bench])",
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


# vllm-mlx's bench-serve output formats -> pippin bench's output flag.
_FORMATS = {"json": "json", "csv": "csv", "table": "md"}


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    """`pippin bench-serve`: `pippin bench` with vllm-mlx's bench-serve flag names."""
    add_bench_args(p)
    v = p.add_argument_group("vllm-mlx bench-serve names")
    v.add_argument(
        "--prompts",
        metavar="NAME",
        help=f"the workload: one of pippin's ({', '.join(BUILTIN)}) or a workload file; "
        "vllm-mlx's prompt sets (short, medium, long, thinking) are not shipped",
    )
    v.add_argument(
        "--max-tokens", type=int, metavar="N", help="tokens per answer (--output-tokens)"
    )
    v.add_argument(
        "--format",
        choices=sorted(_FORMATS),
        default="table",
        help="with --output: the file's format (table: Markdown) (default: %(default)s)",
    )
    v.add_argument("--output", type=Path, metavar="PATH", help="write the results here")
    v.add_argument(
        "--skip-preflight-token-count",
        action="store_true",
        help="accepted: pippin bench sends no preflight request",
    )


def from_bench_serve(args: argparse.Namespace) -> argparse.Namespace:
    """vllm-mlx's bench-serve flags as `pippin bench`'s."""
    if args.prompts is not None:
        if "," in args.prompts:
            raise SystemExit(
                "pippin bench-serve: --prompts takes one workload here (run once per workload)"
            )
        if args.prompts in ("medium", "long", "thinking"):
            raise SystemExit(
                f"pippin bench-serve: vllm-mlx's prompt set {args.prompts!r} is not shipped; "
                f"use one of {', '.join(BUILTIN)} or a workload file (docs/benchmarks.md)"
            )
        args.workload = args.prompts
    if args.max_tokens is not None:
        args.output_tokens = args.output_tokens or args.max_tokens
    if args.output is not None:
        setattr(args, _FORMATS[args.format], args.output)
    return args


def _entries(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """("url", (name, url)) and ("serve", ServerSpec) in the order given."""
    from pippin.bench.servers import parse_spec

    out: list[tuple[str, Any]] = []
    for kind, value in args.servers or [("url", "http://127.0.0.1:8000")]:
        if kind == "serve":
            try:
                out.append((kind, parse_spec(value)))
            except ValueError as exc:
                raise SystemExit(f"pippin bench: {exc}") from None
            continue
        name, sep, url = value.partition("=")
        if not sep or "://" in name:
            name, url = "", value
        url = url.rstrip("/").removesuffix("/v1")
        out.append((kind, (name or urlsplit(url).netloc, url)))
    names = [v.name if k == "serve" else v[0] for k, v in out]
    if len(set(names)) != len(names):
        raise SystemExit("pippin bench: servers need distinct names (NAME=URL, NAME=KIND:MODEL)")
    return out


def _targets(args: argparse.Namespace, entries: list[tuple[str, Any]], servers: Any) -> list:
    from pippin.bench.runner import Target

    urls = [v for k, v in entries if k == "url"]
    models = args.model or [None]
    if len(models) not in (1, len(urls)):
        raise SystemExit("pippin bench: give --model once, or once per --url")
    targets, i = [], 0
    for kind, value in entries:
        if kind == "serve":
            srv = servers.servers[value.name]
            targets.append(Target(value.name, srv.url, srv.model_field, args.api_key))
        else:
            model = models[i] if len(models) > 1 else models[0]
            targets.append(Target(value[0], value[1], model, args.api_key))
            i += 1
    return targets


def _command() -> str:
    if sys.argv[1:2] in (["bench"], ["bench-serve"]):
        return shlex.join(["pippin", *sys.argv[1:]])
    return "pippin bench (called from Python)"


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload named by --workload with the command line's overrides."""
    from dataclasses import replace

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
        "system_tokens": args.system_tokens,
        "tool_tokens": Length.parse(args.tool_tokens) if args.tool_tokens else None,
        "ignore_eos": False if args.no_ignore_eos else None,
    }
    try:
        return replace(workload, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        raise SystemExit(f"pippin bench: {exc}") from None


def run(args: argparse.Namespace) -> int:
    workload = workload_from_args(args)
    rate = args.request_rate is not None
    entries = _entries(args)
    specs = [v for k, v in entries if k == "serve"]
    ramp = any(s.ramps_clients for s in specs)
    stagger_ms = args.stagger_ms if args.stagger_ms is not None else (3.0 if ramp else 0.0)
    retries = args.connect_retries if args.connect_retries is not None else (20 if ramp else 3)
    pythons = {}
    for item in args.python:
        kind, sep, path = item.partition("=")
        if not sep:
            raise SystemExit(f"pippin bench: --python {item!r}: expected KIND=PATH")
        pythons[kind] = path
    servers: Any = contextlib.nullcontext()
    if specs:
        from pippin.bench.servers import ServerSet

        servers = ServerSet(
            specs,
            pythons=pythons,
            blas=args.blas,
            startup_timeout=args.startup_timeout,
            pause_idle=not args.no_pause_idle,
            log_dir=args.log_dir,
            model_root=args.model_root,
        )
    try:
        with servers as started:
            bench = _measure(args, workload, entries, started, rate, stagger_ms, retries)
    except RuntimeError as exc:  # a server that did not start
        raise SystemExit(f"pippin bench: {exc}") from None
    return _report(args, bench)


def _served_tokenizer(model: str) -> str | None:
    """The folder holding a served model's `tokenizer.json`: its own, or for a GGUF file
    the conversion pippin keeps of it (there once a pippin server has loaded it)."""
    path = Path(model)
    if (path / "tokenizer.json").is_file():
        return str(path)
    if path.suffix == ".gguf" and path.is_file():
        from pippin.store.gguf_loader import cache_folder

        folders = (cache_folder(path, requant) for requant in (False, True))
        return next((str(f) for f in folders if (f / "tokenizer.json").is_file()), None)
    return None


def _measure(
    args: argparse.Namespace,
    workload: Any,
    entries: list[tuple[str, Any]],
    started: Any,
    rate: bool,
    stagger_ms: float,
    retries: int,
) -> Any:
    from dataclasses import replace

    from pippin.bench.runner import BenchConfig, run_benchmark
    from pippin.bench.workload import words_per_token

    tokenizer = args.tokenizer or workload.tokenizer
    label = None
    if tokenizer is None and started is not None:
        found = ((_served_tokenizer(s.model), s.model) for s in started.servers.values() if s.model)
        tokenizer, model = next(((f, m) for f, m in found if f), (None, None))
        label = Path(model).name if model and model.endswith(".gguf") else None
    if tokenizer == "none":
        workload = replace(workload, tokenizer=None)
    elif tokenizer:
        # The one measured with names itself in the report (a --tokenizer over the workload's).
        # Editing prompts count their code's tokens with it directly.
        wpt = words_per_token(tokenizer) if workload.prompt_source != "editing" else 1.0
        workload = replace(
            workload, tokenizer=tokenizer, tokenizer_label=label, words_per_token=wpt
        )
    default = [4] if workload.prompt_source == "agent" else [1, 4, 16]
    cfg = BenchConfig(
        targets=_targets(args, entries, started),
        workload=workload,
        mode="rate" if rate else "concurrency",
        levels=[float(x) for x in (args.request_rate if rate else args.concurrency or default)],
        num_requests=args.num_requests,
        warmup=args.warmup,
        repetitions=args.repetitions,
        seed=args.seed,
        max_concurrency=args.max_concurrency,
        timeout=args.timeout,
        progress=not args.no_progress,
        client_processes=args.client_processes,
        requests_per_client=args.requests_per_client,
        stagger=stagger_ms / 1000,
        connect_retries=retries,
        watch=started,
    )
    bench = asyncio.run(run_benchmark(cfg))
    if started is not None:
        for s in bench.servers:
            if s["name"] in started.servers:
                s.update(started.servers[s["name"]].info())
    return bench


def _report(args: argparse.Namespace, bench: Any) -> int:
    from pippin.bench.report import (
        aggregate,
        describe,
        markdown,
        table,
        turn_rows,
        turn_table,
        write_csv,
        write_json,
    )

    cfg = bench.config
    rows = aggregate(bench)
    print(describe(bench))
    print()
    print(table(rows, cfg.mode, cfg.targets[0].name if len(cfg.targets) > 1 else None))
    if cfg.workload.turns > 1:
        print()
        print(turn_table(turn_rows(bench), cfg.mode))
    failed = sum(r["failed"] for r in rows)
    if failed:
        errors = sorted({e for r in rows for e in r["errors"]})
        print(f"\n{failed} request(s) failed: {'; '.join(errors)}", file=sys.stderr)
    if args.json:
        write_json(args.json, bench, rows)
    if args.csv:
        write_csv(args.csv, rows)
    if args.md:
        args.md.write_text(markdown(bench, rows, _command()))
    if args.plot:
        from pippin.bench.plots import plot

        for path in plot(rows, cfg.mode, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 1 if failed == sum(r["requests"] for r in rows) else 0
