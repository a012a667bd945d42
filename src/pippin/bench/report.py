"""Results as a table (stdout), JSON and CSV; in compare mode, ratios to the first server."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pippin.bench.client import RequestResult
from pippin.bench.runner import BenchRun, Window
from pippin.bench.stats import FEW_SAMPLES, percentile, summarize


def aggregate(run: BenchRun) -> list[dict[str, Any]]:
    """One row per (level, server): all repetitions pooled, servers in the order given."""
    rows = []
    names = [t.name for t in run.config.targets]
    for level in run.config.levels:
        for name in names:
            wins: list[Window] = [w for w in run.windows if w.target == name and w.level == level]
            if not wins:
                continue
            row: dict[str, Any] = {"server": name, run.config.mode: level}
            row.update(summarize([r for w in wins for r in w.results], sum(w.wall for w in wins)))
            rates = [w.cache.hit_rate for w in wins if w.cache and w.cache.hit_rate is not None]
            row["server_cache_hit_rate"] = sum(rates) / len(rates) if rates else None
            specs = [w.spec for w in wins if w.spec is not None]
            proposed = sum(x.proposed for x in specs)
            row["spec_proposed_tokens"] = proposed if specs else None
            row["spec_acceptance"] = sum(x.accepted for x in specs) / proposed if proposed else None
            traces = [w.traces for w in wins if w.traces is not None]
            row["decode_traces"] = sum(x.traces for x in traces) if traces else None
            row["decode_trace_s"] = sum(x.seconds for x in traces) if traces else None
            for key in ("server_cpu", "machine_cpu"):  # shares of a core, wall-weighted
                cpu = [(w.cpu[key], w.wall) for w in wins if w.cpu and key in w.cpu]
                row[key] = sum(c * t for c, t in cpu) / sum(t for _, t in cpu) if cpu else None
            if run.config.workload.turns > 1:
                row.update(later_turns(r for w in wins for r in w.results))
            rows.append(row)
    add_ratios(rows, run.config.mode, names[0])
    return rows


def _ttfts(results: list[RequestResult]) -> list[float]:
    return [r.ttft for r in results if r.ok and r.ttft is not None]


def later_turns(results: Any) -> dict[str, float | None]:
    """TTFT of the turns after a session's first, over the first turn's median: their median
    (`later_ttft_x`) and their worst (`later_ttft_max_x`). A server that reuses the
    conversation's prefix answers a later turn in a fraction of the first's time."""
    results = list(results)
    first = percentile(_ttfts([r for r in results if r.turn == 0]), 50)
    later = _ttfts([r for r in results if r.turn > 0])
    if not first or not later:
        return {"later_ttft_x": None, "later_ttft_max_x": None}
    return {
        "later_ttft_x": (percentile(later, 50) or 0) / first,
        "later_ttft_max_x": max(later) / first,
    }


def turn_rows(run: BenchRun) -> list[dict[str, Any]]:
    """Multi-turn sessions: one row per (level, server, turn), all repetitions pooled: TTFT
    p50 and max, the mean prompt and cached tokens the server's usage reported
    (`prompt_tokens_details.cached_tokens`), and the TTFT p50 over the first turn's."""
    rows = []
    mode = run.config.mode
    for level in run.config.levels:
        for t in run.config.targets:
            results = [
                r for w in run.windows if w.target == t.name and w.level == level for r in w.results
            ]
            first = percentile(_ttfts([r for r in results if r.turn == 0]), 50)
            for turn in sorted({r.turn for r in results}):
                these = [r for r in results if r.turn == turn]
                ok = [r for r in these if r.ok]
                ttfts = _ttfts(these)
                prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
                cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
                p50 = percentile(ttfts, 50)
                rows.append(
                    {
                        "server": t.name,
                        mode: level,
                        "turn": turn + 1,
                        "requests": len(these),
                        "failed": len(these) - len(ok),
                        "prompt_tokens_mean": sum(prompt) / len(prompt) if prompt else None,
                        "cached_tokens_mean": sum(cached) / len(cached) if cached else None,
                        "ttft_p50": p50,
                        "ttft_max": max(ttfts) if ttfts else None,
                        "ttft_x_turn1": p50 / first if p50 is not None and first else None,
                    }
                )
    return rows


