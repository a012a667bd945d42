"""The Prometheus metrics of one app, in a registry of its own (several apps in one
process do not clash). Every metric is listed in docs/architecture.md#metrics.

Request-level metrics are fed by `pippin.obs.observer` and the HTTP middleware; the
engine's gauges and counters (queues, KV blocks, prefix cache, preemptions) are read from
`EngineClient.stats()` when scraped, so they cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
)
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Seconds, from half a millisecond (a decode step) to ten minutes (a long generation).
BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip

CONTENT_TYPE = CONTENT_TYPE_LATEST

# No `_created` series: they double the output and nothing here reads them.
disable_created_metrics()

# The only KV tier so far: blocks in device memory (quantised and SSD tiers come later).
DEVICE_TIER = "device"


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)

        def hist(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=BUCKETS)

        self.http_requests = Counter(
            "pippin_http_requests",
            "HTTP requests answered, by route, method and status code.",
            ("endpoint", "method", "status"),
            registry=r,
        )
        self.errors = Counter(
            "pippin_request_errors",
            "Requests that ended in an error, by kind (the error body's code, or its type).",
            ("kind",),
            registry=r,
        )
        self.cancellations = Counter(
            "pippin_request_cancellations",
            "Generations left before they finished (the client went away).",
            registry=r,
        )
        self.finished = Counter(
            "pippin_requests_finished",
            "Generations that finished, by the finish reason of their last choice.",
            ("finish_reason",),
            registry=r,
        )
        self.queue_time = hist(
            "pippin_request_queue_time_seconds",
            "From submission to the engine until the request's first step is scheduled.",
        )
        self.ttft = hist(
            "pippin_time_to_first_token_seconds",
            "From submission to the engine until the first generated token reaches the front.",
        )
        self.itl = hist(
            "pippin_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request, as the front receives them.",
        )
        self.tpot = hist(
            "pippin_time_per_output_token_seconds",
            "Per request: (last token time - first token time) / (tokens - 1).",
        )
        self.e2e = hist(
            "pippin_e2e_request_latency_seconds",
            "From submission to the engine until the request's last output.",
        )
        self.step = hist(
            "pippin_engine_step_duration_seconds",
            "Wall time of one engine step; phase=prefill if it computed any prompt tokens, "
            "else decode.",
            ("phase",),
        )
        self.prompt_tokens = Counter(
            "pippin_prompt_tokens", "Prompt tokens of finished or cancelled requests.", registry=r
        )
        self.cached_tokens = Counter(
            "pippin_prompt_tokens_cached",
            "Prompt tokens served from the prefix cache instead of being computed.",
            registry=r,
        )
        self.generation_tokens = Counter(
            "pippin_generation_tokens", "Tokens generated, all choices together.", registry=r
        )
        r.register(EngineCollector(stats))

    def exposition(self) -> bytes:
        return _generate_latest(self.registry)


class EngineCollector(Collector):
    """Reads the engine's state at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int]]) -> None:
        self.stats = stats

    def describe(self) -> list[Metric]:
        return []  # unknown until the model is loaded; nothing to check names against

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if not s:
            return
        yield _gauge("pippin_requests_running", "Sequences in the running batch.", s["running"])
        yield _gauge("pippin_requests_waiting", "Sequences waiting to be admitted.", s["waiting"])
        total, free = s["blocks_total"], s["blocks_free"]
        blocks = GaugeMetricFamily(
            "pippin_kv_blocks",
            "KV cache blocks per tier; state=free includes cached blocks that may be reused.",
            labels=("tier", "state"),
        )
        blocks.add_metric((DEVICE_TIER, "used"), total - free)
        blocks.add_metric((DEVICE_TIER, "free"), free)
        yield blocks
        usage = GaugeMetricFamily(
            "pippin_kv_cache_usage_ratio", "Share of KV blocks in use, per tier.", labels=("tier",)
        )
        usage.add_metric((DEVICE_TIER,), (total - free) / total if total else 0.0)
        yield usage
        yield _gauge("pippin_kv_block_size_tokens", "Tokens per KV block.", s["block_size"])
        queries, hits = s["prefix_queries"], s["prefix_hits"]
        yield _counter(
            "pippin_prefix_cache_queries", "Admissions that looked up the prefix cache.", queries
        )
        yield _counter(
            "pippin_prefix_cache_hits", "Admissions that found cached prefix blocks.", hits
        )
        yield _gauge(
            "pippin_prefix_cache_hit_ratio",
            "prefix_cache_hits / prefix_cache_queries since start (0 before any query).",
            hits / queries if queries else 0.0,
        )
        yield _counter(
            "pippin_preemptions",
            "Sequences preempted (blocks freed, recomputed later).",
            s["preemptions"],
        )
        yield _counter("pippin_engine_steps", "Engine steps run.", s["steps"])
        failed = CounterMetricFamily(
            "pippin_engine_failed_steps",
            "Engine steps that raised: out_of_memory (running sequences recomputed) or other "
            "(running requests ended).",
            labels=("kind",),
        )
        for kind in ("out_of_memory", "other"):
            failed.add_metric((kind,), s[f"failed_steps_{kind}"])
        yield failed


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)
