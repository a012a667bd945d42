"""The Prometheus metrics of one app, in a registry of its own (several apps in one
process do not clash). Every metric is listed in docs/architecture.md#metrics.

Request-level metrics are fed by `pippin.obs.observer` and the HTTP middleware; the
engine's gauges and counters (queues, KV blocks, prefix cache, preemptions) are read from
`EngineClient.stats()` when scraped, so they cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

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
# The engine's series that are counters (the rest are gauges).
_COUNTERS = frozenset(
    {
        "pippin_prefix_cache_queries",
        "pippin_prefix_cache_hits",
        "pippin_preemptions",
        "pippin_engine_steps",
        "pippin_engine_failed_steps",
        "pippin_decode_graph_traces",
        "pippin_decode_graph_trace_seconds",
        "pippin_spec_decode_num_drafts",
        "pippin_spec_decode_num_draft_tokens",
        "pippin_spec_decode_num_accepted_tokens",
        "pippin_spec_decode_num_replays",
        "pippin_spec_decode_num_accepted_tokens_per_pos",
        "pippin_spec_draft_evictions",
        "pippin_state_snapshot_hits",
        "pippin_state_snapshot_stores",
        "pippin_state_snapshot_evictions",
    }
)
# Speculative decoding's counters, vLLM's names (`vllm:spec_decode_*`) under pippin's prefix.
_SPEC_DOCS = {
    "spec_decode_num_drafts": "Proposals verified (one per sequence and step).",
    "spec_decode_num_draft_tokens": "Proposed tokens verified.",
    "spec_decode_num_accepted_tokens": "Proposed tokens kept.",
    "spec_decode_num_replays": "Rows of a model with recurrent layers whose kept tokens were "
    "replayed on their state from before the verify call (a proposal was refused).",
}

# Recurrent-state snapshots (models with recurrent layers; `pippin.engine.state_snapshots`).
_SNAPSHOT_DOCS = {
    "snapshot_hits": "Admissions that resumed a cached prefix from a recurrent-state snapshot.",
    "snapshot_stores": "Recurrent-state snapshots stored.",
    "snapshot_evictions": "Recurrent-state snapshots dropped, for room or with their block.",
    "snapshot_count": "Recurrent-state snapshots held in memory.",
    "snapshot_bytes": "Bytes the recurrent-state snapshots in memory hold.",
}


class Metrics:
    """The app's metrics. Those of generations carry a ``model`` label (the model's main
    name): a model's observer feeds them through `for_model`."""

    def __init__(
        self,
        stats: Callable[[], dict[str, dict[str, int]]],
        models: Callable[[], dict[str, tuple[str, int]]] = dict,
    ) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)

        def hist(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(name, doc, ("model", *labels), registry=r, buckets=BUCKETS)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, ("model", *labels), registry=r)

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
        self.cancellations = counter(
            "pippin_request_cancellations",
            "Generations left before they finished (the client went away).",
        )
        self.finished = counter(
            "pippin_requests_finished",
            "Generations that finished, by the finish reason of their last choice.",
            ("finish_reason",),
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
        self.prompt_tokens = counter(
            "pippin_prompt_tokens", "Prompt tokens of finished or cancelled requests."
        )
        self.cached_tokens = counter(
            "pippin_prompt_tokens_cached",
            "Prompt tokens served from the prefix cache instead of being computed.",
        )
        self.generation_tokens = counter(
            "pippin_generation_tokens", "Tokens generated, all choices together."
        )
        r.register(EngineCollector(stats, models))

    def for_model(self, model: str) -> ModelMetrics:
        """The generation metrics with the ``model`` label set (what observers feed)."""
        return ModelMetrics(self, model)

    def exposition(self) -> bytes:
        return _generate_latest(self.registry)


class _Labelled:
    """A labelled metric with the model's label already given: ``.labels(rest...)``."""

    def __init__(self, metric: Counter | Histogram, model: str) -> None:
        self.metric, self.model = metric, model

    def labels(self, *rest: str) -> Any:
        return self.metric.labels(self.model, *rest)


class ModelMetrics:
    """One model's view of `Metrics`: the same attribute names, the label set."""

    def __init__(self, m: Metrics, model: str) -> None:
        self.cancellations = m.cancellations.labels(model)
        self.finished = _Labelled(m.finished, model)
        self.queue_time = m.queue_time.labels(model)
        self.ttft = m.ttft.labels(model)
        self.itl = m.itl.labels(model)
        self.tpot = m.tpot.labels(model)
        self.e2e = m.e2e.labels(model)
        self.step = _Labelled(m.step, model)
        self.prompt_tokens = m.prompt_tokens.labels(model)
        self.cached_tokens = m.cached_tokens.labels(model)
        self.generation_tokens = m.generation_tokens.labels(model)


class EngineCollector(Collector):
    """Reads each loaded model's engine, and every model's state, at scrape time."""

    def __init__(
        self,
        stats: Callable[[], dict[str, dict[str, int]]],
        models: Callable[[], dict[str, tuple[str, int]]],
    ) -> None:
        self.stats = stats
        self.models = models

    def describe(self) -> list[Metric]:
        return []  # unknown until a model is loaded; nothing to check names against

    def collect(self) -> Iterator[Metric]:
        models = self.models()
        if models:
            loaded = GaugeMetricFamily(
                "pippin_model_loaded",
                "1 for each chat model's current state (loaded, loading, unloaded).",
                labels=("model", "state"),
            )
            memory = GaugeMetricFamily(
                "pippin_model_memory_bytes",
                "Weights and KV pool of each loaded chat model (0 when unloaded).",
                labels=("model",),
            )
            for name, (state, nbytes) in models.items():
                loaded.add_metric((name, state), 1)
                memory.add_metric((name,), nbytes if state == "loaded" else 0)
            yield loaded
            yield memory
        per_model = [(m, s) for m, s in self.stats().items() if s]
        if not per_model:
            return
        fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(name: str, doc: str, value: float, model: str, **extra: str) -> None:
            if name not in fams:
                kind = CounterMetricFamily if name in _COUNTERS else GaugeMetricFamily
                fams[name] = kind(name, doc, labels=("model", *extra))
            fams[name].add_metric((model, *extra.values()), value)

        for m, s in per_model:
            add("pippin_requests_running", "Sequences in the running batch.", s["running"], m)
            add("pippin_requests_waiting", "Sequences waiting to be admitted.", s["waiting"], m)
            total, free = s["blocks_total"], s["blocks_free"]
            doc = "KV cache blocks per tier; state=free includes cached blocks that may be reused."
            add("pippin_kv_blocks", doc, total - free, m, tier=DEVICE_TIER, state="used")
            add("pippin_kv_blocks", doc, free, m, tier=DEVICE_TIER, state="free")
            add(
                "pippin_kv_cache_usage_ratio",
                "Share of KV blocks in use, per tier.",
                (total - free) / total if total else 0.0,
                m,
                tier=DEVICE_TIER,
            )
            add("pippin_kv_block_size_tokens", "Tokens per KV block.", s["block_size"], m)
            queries, hits = s["prefix_queries"], s["prefix_hits"]
            add(
                "pippin_prefix_cache_queries",
                "Admissions that looked up the prefix cache.",
                queries,
                m,
            )
            add("pippin_prefix_cache_hits", "Admissions that found cached prefix blocks.", hits, m)
            add(
                "pippin_prefix_cache_hit_ratio",
                "prefix_cache_hits / prefix_cache_queries since start (0 before any query).",
                hits / queries if queries else 0.0,
                m,
            )
            add(
                "pippin_preemptions",
                "Sequences preempted (blocks freed, recomputed later).",
                s["preemptions"],
                m,
            )
            add("pippin_engine_steps", "Engine steps run.", s["steps"], m)
            add(
                "pippin_decode_graph_traces",
                "Decode steps of a new padded shape (rows, table width, LoRA), which traced and "
                "compiled the step's graph before running it.",
                s["decode_traces"],
                m,
            )
            add(
                "pippin_decode_graph_trace_seconds",
                "Seconds those decode steps took: tracing, compiling and the first run.",
                s["decode_trace_seconds"],
                m,
            )
            for kind in ("out_of_memory", "other"):
                add(
                    "pippin_engine_failed_steps",
                    "Engine steps that raised: out_of_memory (running sequences recomputed) "
                    "or other (running requests ended).",
                    s[f"failed_steps_{kind}"],
                    m,
                    kind=kind,
                )
            if "snapshot_hits" in s:  # a model with recurrent layers
                for key, doc in _SNAPSHOT_DOCS.items():
                    add(f"pippin_state_{key}", doc, s[key], m)
            if "spec_decode_num_drafts" not in s:
                continue  # speculation off
            for key, doc in _SPEC_DOCS.items():
                add(f"pippin_{key}", doc, s[key], m)
            pos = 0
            while f"spec_decode_num_accepted_tokens_pos{pos}" in s:
                add(
                    "pippin_spec_decode_num_accepted_tokens_per_pos",
                    "Proposed tokens kept, by position in the proposal.",
                    s[f"spec_decode_num_accepted_tokens_pos{pos}"],
                    m,
                    position=str(pos),
                )
                pos += 1
            if "spec_draft_blocks_total" in s:  # a draft model's own KV pool
                total, free = s["spec_draft_blocks_total"], s["spec_draft_blocks_free"]
                doc = "The draft model's KV cache blocks (speculative decoding)."
                add("pippin_spec_draft_kv_blocks", doc, total - free, m, state="used")
                add("pippin_spec_draft_kv_blocks", doc, free, m, state="free")
                add(
                    "pippin_spec_draft_evictions",
                    "Sequences whose draft KV was dropped for lack of draft blocks.",
                    s["spec_draft_evictions"],
                    m,
                )
        yield from fams.values()
        yield from _vllm_gauges(per_model)


def _vllm_gauges(per_model: list[tuple[str, dict[str, int]]]) -> Iterator[Metric]:
    """The engine gauges under vLLM's names and `model_name` label, which routers built
    for vLLM read to balance load (vLLM production-stack's router, llm-d, KServe):
    requests running and waiting, KV cache usage (both its v0 and v1 names) and the
    prefix cache's hit rate. The same values as the `pippin_*` gauges above."""
    specs = [
        ("vllm:num_requests_running", "Requests running (sequences in the batch).", "running"),
        ("vllm:num_requests_waiting", "Requests waiting to be admitted.", "waiting"),
        ("vllm:kv_cache_usage_perc", "KV cache usage (1 means 100 percent).", "usage"),
        ("vllm:gpu_cache_usage_perc", "KV cache usage (vLLM v0's name).", "usage"),
        ("vllm:gpu_prefix_cache_hit_rate", "Prefix cache hit rate since start.", "hits"),
    ]
    for name, doc, key in specs:
        fam = GaugeMetricFamily(name, doc, labels=("model_name",))
        for m, s in per_model:
            total, free, queries = s["blocks_total"], s["blocks_free"], s["prefix_queries"]
            value = {
                "running": s["running"],
                "waiting": s["waiting"],
                "usage": (total - free) / total if total else 0.0,
                "hits": s["prefix_hits"] / queries if queries else 0.0,
            }[key]
            fam.add_metric((m,), value)
        yield fam