def turn_table(rows: list[dict[str, Any]], mode: str) -> str:
    """`turn_rows` as a Markdown table."""
    level = "conc" if mode == "concurrency" else "rate"
    cols: list[tuple[str, Any]] = [
        (level, lambda r: f"{r[mode]:g}"),
        ("server", lambda r: r["server"]),
        ("turn", lambda r: str(r["turn"])),
        ("ok", lambda r: f"{r['requests'] - r['failed']}/{r['requests']}"),
        ("prompt tokens", lambda r: _num(r["prompt_tokens_mean"], 0)),
        ("cached tokens", lambda r: _num(r["cached_tokens_mean"], 0)),
        ("TTFT p50", lambda r: _ms(r["ttft_p50"])),
        ("TTFT max", lambda r: _ms(r["ttft_max"])),
        ("TTFT p50 / turn 1", lambda r: _num(r["ttft_x_turn1"], 3)),
    ]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(f(r) for _, f in cols) + " |" for r in rows]
    return "\n".join(lines)


def add_ratios(rows: list[dict[str, Any]], mode: str, first: str) -> None:
    """`tok_s_x`: the first server's tok/s over this one's; `ttft_p99_x`: the first's p99
    TTFT over this one's (below 1: the first answers sooner)."""
    base = {r[mode]: r for r in rows if r["server"] == first}
    for r in rows:
        b = base.get(r[mode])
        if r["server"] == first or b is None:
            continue
        r["tok_s_x"] = _ratio(b["tok_s"], r["tok_s"])
        r["ttft_p99_x"] = _ratio(b["ttft_p99"], r["ttft_p99"])


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x * 1000:,.1f} ms"


def _num(x: float | None, nd: int = 1) -> str:
    return "" if x is None else f"{x:,.{nd}f}"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x:.0%}"


def _pctl(r: dict[str, Any], name: str, p: int) -> str:
    """A percentile in ms, marked * when drawn from fewer than FEW_SAMPLES samples."""
    shown = _ms(r[f"{name}_p{p}"])
    few = shown and r.get(f"{name}_n", FEW_SAMPLES) < FEW_SAMPLES
    return shown + "*" if few else shown


def table(rows: list[dict[str, Any]], mode: str, first: str | None = None) -> str:
    """A Markdown table (readable as plain text too), with a note under it for percentiles
    marked as drawn from few samples."""
    # The level: clients at once, or the offered arrival rate (req/s is what was served).
    level = "conc" if mode == "concurrency" else "rate"
    cols: list[tuple[str, Any]] = [
        (level, lambda r: f"{r[mode]:g}"),
        ("server", lambda r: r["server"]),
        ("ok", lambda r: f"{r['requests'] - r['failed']}/{r['requests']}"),
        ("req/s", lambda r: _num(r.get("req_s"), 2)),
        ("tok/s", lambda r: _num(r["tok_s"])),
        ("TTFT p50", lambda r: _pctl(r, "ttft", 50)),
        ("TTFT p90", lambda r: _pctl(r, "ttft", 90)),
        ("TTFT p99", lambda r: _pctl(r, "ttft", 99)),
        ("ITL p50", lambda r: _pctl(r, "itl", 50)),
        ("ITL p99", lambda r: _pctl(r, "itl", 99)),
        ("TPOT p50", lambda r: _pctl(r, "tpot", 50)),
        ("e2e p50", lambda r: _pctl(r, "e2e", 50)),
        ("e2e p99", lambda r: _pctl(r, "e2e", 99)),
        ("cache hits", lambda r: _pct(r["server_cache_hit_rate"])),
    ]
    if any(r.get("later_ttft_x") is not None for r in rows):
        # Turns after a session's first: TTFT median and worst over turn 1's median.
        cols.append(("TTFT 2+ / 1", lambda r: _num(r.get("later_ttft_x"), 3)))
        cols.append(("worst 2+ / 1", lambda r: _num(r.get("later_ttft_max_x"), 3)))
    if any(r.get("spec_acceptance") is not None for r in rows):
        cols.append(("spec kept", lambda r: _pct(r.get("spec_acceptance"))))
    if any(r.get("server_cpu") is not None for r in rows):
        cols.append(("server CPU", lambda r: _pct(r.get("server_cpu"))))
    if any(r.get("decode_traces") for r in rows):
        cols.append(("decode traces", _traces))
    if first is not None and any("tok_s_x" in r for r in rows):
        cols.append((f"{first} tok/s ×", lambda r: _x(r.get("tok_s_x"))))
        cols.append((f"{first} TTFT p99 ×", lambda r: _x(r.get("ttft_p99_x"))))
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    cells = [[f(r) for _, f in cols] for r in rows]
    for row in cells:
        lines.append("| " + " | ".join(row) + " |")
    if any(c.endswith("*") for row in cells for c in row):
        lines.append(
            f"\n*: a percentile of fewer than {FEW_SAMPLES} samples (more requests firm it up)."
        )
    return "\n".join(lines)


