"""PNG plots of throughput and latency against the load level, one line per server.

matplotlib is an optional extra (``pip install 'pippin[bench]'``), imported only here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(rows: list[dict[str, Any]], mode: str, prefix: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(
            "pippin bench --plot needs matplotlib: pip install 'pippin[bench]'"
        ) from exc
    xlabel = "concurrency" if mode == "concurrency" else "request rate (req/s)"
    servers = list(dict.fromkeys(r["server"] for r in rows))
    out = []

    def series(server: str, key: str) -> tuple[list[float], list[float]]:
        pts = [(r[mode], r[key]) for r in rows if r["server"] == server and r[key] is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in servers:
        ax.plot(*series(s, "tok_s"), marker="o", label=s)
    ax.set(xlabel=xlabel, ylabel="output tokens/s", title="Throughput")
    _finish(ax, mode)
    out.append(_save(fig, prefix, "throughput"))

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(
        axes, ("ttft", "itl", "e2e"), ("Time to first token", "Inter-token latency", "End to end")
    ):
        for s in servers:
            xs, p50 = series(s, f"{key}_p50")
            line = ax.plot(xs, [y * 1000 for y in p50], marker="o", label=f"{s} p50")[0]
            xs, p99 = series(s, f"{key}_p99")
            ax.plot(xs, [y * 1000 for y in p99], ls="--", color=line.get_color(), label=f"{s} p99")
        ax.set(xlabel=xlabel, ylabel="ms", title=title)
        _finish(ax, mode)
    out.append(_save(fig, prefix, "latency"))
    plt.close("all")
    return out


def _finish(ax: Any, mode: str) -> None:
    if mode == "concurrency":
        from matplotlib.ticker import ScalarFormatter

        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig: Any, prefix: Path, what: str) -> Path:
    path = prefix.with_name(f"{prefix.name}-{what}.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
