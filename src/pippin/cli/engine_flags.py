"""`pippin serve`'s engine flags (batching, KV pool, prefix cache, speculative decoding),
tensor parallel and the prefix cache tiers, and the `EngineConfig` they give."""

from __future__ import annotations

import argparse
from dataclasses import replace

from pippin.argtypes import non_negative_int, positive_float, positive_int
from pippin.engine.config import BACKENDS as TP_BACKENDS
from pippin.engine.config import (
    BATCHED_TOKENS_CUDA,
    SCHEDULING_POLICIES,
    STREAM_BATCH,
    STREAM_INTERVAL_S,
    EngineConfig,
    SpeculativeConfig,
    TPConfig,
    default_batched_tokens,
    default_engine_process,
)
from pippin.engine.config import DEFAULT_TIMEOUT_S as TP_TIMEOUT_S
from pippin.kernels.config import KernelConfig


def _tensor_parallel(args: argparse.Namespace) -> TPConfig | None:
    """--tensor-parallel / --hostfile into a `TPConfig` (None: one device)."""
    size = args.tensor_parallel
    if args.hostfile is not None:
        from pippin.engine.tp.launch import read_hosts

        try:
            hosts, _, _ = read_hosts(TPConfig(size or 1, hostfile=args.hostfile))
        except ValueError as e:
            raise SystemExit(f"pippin serve: {e}") from None
        if size is not None and size != len(hosts):
            raise SystemExit(
                f"pippin serve: --tensor-parallel {size}, but the hostfile lists {len(hosts)} hosts"
            )
        size = len(hosts)
    if size is None or size == 1:
        return None
    if args.ssd_cache_dir:
        raise SystemExit("pippin serve: --ssd-cache-dir does not run with --tensor-parallel yet")
    if args.speculative_config is not None:
        raise SystemExit(
            "pippin serve: --speculative-config does not run with --tensor-parallel yet"
        )
    if args.engine_process is False:
        raise SystemExit(
            "pippin serve: --tensor-parallel runs rank 0's engine in a process of its own; "
            "drop --no-engine-process"
        )
    return TPConfig(
        size,
        backend=args.distributed_backend,
        hostfile=args.hostfile,
        timeout_s=args.tp_timeout,
        port=args.tp_port,
    )


def _speculative_config(text: str) -> SpeculativeConfig:
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config: ")) from None


def _check_draft_model(spec: SpeculativeConfig | None) -> None:
    """A draft model that cannot be found stops `pippin serve` before anything loads (the
    engine loads it, and checks its vocabulary against the target's)."""
    if spec is None or spec.model is None:
        return
    from pippin.store.loader import ModelLoadError, resolve_spec

    try:
        resolve_spec(spec.model, None)
    except ModelLoadError as e:
        raise SystemExit(f"pippin serve: --speculative-config: draft model {e}") from None


def _memory_share(text: str) -> float:
    """A fraction (0.2) or a percentage (20): vllm-mlx passes fractions under this name."""
    value = float(text)
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] or (1, 100], got {value}")
    return value if value <= 1 else value / 100