def _traces(r: dict[str, Any]) -> str:
    """pippin's decode graphs traced in the window, and the seconds those steps took."""
    n = r.get("decode_traces")
    return "" if n is None else f"{n:.0f} ({r['decode_trace_s']:.1f} s)"


def _x(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}x"


def describe(run: BenchRun) -> str:
    """The header printed above the table: what ran where."""
    m = run.machine
    pk = ", ".join(f"{k} {v}" for k, v in m["packages"].items())
    if m.get("pippin_commit"):
        pk += f"; pippin commit {m['pippin_commit']}"

    gpus = f"; GPUs: {', '.join(m['gpus'])}" if m["gpus"] else ""
    servers = "; ".join(
        f"{s['name']} = {s['url']} (model {s['model']}"
        + (f", version {s['version']}" if s.get("version") else "")
        + (
            f", {s['kind']} {s['package_version']}"
            if s.get("package_version") and s["package_version"] != s.get("version")
            else ""
        )
        + ")"
        for s in run.servers
    )
    c = run.config
    return (
        f"{run.started}. Client: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB{gpus}; "
        f"{m['os']}; Python {m['python']}; {pk}.\nServers: {servers}.\n"
        f"Workload: {c.workload.describe()}; {c.mode} {', '.join(f'{x:g}' for x in c.levels)}; "
        f"{c.repetitions} repetition(s), warm-up {c.warmup} request(s) per server"
        + (f"; clients started {c.stagger * 1000:g} ms apart" if c.stagger else "")
        + "."
        + (
            f"\nInterrupted: {len(run.windows)} window(s) finished, the rest not measured."
            if run.interrupted
            else ""
        )
    )


def to_json(run: BenchRun, rows: list[dict[str, Any]]) -> dict[str, Any]:
    c = run.config
    return {
        "started": run.started,
        "interrupted": run.interrupted,
        "config": {
            "mode": c.mode,
            "levels": c.levels,
            "num_requests": c.num_requests,
            "warmup": c.warmup,
            "repetitions": c.repetitions,
            "seed": c.seed,
            "max_concurrency": c.max_concurrency,
            "requests_per_client": c.requests_per_client,
            "stagger_s": c.stagger,
            "connect_retries": c.connect_retries,
            "workload": asdict(c.workload),
        },
        "machine": run.machine,
        "servers": run.servers,
        "summary": rows,
        "turns": turn_rows(run) if c.workload.turns > 1 else None,
        "windows": [
            {
                "server": w.target,
                c.mode: w.level,
                "rep": w.rep,
                "cache": asdict(w.cache) if w.cache else None,
                "spec": asdict(w.spec) if w.spec else None,
                "cpu": w.cpu,
                **summarize(w.results, w.wall),
            }
            for w in run.windows
        ],
    }


def markdown(run: BenchRun, rows: list[dict[str, Any]], command: str) -> str:
    """What docs/benchmarks.md shows for a run: the command, where and what ran, the table."""
    first = run.config.targets[0].name if len(run.config.targets) > 1 else None
    out = f"```sh\n{command}\n```\n\n{describe(run)}\n\n{table(rows, run.config.mode, first)}\n"
    if run.config.workload.turns > 1:
        out += f"\nPer turn:\n\n{turn_table(turn_rows(run), run.config.mode)}\n"
    return out


def write_json(path: Path, run: BenchRun, rows: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps(to_json(run, rows), indent=2, default=str) + "\n")


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys and k != "errors"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
