"""Reading a server's Prometheus `/metrics`: pippin's, vLLM's, or any other.

`Samples` maps a sample name to its (labels, value) pairs; `total` sums the ones whose
labels match. Cache hit rates and speculative decoding's acceptance come from the
difference of two scrapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]


def parse_metrics(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def total(samples: Samples, name: str, **labels: str) -> float | None:
    """Sum of the samples of `name` whose labels include `labels`; None if there are none."""
    found = [
        v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items())
    ]
    return sum(found) if found else None


async def scrape(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str] | None = None
) -> Samples | None:
    """The server's metrics, or None where it has no /metrics (or it is not Prometheus)."""
    try:
        r = await client.get(f"{base_url}/metrics", headers=headers, timeout=10)
        if r.status_code != 200:
            return None
        return parse_metrics(r.text)
    except (httpx.HTTPError, ValueError):
        return None


# (name of the hit counter, name of the query counter, what they count), first match wins.
_HIT_COUNTERS = (
    ("pippin_prompt_tokens_cached_total", "pippin_prompt_tokens_total", "tokens"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "tokens"),
    ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total", "tokens"),
)


@dataclass
class CacheStats:
    hit_rate: float | None  # share of prompt tokens served from the prefix cache
    unit: str
    source: str  # the counter it came from


def _changes(
    before: Samples | None, after: Samples | None, names: tuple[str, ...]
) -> list[float] | None:
    """Each counter's change between two scrapes; None unless both have every one."""
    if before is None or after is None:
        return None
    out = []
    for name in names:
        a, b = total(before, name), total(after, name)
        if a is None or b is None:
            return None
        out.append(b - a)
    return out


def cache_hit_rate(before: Samples | None, after: Samples | None) -> CacheStats | None:
    """The server's prefix-cache hit rate between two scrapes, when it exports one."""
    for hits, queries, unit in _HIT_COUNTERS:
        if (changes := _changes(before, after, (hits, queries))) is not None:
            dh, dq = changes
            return CacheStats(dh / dq if dq > 0 else None, unit, hits)
    return None


# (kept proposed tokens, proposed tokens), vLLM's counters under pippin's prefix and vLLM's.
_SPEC_COUNTERS = (
    ("pippin_spec_decode_num_accepted_tokens_total", "pippin_spec_decode_num_draft_tokens_total"),
    ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"),
)


@dataclass
class SpecStats:
    accepted: float  # proposed tokens the target kept
    proposed: float
    source: str  # the counter it came from

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.proposed if self.proposed > 0 else None


def spec_acceptance(before: Samples | None, after: Samples | None) -> SpecStats | None:
    """Speculative decoding's proposed and kept tokens between two scrapes, when the server
    exports them (a server that does not speculate exports none, or proposes nothing)."""
    for kept, proposed in _SPEC_COUNTERS:
        if (changes := _changes(before, after, (kept, proposed))) is not None:
            return SpecStats(*changes, source=kept)
    return None


@dataclass
class TraceStats:
    """pippin's compiled decode step tracing new shapes between two scrapes: each a step
    that waited on its trace and first run (a stall in the window's throughput, when there
    are many)."""

    traces: float
    seconds: float


def decode_traces(before: Samples | None, after: Samples | None) -> TraceStats | None:
    names = ("pippin_decode_graph_traces_total", "pippin_decode_graph_trace_seconds_total")
    changes = _changes(before, after, names)
    return TraceStats(*changes) if changes is not None else None
