"""Percentiles and the summary of a set of requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pippin.bench.client import RequestResult

PCTS = (50, 90, 99)
# Fewer samples than this make a percentile a guess (p99 of 10 is the largest of them):
# the table marks the ones drawn from fewer.
FEW_SAMPLES = 20


def percentile(xs: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _spread(name: str, xs: Sequence[float]) -> dict[str, float | int | None]:
    out: dict[str, float | int | None] = {
        f"{name}_mean": sum(xs) / len(xs) if xs else None,
        f"{name}_n": len(xs),  # how many samples the percentiles are drawn from
    }
    for p in PCTS:
        out[f"{name}_p{p}"] = percentile(xs, p)
    return out


def summarize(results: Sequence[RequestResult], wall: float) -> dict[str, Any]:
    """Aggregate numbers of requests that ran during `wall` seconds (all windows pooled)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    errors = sorted({r.error for r in results if r.error})
    summary: dict[str, Any] = {
        "requests": len(results),
        "failed": len(results) - len(ok),
        "wall_s": wall,
        "output_tokens": out_tokens,
        "prompt_tokens": sum(prompt) if prompt else None,
        "tok_s": out_tokens / wall if wall > 0 else None,
        "req_s": len(ok) / wall if wall > 0 else None,
        # What the server's usage says it took from its prefix cache (OpenAI's field).
        "usage_cached_ratio": sum(cached) / sum(prompt) if cached and sum(prompt) else None,
        "connect_retries": sum(r.connect_retries for r in results),
        "errors": errors[:5],
    }
    summary.update(_spread("ttft", [r.ttft for r in ok if r.ttft is not None]))
    summary.update(_spread("itl", [x for r in ok for x in r.itls]))
    summary.update(_spread("tpot", [t for r in ok if (t := r.tpot) is not None]))
    summary.update(_spread("e2e", [r.e2e for r in ok if r.e2e is not None]))
    return summary