def _snapshot_share(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    e = p.add_argument_group("engine")
    e.add_argument(
        "--max-num-seqs",
        type=positive_int,
        default=EngineConfig.max_num_seqs,
        help="most sequences decoded together in one batch (default: %(default)s)",
    )
    e.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=EngineConfig.scheduling_policy,
        help="the order requests are served in: fcfs (first come, first served; a request "
        "with a non-zero 'priority' gets 400) or priority (by each request's 'priority', "
        "lower first, then arrival; a waiting request that finds no KV blocks or batch "
        "slot preempts running ones of a larger value, which resume where they were) "
        "(vLLM's flag) (default: %(default)s)",
    )
    e.add_argument(
        "--max-model-len",
        "--max-kv-size",
        dest="max_model_len",
        type=positive_int,
        help="context limit in tokens (prompt + completion); default: the model's own. "
        "Alias: vllm-mlx's --max-kv-size, which bounds a sequence's KV by forgetting its "
        "oldest tokens; pippin keeps every token: a request that would not fit is refused "
        "(OpenAI, Ollama) or stops where the context ends (Anthropic's "
        "model_context_window_exceeded)",
    )
    e.add_argument(
        "--max-tokens",
        "--max-request-tokens",
        dest="max_tokens",
        type=positive_int,
        help="most completion tokens a request may ask for (larger max_tokens get 400); also "
        "caps the default, which is the rest of the context (alias: vllm-mlx's "
        "--max-request-tokens)",
    )
    e.add_argument(
        "--prefill-step-size",
        "--max-num-batched-tokens",
        "--chunked-prefill-tokens",
        dest="prefill_step_size",
        type=non_negative_int,
        default=0,
        help="tokens one scheduler step may process (prefill chunks plus decodes); long "
        "prompts are prefilled in chunks of this size so running decodes never stall for "
        "long (aliases: vLLM's --max-num-batched-tokens, vllm-mlx's --chunked-prefill-tokens, "
        f"where 0 means the default) (default: {EngineConfig.max_num_batched_tokens}; "
        f"{BATCHED_TOKENS_CUDA} on NVIDIA GPUs)",
    )
    e.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run the engine (model, scheduler, detokenizing) in a process of its own, so "
        "that the HTTP side's Python work does not take the GIL from it between steps "
        "(default: on for NVIDIA GPUs, where it serves 256 streams 1.4x faster; off "
        "elsewhere)",
    )
    e.add_argument(
        "--stream-interval-ms",
        type=float,
        default=None,
        help="least time between two streamed chunks of one request; tokens produced "
        "meanwhile go out together (first tokens and the end are never held back). "
        f"Default: 0 while fewer than {STREAM_BATCH} sequences run, "
        f"{STREAM_INTERVAL_S * 1000:.0f} ms above, where sending every token alone would "
        "slow the whole batch",
    )
    e.add_argument(
        "--cache-memory-percent",
        type=_memory_share,
        default=EngineConfig.cache_memory_percent,
        help="share of the machine's memory given to the KV block pool, as a fraction (0.2) "
        "or a percentage (20) (default: %(default)s)",
    )
    e.add_argument(
        "--cache-memory-mb",
        type=positive_int,
        help="KV block pool size in MiB, overriding --cache-memory-percent (as vllm-mlx's "
        "flag of that name)",
    )
    e.add_argument(
        "--no-kernels",
        dest="kernels",
        action="store_false",
        help="run mlx-lm's model code exactly as it ships: no custom CUDA kernel, no fused "
        "projection, no change to its modules (slower on GPUs; for comparing or debugging)",
    )
    e.add_argument(
        "--buffer-cache-mb",
        type=positive_int,
        help="most memory MLX keeps in its cache of freed buffers, in MiB (default: the KV "
        "pool's size, at least 1 GiB)",
    )
    e.add_argument(
        "--num-kv-blocks",
        "--max-cache-blocks",
        "--num-gpu-blocks-override",
        dest="num_kv_blocks",
        type=positive_int,
        help="exact number of KV blocks, overriding --cache-memory-percent (aliases: "
        "vllm-mlx's --max-cache-blocks, vLLM's --num-gpu-blocks-override)",
    )
    e.add_argument(
        "--block-size",
        "--paged-cache-block-size",
        dest="block_size",
        type=positive_int,
        default=EngineConfig.block_size,
        help="tokens per KV block, the unit of prefix sharing (alias: vllm-mlx's "
        "--paged-cache-block-size) (default: %(default)s)",
    )
    e.add_argument(
        "--enable-prefix-caching",
        "--enable-prefix-cache",
        dest="prefix_caching",
        action="store_true",
        default=True,
        help="reuse the KV blocks of earlier prompts with the same prefix (on by default; "
        "vllm-mlx spelling accepted)",
    )
    e.add_argument(
        "--no-enable-prefix-caching",
        "--disable-prefix-cache",
        dest="prefix_caching",
        action="store_false",
        help="turn the prefix cache off (vLLM and vllm-mlx spellings)",
    )
    e.add_argument(
        "--snapshot-interval",
        dest="snapshot_interval",
        type=non_negative_int,
        default=EngineConfig.snapshot_interval_blocks,
        help="models with recurrent layers (Qwen3.5, Qwen3-Next, Nemotron-H, Mamba): keep "
        "a snapshot of the recurrent state every this many KV blocks of a long prompt, so "
        "prompts sharing only a prefix resume from it; 0: only at prompt ends and "
        "finished answers (default: as many blocks as make a snapshot cost at most a "
        "quarter of the KV memory of the tokens it covers)",
    )
    e.add_argument(
        "--snapshot-memory-share",
        type=_snapshot_share,
        default=EngineConfig.snapshot_memory_share,
        help="models with recurrent layers: the share of the KV cache memory their "
        "recurrent-state snapshots may take (default: %(default)s)",
    )
    e.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8),
        help="store the KV cache quantised to this many bits (mx.quantize, affine, with "
        "attention over the quantised keys and values): 8 bits fits about 1.9x the tokens "
        "of bfloat16 KV, 4 bits about 3.6x; default: the model's dtype",
    )
    e.add_argument(
        "--kv-group-size",
        type=int,
        choices=(32, 64, 128),
        default=EngineConfig.kv_group_size,
        help="elements sharing one scale and bias in quantised KV; must divide the head "
        "dimension (default: %(default)s)",
    )
    e.add_argument(
        "--speculative-config",
        metavar="JSON",
        type=_speculative_config,
        help="speculative decoding, as vLLM's flag: prompt lookup (n-gram), e.g. "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        '"prompt_lookup_min": 2, "disable_by_batch_size": 8}\' (those are the defaults), '
        "or a draft model sharing the target's tokenizer, e.g. '{\"model\": PATH_OR_HUB_ID, "
        '"num_speculative_tokens": 4}\' (method "draft_model"), or the checkpoint\'s own '
        'multi-token-prediction layers, \'{"method": "mtp", "num_speculative_tokens": 2}\' '
        "(Qwen3-Next / Qwen3.5 mtp.*, DeepSeek-V3 style; the original Hugging Face "
        "checkpoint: mlx-lm conversions drop them); "
        "a step speculates only while at most disable_by_batch_size sequences run; "
        "requests with a seed, a response format or a reasoning budget never do; "
        "default: off",
    )
    e.add_argument(
        "--continuous-batching",
        action="store_true",
        help="accepted for vllm-mlx compatibility; pippin always batches continuously",
    )
    e.add_argument(
        "--use-paged-cache",
        action="store_true",
        help="accepted for vllm-mlx compatibility; pippin's KV cache is always paged",
    )

    tp = p.add_argument_group(
        "tensor parallel (docs/deployment.md)",
        "one model over several GPUs or hosts on MLX's distributed layer; rank 0 runs "
        "the scheduler and speaks HTTP",
    )
    tp.add_argument(
        "--tensor-parallel",
        "--tensor-parallel-size",
        "-tp",
        dest="tensor_parallel",
        type=positive_int,
        default=None,
        metavar="N",
        help="shard the model over N ranks as mlx-lm shards it (the families with "
        "mlx-lm's shard(): Llama, Qwen2, Qwen3, Qwen3-MoE, DeepSeek V2/V3, GLM-4 MoE, "
        "gpt-oss, MiniMax, ...; others are refused); every rank on this host unless "
        "--hostfile (default: 1, no sharding)",
    )
    tp.add_argument(
        "--hostfile",
        metavar="FILE",
        help="mlx.launch's JSON hostfile: one rank per host entry, started over ssh "
        "(rank 0 is this process's host, listed first); its backend and envs are used",
    )
    tp.add_argument(
        "--distributed-backend",
        choices=TP_BACKENDS,
        default="auto",
        help="mx.distributed's backend: ring (TCP, anywhere), nccl (NVIDIA GPUs), "
        "jaccl / jaccl-ring (Macs over Thunderbolt RDMA), any (MLX picks). auto: the "
        "hostfile's, else nccl on NVIDIA GPUs and ring elsewhere (default: auto)",
    )
    tp.add_argument(
        "--tp-timeout",
        type=positive_float,
        default=TP_TIMEOUT_S,
        metavar="SECONDS",
        help="a model call another rank has not finished after this long takes the "
        "group for dead: requests in flight end with an error, /health is 503 and the "
        "group is started again (default: %(default)s)",
    )
    tp.add_argument(
        "--tp-port",
        type=positive_int,
        default=0,
        metavar="PORT",
        help="first of the ports (PORT .. PORT+N) the ranks listen on; needed with several "
        "hosts (default: free ports of this host)",
    )

    c = p.add_argument_group(
        "prefix cache tiers",
        "under the in-memory prefix cache: an SSD tier that keeps evicted blocks across "
        "evictions and restarts, and prompts cached at start-up",
    )
    c.add_argument(
        "--ssd-cache-dir",
        metavar="DIR",
        help="spill KV blocks evicted from memory to files in DIR (with an SQLite index) "
        "and read them back when a prompt starts with them, also after a restart; "
        "cached blocks still in memory are written at shutdown. Blocks of another model, "
        "dtype or KV layout are never read. Default: off",
    )
    c.add_argument(
        "--ssd-cache-max-gb",
        type=positive_float,
        metavar="GB",
        default=EngineConfig.ssd_cache_max_gb,
        help="size cap of the SSD tier in GiB; least recently used blocks are deleted "
        "beyond it (default: %(default)s)",
    )
    c.add_argument(
        "--warm-prompts",
        metavar="FILE",
        help="a JSON list of prompts to prefill at start-up, before /health turns ready: "
        "texts (as completions prompts), chat request bodies (objects with 'messages', "
        "'tools', ...) or completions bodies (objects with 'prompt')",
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine, tensor parallel and cache tier flags, with --max-tokens and
    --request-timeout; a --speculative-config draft model that cannot be found stops here."""
    from pippin.serving.settings import MIB

    _check_draft_model(args.speculative_config)
    return EngineConfig(
        max_num_seqs=args.max_num_seqs,
        scheduling_policy=args.scheduling_policy,
        max_model_len=args.max_model_len,
        # 0 is vllm-mlx's "chunked prefill off"; pippin always chunks, at the default size.
        max_num_batched_tokens=args.prefill_step_size or default_batched_tokens(),
        block_size=args.block_size,
        num_blocks=args.num_kv_blocks,
        cache_memory_percent=args.cache_memory_percent,
        cache_memory_bytes=args.cache_memory_mb * MIB if args.cache_memory_mb else None,
        buffer_cache_bytes=args.buffer_cache_mb * MIB if args.buffer_cache_mb else None,
        enable_prefix_caching=args.prefix_caching,
        snapshot_interval_blocks=args.snapshot_interval,
        snapshot_memory_share=args.snapshot_memory_share,
        max_tokens_cap=args.max_tokens,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        speculative=args.speculative_config,
        ssd_cache_dir=args.ssd_cache_dir,
        ssd_cache_max_gb=args.ssd_cache_max_gb,
        stream_interval_s=None
        if args.stream_interval_ms is None
        else args.stream_interval_ms / 1000,
        kernels=replace(KernelConfig.from_env(), enabled=args.kernels),
        request_timeout_s=args.request_timeout,
        tensor_parallel=_tensor_parallel(args),
    )


def engine_process(args: argparse.Namespace) -> bool:
    """--engine-process / --no-engine-process, else the platform's default."""
    return default_engine_process() if args.engine_process is None else args.engine_process
