"""Engine settings (filled from the CLI)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from pippin.kernels.config import KernelConfig

# --distributed-backend: mx.distributed's backends, as `mlx.launch` names them.
BACKENDS = ("auto", "ring", "nccl", "jaccl", "jaccl-ring", "any")

# How long rank 0 waits for a model call another rank started and has not finished
# before it takes the group for dead (a collective can block forever, NCCL's above all).
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TPConfig:
    """Tensor-parallel settings (`pippin serve --tensor-parallel N`, `--hostfile`)."""

    size: int
    # auto: the hostfile's backend, else NCCL on NVIDIA GPUs and ring elsewhere
    # (as `mlx.launch` picks).
    backend: str = "auto"
    # mlx.launch's JSON hostfile ({"hosts": [{"ssh": ..., "ips": [...]}, ...]}); None: every
    # rank on this host.
    hostfile: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    # First port of the ring's (or NCCL's, JACCL's coordinator) and the plan channel's
    # listeners; 0: free ports picked on this host (one host only).
    port: int = 0

    def resolved_backend(self, hostfile_backend: str = "") -> str:
        if self.backend != "auto":
            return self.backend
        if hostfile_backend:
            return hostfile_backend
        import mlx.core as mx

        return "nccl" if mx.cuda.is_available() else "ring"


# --scheduling-policy: vLLM's two (`pippin.engine.scheduler`).
SCHEDULING_POLICIES = ("fcfs", "priority")

# The proposal methods of vLLM's `--speculative-config` that pippin runs; "mtp": the
# checkpoint's own multi-token-prediction layers (`pippin.engine.mtp`).
SPEC_METHODS = ("ngram", "draft_model", "mtp")
# vLLM's older spellings.
SPEC_ALIASES = {"[ngram]": "ngram", "qwen3_next_mtp": "mtp", "deepseek_mtp": "mtp"}
# The most tokens one proposal may hold: each costs a verified position per sequence (and
# with a draft model, one call of it), and acceptance decays along a proposal.
MAX_SPEC_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` keys that pippin reads (`pippin.engine.speculative`)."""

    method: str = "ngram"
    # draft_model: the draft's path or Hub id, loaded as the served model is
    # (`pippin.engine.draft_model`); it must share the target's vocabulary.
    model: str | None = None
    num_speculative_tokens: int = 4
    # Lookup tries the longest suffix first, from prompt_lookup_max tokens down to min.
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # A step speculates only while at most this many sequences run.
    disable_by_batch_size: int = 8

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """From the JSON of `--speculative-config`; ValueError says what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        method = raw.get("method")
        if isinstance(method, str) and method in SPEC_ALIASES:
            raw["method"] = SPEC_ALIASES[method]
        if "method" not in raw and raw.get("model") is not None:
            raw["method"] = "draft_model"  # as vLLM infers it from `model`
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}"
            )
        cfg = cls(**raw)
        if cfg.method not in SPEC_METHODS:
            raise ValueError(
                f"--speculative-config: method {cfg.method!r} is not supported; "
                f"choose one of {list(SPEC_METHODS)}"
            )
        if cfg.method == "draft_model":
            if not isinstance(cfg.model, str) or not cfg.model:
                raise ValueError(
                    "--speculative-config: method 'draft_model' needs \"model\": the draft "
                    "model's path or Hub id"
                )
        elif cfg.model is not None:
            raise ValueError(
                f"--speculative-config: \"model\" is for method 'draft_model', not {cfg.method!r}"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"--speculative-config: {name} must be an integer >= 1")
        if cfg.num_speculative_tokens > MAX_SPEC_TOKENS:
            raise ValueError(
                f"--speculative-config: num_speculative_tokens must be <= {MAX_SPEC_TOKENS}"
            )
        if cfg.prompt_lookup_min > cfg.prompt_lookup_max:
            raise ValueError("--speculative-config: prompt_lookup_min > prompt_lookup_max")
        if not isinstance(cfg.disable_by_batch_size, int) or cfg.disable_by_batch_size < 1:
            raise ValueError("--speculative-config: disable_by_batch_size must be >= 1")
        return cfg


@dataclass
class EngineConfig:
    max_num_seqs: int = 256
    # Context limit; None means the model's own (max_position_embeddings).
    max_model_len: int | None = None
    # Tokens one scheduler step may process (prefill chunks plus decodes).
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    # Explicit KV block count; when None, derived from cache_memory_percent.
    num_blocks: int | None = None
    # Share of the machine's memory given to the KV pool.
    cache_memory_percent: float = 0.1
    # Explicit KV pool size in bytes; overrides cache_memory_percent.
    cache_memory_bytes: int | None = None
    # Most memory MLX may keep in its cache of freed buffers (None: the KV pool's size, at
    # least MIN_BUFFER_CACHE). Its own limit is the device's memory: with batch shapes
    # changing every step the cache only grows, and on a GPU shared with another process
    # that ran it out of memory (docs/benchmarks.md).
    buffer_cache_bytes: int | None = None
    enable_prefix_caching: bool = True
    # Models with recurrent layers: the share of the KV cache budget their prefix cache's
    # state snapshots may hold, and how many blocks of a long prompt lie between two
    # (0: only at prompt ends and finished generations; None: `snapshot_interval`'s
    # choice for the model); `pippin.engine.state_snapshots`.
    snapshot_memory_share: float = 0.25
    snapshot_interval_blocks: int | None = None
    # Server cap on max_tokens per request (None: up to the context).
    max_tokens_cap: int | None = None
    # Quantised KV: 4 or 8 bits per element (None: the model's dtype), in groups of
    # kv_group_size elements sharing a scale and bias.
    kv_bits: int | None = None
    kv_group_size: int = 64
    # SSD tier of the prefix cache (None: off), its size cap, and the most memory the
    # queue of blocks waiting to be written may hold.
    ssd_cache_dir: str | None = None
    ssd_cache_max_gb: float = 20.0
    ssd_write_queue_mb: int = 256
    # Least time between two deliveries of one request's new tokens to the HTTP side
    # (None: 0 while fewer than STREAM_BATCH sequences run, STREAM_INTERVAL_S above).
    # Every delivery is a chunk framed and sent by the event loop, which shares the GIL
    # with the engine thread: under a large batch, sending each token alone would slow
    # every step. A request's first tokens and its end are never held back.
    stream_interval_s: float | None = None
    # --request-timeout: a request still running (queued or generating) this long after
    # it was submitted is ended with an error and its blocks freed (None: no limit).
    request_timeout_s: float | None = None
    # --scheduling-policy: "fcfs" (arrival order) or "priority" (`SamplingParams.priority`
    # orders the queues and lets urgent requests preempt others; `pippin.engine.scheduler`).
    scheduling_policy: str = "fcfs"
    # Speculative decoding (--speculative-config; None: off).
    speculative: SpeculativeConfig | None = None
    # The kernels and pippin's changes to mlx-lm's model code (`pippin.kernels.patches`);
    # its switches are read from the environment once, here.
    kernels: KernelConfig = field(default_factory=KernelConfig.from_env)
    # --tensor-parallel: the model over several ranks (`pippin.engine.tp`); None: one device.
    tensor_parallel: TPConfig | None = None
    # The model runner's class, given the `ModelRunner` arguments (None: `ModelRunner`);
    # rank 0 of a tensor-parallel group sets its own in its process.
    make_runner: Callable[..., Any] | None = None


MIN_BUFFER_CACHE = 1 << 30

# The automatic stream interval: about two decode steps of a large GPU batch.
STREAM_BATCH = 64
STREAM_INTERVAL_S = 0.02
# Tokens one step may process when not set: larger on CUDA, where a 8192-token step
# takes a few milliseconds and the prompts of a burst of requests are read sooner.
BATCHED_TOKENS_CUDA = 8192


def default_batched_tokens() -> int:
    from pippin.kernels.device import on_cuda

    return BATCHED_TOKENS_CUDA if on_cuda() else EngineConfig.max_num_batched_tokens


def default_engine_process() -> bool:
    """Whether `pippin serve` runs the engine in a process of its own when not told. On
    CUDA a step's host work is most of its time, and the HTTP side's Python, sharing the
    GIL, delays it: 256 streams on an H200 ran at 12.6k output tok/s in an engine
    process against 9.0k in one process (docs/benchmarks.md)."""
    from pippin.kernels.device import on_cuda

    return on_cuda()
