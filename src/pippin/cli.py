"""Command line: ``pippin serve [MODEL]``, ``pippin bench`` and ``pippin --version``.

Flag names follow pippin's own vocabulary; the names vLLM and vllm-mlx use for the
same settings are accepted as aliases so existing launch scripts keep working. Flags
whose meaning differs in those servers are not aliased.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pippin import __version__, envs
from pippin.argtypes import json_object as _json_object
from pippin.argtypes import non_negative_float as _non_negative_float
from pippin.argtypes import non_negative_int as _non_negative_int
from pippin.argtypes import positive_float as _positive_float
from pippin.argtypes import positive_int as _positive_int
from pippin.audio.config import SttSettings
from pippin.bench.cli import add_bench_args, add_bench_serve_args
from pippin.embed.config import EmbedSettings
from pippin.engine.config import BACKENDS as TP_BACKENDS
from pippin.engine.config import (
    BATCHED_TOKENS_CUDA,
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
from pippin.mcp.config import McpConfigError, McpSettings, load_config
from pippin.obs.logs import LOG_FORMATS
from pippin.vision.media import add_media_flags, limits_from_args

log = logging.getLogger("pippin.cli")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DTYPES = ("auto", "float32", "float16", "bfloat16")


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


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


def _memory_share(text: str) -> float:
    """A fraction (0.2) or a percentage (20): vllm-mlx passes fractions under this name."""
    value = float(text)
    if not 0 < value <= 100:
        raise argparse.ArgumentTypeError(f"must be in (0, 1] or (1, 100], got {value}")
    return value if value <= 1 else value / 100


def _name_list(text: str) -> list[str]:
    """A JSON list of strings, as vLLM takes them ('["https://a.example"]'), or a,b,c."""
    if not text.lstrip().startswith("["):
        return [t.strip() for t in text.split(",") if t.strip()]
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError("must be a JSON list of strings")
    return value


def _matryoshka(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "any":
        return ()
    try:
        dims = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError("must be 'any' or a comma-separated list") from None
    if not dims or dims[0] < 1:
        raise argparse.ArgumentTypeError("widths must be positive integers")
    return dims


class _StoreOnce(argparse._StoreAction):
    """A flag that sets one value: argparse would keep the last of several silently
    (`--model A --model B` served only B), so a second one is an error."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        if option_string is not None:
            given: dict[str, str] = getattr(namespace, "_given_flags", {})
            first = given.get(self.dest)
            if first is not None:
                said = f"{first} given more than once: it takes one value"
                if first != option_string:
                    said = f"{first} and {option_string} set the same value: give one, once"
                if self.dest in ("embedding_model", "rerank_model"):
                    said += "; serving several models is not supported yet"
                parser.error(said)
            given[self.dest] = option_string
            namespace._given_flags = given
        super().__call__(parser, namespace, values, option_string)


def _add_embed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "embedding and reranking",
        "optional models served beside the chat model on /v1/embeddings and /v1/rerank",
    )
    g.add_argument(
        "--embedding-model",
        metavar="MODEL",
        help="embedding model for /v1/embeddings: a folder or Hub id of a BERT-family "
        "encoder (BERT, RoBERTa, XLM-RoBERTa) or an mlx-lm decoder (e.g. Qwen3-Embedding); "
        "pooling and normalisation come from its sentence-transformers files",
    )
    g.add_argument(
        "--embedding-served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) of the embedding model in the 'model' field; default: its folder name",
    )
    g.add_argument(
        "--rerank-model",
        metavar="MODEL",
        help="rerank model for /v1/rerank, /v2/rerank and /rerank: a BERT or XLM-RoBERTa "
        "cross-encoder (*ForSequenceClassification, one label) or a Qwen3-Reranker-style "
        "decoder (scored by its 'yes'/'no' logits)",
    )
    g.add_argument(
        "--rerank-served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) of the rerank model in the 'model' field; default: its folder name",
    )
    g.add_argument(
        "--auto-truncate",
        action="store_true",
        help="cut embedding and rerank inputs longer than the model takes (as "
        "sentence-transformers does); without it they are refused with a 400",
    )
    g.add_argument(
        "--matryoshka-dimensions",
        type=_matryoshka,
        metavar="DIMS",
        help="widths the embedding model may be shortened to with 'dimensions': 'any' or "
        "a list like 64,128,256; default: config.json's matryoshka_dimensions or "
        "is_matryoshka, else 'dimensions' is refused",
    )
    g.add_argument(
        "--embedding-batch-tokens",
        type=_positive_int,
        metavar="N",
        default=EmbedSettings.max_batch_tokens,
        help="padded tokens in one embedding/rerank forward pass; bounds how long one "
        "pass holds the device (default: %(default)s)",
    )
    g.add_argument(
        "--embedding-batch-size",
        type=_positive_int,
        metavar="N",
        default=EmbedSettings.max_batch_size,
        help="most inputs in one embedding/rerank forward pass (default: %(default)s)",
    )


def _add_tts_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "text to speech",
        "an optional model served on /v1/audio/speech (pip install 'pippin[audio]')",
    )
    g.add_argument(
        "--tts-model",
        metavar="PATH",
        help="text-to-speech model for /v1/audio/speech: a local folder mlx-audio loads "
        "(Kokoro, KittenTTS, ...: config.json, safetensors weights, and its voices)",
    )
    g.add_argument(
        "--tts-served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) of the TTS model in the 'model' field; default: its folder name",
    )


def _add_stt_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "speech to text",
        "a Whisper model on /v1/audio/transcriptions and /v1/audio/translations "
        "(needs the 'audio' extra: pip install 'pippin[audio]')",
    )
    g.add_argument(
        "--stt-model",
        metavar="PATH",
        help="Whisper model folder: MLX layout (config.json + safetensors, as mlx-community "
        "publishes) or CTranslate2 (model.bin, as faster-whisper uses; converted once into "
        "the cache folder)",
    )
    g.add_argument(
        "--stt-served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) of the Whisper model in the 'model' field; default: its folder name "
        "and whisper-1",
    )
    g.add_argument(
        "--stt-max-mb",
        type=_positive_float,
        metavar="MB",
        default=SttSettings.max_bytes / (1024 * 1024),
        help="largest audio upload in MiB (default: %(default)g, OpenAI's 25 MB)",
    )
    g.add_argument(
        "--stt-max-seconds",
        type=_positive_float,
        metavar="S",
        default=SttSettings.max_seconds,
        help="longest audio accepted, in seconds (default: %(default)g)",
    )


def _add_admission_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("admission, limits and stopping (docs/reliability.md)")
    a.add_argument(
        "--max-queue",
        type=_positive_int,
        help="most generation requests held waiting for the engine; beyond it new ones get "
        "429 (Anthropic: 529 overloaded_error) with Retry-After (default: no limit)",
    )
    a.add_argument(
        "--api-keys",
        metavar="FILE",
        help="a JSON or YAML list of API keys, each {key, name, requests_per_minute, "
        "concurrent_requests, tokens_per_minute} (limits optional), accepted beside "
        "--api-key; over a limit: 429 with Retry-After. Each key has its own prefix cache",
    )
    a.add_argument(
        "--request-timeout",
        type=_positive_float,
        metavar="SECONDS",
        help="end a request still queued or generating this long after it arrived, with the "
        "API's error (in a stream: an error event); its KV blocks are freed (default: none)",
    )
    a.add_argument(
        "--drain-timeout",
        type=_non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may take to finish while new ones get "
        "503; then they end with an error (default: %(default)s)",
    )


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="model to serve: a local folder (MLX or Hugging Face safetensors), a GGUF file, "
        "or a Hugging Face Hub id; default: the bundled SmolLM2-135M-Instruct",
    )
    m.add_argument(
        "--model",
        dest="model_flag",
        metavar="MODEL",
        action="append",
        help="the same as the positional MODEL (vLLM spelling); repeat it to serve several "
        "models: the first is loaded at start-up and is the 'default' model, the others "
        "load on their first request (see --idle-ttl, --memory-budget)",
    )
    m.add_argument(
        "--models",
        metavar="FILE",
        help="a YAML file of the chat models to serve, each with its path or Hub id, names "
        "and aliases, parsers, chat template, sampling defaults, context length, pinned or "
        "on demand, idle TTL (see docs/architecture.md#several-models); instead of MODEL",
    )
    m.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) clients use in the 'model' field; default: the model's own name. The "
        "path or Hub id as given, its basename and 'default' are accepted too. With several "
        "--model, names the first",
    )
    m.add_argument(
        "--model-alias",
        metavar="PATTERN=MODEL",
        action="append",
        default=[],
        help="send requests whose model name matches the shell-style PATTERN to MODEL (a "
        "served name), e.g. 'gpt-*=coder'; repeatable. claude* goes to the default model "
        "unless a pattern says otherwise",
    )
    m.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="most memory the loaded chat models may take together (weights and KV pools), "
        "e.g. 16GB: loading one past it unloads the least recently used idle on-demand "
        "models. Default: no budget",
    )
    m.add_argument(
        "--idle-ttl",
        type=_positive_float,
        metavar="SECONDS",
        help="unload an on-demand model after this long without requests (default: never; "
        "--models entries may set their own idle_ttl)",
    )
    m.add_argument(
        "--model-load-timeout",
        type=_positive_float,
        metavar="SECONDS",
        default=300.0,
        help="how long a request waits for its model to load before a 503 with Retry-After "
        "(the load goes on) (default: %(default)s)",
    )
    m.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="dtype of the weights that are not quantised; auto keeps the checkpoint's",
    )
    m.add_argument("--revision", help="branch, tag or commit to download for a Hub id")
    m.add_argument(
        "--offline",
        action="store_true",
        help="never contact the Hugging Face Hub: Hub ids must already be in the local cache "
        "(sets HF_HUB_OFFLINE=1, as vllm-mlx's flag of that name)",
    )
    m.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model's own Python code to run while loading (off by default)",
    )

    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    s.add_argument("--port", type=_port, default=8000, help="port to bind (default: %(default)s)")
    s.add_argument(
        "--api-key",
        default=envs.PIPPIN_API_KEY,
        help="require this key on every route but /health, as 'Authorization: Bearer KEY' or "
        "'x-api-key: KEY' (default: $PIPPIN_API_KEY; unset means no key is needed)",
    )
    s.add_argument(
        "--max-request-body-mb",
        type=_positive_float,
        default=16.0,
        help="largest request body accepted, in MiB; larger ones get 413 (default: %(default)s)",
    )
    s.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default="info",
        help="log level; prompts, keys and file paths are logged only at debug "
        "(default: %(default)s)",
    )
    s.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text: one readable line per event; json: one JSON object per line. Either way "
        "each API request gets one line with its id, endpoint, status, token counts and "
        "timings (default: %(default)s)",
    )
    s.add_argument(
        "--log-prompts",
        action="store_true",
        help="log the first 16 KiB of each request's and response's body (prompts and "
        "outputs) in its request line; never logged otherwise, at any level",
    )
    s.add_argument(
        "--allowed-origins",
        type=_name_list,
        default=[],
        help="origins whose browser pages may call the API (CORS), as a JSON list or "
        "comma-separated, '*' for any; CORS is off by default",
    )
    s.add_argument(
        "--allowed-methods",
        type=_name_list,
        default=["*"],
        help="HTTP methods allowed cross-origin (default: any)",
    )
    s.add_argument(
        "--allowed-headers",
        type=_name_list,
        default=["*"],
        help="request headers allowed cross-origin (default: any)",
    )
    s.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let cross-origin requests carry cookies and HTTP authentication",
    )
    s.add_argument(
        "--metrics",
        "--enable-metrics",
        dest="metrics_flag",
        action="store_true",
        help="accepted for vllm-mlx compatibility: metrics are served on /metrics by default",
    )
    s.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="do not serve Prometheus metrics on /metrics (served by default, behind "
        "--api-key like every route)",
    )

    e = p.add_argument_group("engine")
    e.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=EngineConfig.max_num_seqs,
        help="most sequences decoded together in one batch (default: %(default)s)",
    )
    e.add_argument(
        "--max-model-len",
        "--max-kv-size",
        dest="max_model_len",
        type=_positive_int,
        help="context limit in tokens (prompt + completion); default: the model's own. "
        "Alias: vllm-mlx's --max-kv-size, which bounds a sequence's KV by forgetting its "
        "oldest tokens; pippin keeps every token and refuses a request that would not fit",
    )
    e.add_argument(
        "--max-tokens",
        "--max-request-tokens",
        dest="max_tokens",
        type=_positive_int,
        help="most completion tokens a request may ask for (larger max_tokens get 400); also "
        "caps the default, which is the rest of the context (alias: vllm-mlx's "
        "--max-request-tokens)",
    )
    e.add_argument(
        "--prefill-step-size",
        "--max-num-batched-tokens",
        "--chunked-prefill-tokens",
        dest="prefill_step_size",
        type=_non_negative_int,
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
        type=_positive_int,
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
        type=_positive_int,
        help="most memory MLX keeps in its cache of freed buffers, in MiB (default: the KV "
        "pool's size, at least 1 GiB)",
    )
    e.add_argument(
        "--num-kv-blocks",
        "--max-cache-blocks",
        "--num-gpu-blocks-override",
        dest="num_kv_blocks",
        type=_positive_int,
        help="exact number of KV blocks, overriding --cache-memory-percent (aliases: "
        "vllm-mlx's --max-cache-blocks, vLLM's --num-gpu-blocks-override)",
    )
    e.add_argument(
        "--block-size",
        "--paged-cache-block-size",
        dest="block_size",
        type=_positive_int,
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
        '"num_speculative_tokens": 4}\' (method "draft_model"); '
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
        type=_positive_int,
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
        type=_positive_float,
        default=TP_TIMEOUT_S,
        metavar="SECONDS",
        help="a model call another rank has not finished after this long takes the "
        "group for dead: requests in flight end with an error, /health is 503 and the "
        "group is started again (default: %(default)s)",
    )
    tp.add_argument(
        "--tp-port",
        type=_positive_int,
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
        type=_positive_float,
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

    t = p.add_argument_group(
        "MCP tools",
        "tools of Model Context Protocol servers, run by pippin for the model (see "
        "docs/api-compatibility.md: Responses 'mcp' tools, Anthropic mcp_servers, chat "
        "'mcp' tools)",
    )
    t.add_argument(
        "--mcp-config",
        metavar="FILE",
        help="the MCP servers pippin starts (stdio) or connects to (streamable HTTP, SSE): "
        "Claude Desktop's {\"mcpServers\": {...}} JSON (vllm-mlx's keys too). No MCP "
        "server runs without it. Needs the 'mcp' extra",
    )
    t.add_argument(
        "--mcp-max-calls",
        type=_positive_int,
        default=McpSettings.max_calls,
        metavar="N",
        help="MCP tool calls pippin makes for one request; then the model answers without "
        "the MCP tools (default: %(default)s)",
    )
    t.add_argument(
        "--mcp-call-timeout",
        type=_positive_float,
        default=McpSettings.call_timeout,
        metavar="SECONDS",
        help="how long one MCP tool call may take before it ends with a timeout result "
        "(a server's own 'timeout' key overrides it; default: %(default)s)",
    )
    t.add_argument(
        "--mcp-auto",
        action="store_true",
        help="chat completions requests that name no 'mcp' tool get the tools of every "
        "configured server (for clients that know nothing of MCP)",
    )

    o = p.add_argument_group("chat output")
    o.add_argument(
        "--tool-call-parser",
        default="auto",
        metavar="NAME",
        help="format of the model's tool calls: 'auto' (from the chat template and model "
        "type), 'none', or a parser name such as hermes, qwen3_coder, llama3_json, "
        "mistral, deepseek_v3, kimi_k2, glm45, gemma4, gpt_oss; vLLM's and vllm-mlx's names "
        "are accepted ('qwen' reads both Qwen forms: hermes JSON and <function=...> XML) "
        "(default: %(default)s)",
    )
    o.add_argument(
        "--reasoning-parser",
        default="auto",
        metavar="NAME",
        help="format of the model's reasoning: 'auto', 'none', or one of think, qwen3, "
        "deepseek_r1, glm45, mistral, granite, gemma4; vLLM's and vllm-mlx's names are "
        "accepted (default: %(default)s)",
    )
    o.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility; tool calls are always parsed when a "
        "request has tools",
    )

    d = p.add_argument_group(
        "sampling defaults",
        "used when a request leaves a field out; they take precedence over the model's "
        "generation_config.json (vllm-mlx names)",
    )
    for name, kind, what in (
        ("temperature", float, "sampling temperature"),
        ("top-p", float, "nucleus sampling mass"),
        ("top-k", int, "top-k cutoff (0 = off)"),
        ("min-p", float, "min-p cutoff"),
        ("presence-penalty", float, "presence penalty"),
        ("repetition-penalty", float, "repetition penalty"),
    ):
        d.add_argument(f"--default-{name}", type=kind, metavar="X", help=f"default {what}")
    d.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        metavar="JSON",
        help='extra chat template arguments for every request, e.g. \'{"enable_thinking": '
        "false}'; a request's chat_template_kwargs override them key by key",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pippin",
        description="pippin: an inference server for large language models on MLX, "
        "speaking the OpenAI API.",
    )
    parser.add_argument("--version", action="version", version=f"pippin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="serve a model over HTTP",
        description="Serve one or several models over HTTP with the OpenAI API "
        "(/v1/chat/completions, /v1/completions, /v1/models; /health and /version; the "
        "prefix cache's GET /v1/cache/stats and DELETE /v1/cache), optionally with an "
        "embedding model (/v1/embeddings) and a reranker (/v1/rerank).",
    )
    for name in (None, "store"):  # every flag that takes a value, given once
        serve.register("action", name, _StoreOnce)
    _add_serve_args(serve)
    bench = sub.add_parser(
        "bench",
        help="measure any OpenAI-compatible server over HTTP",
        description="Load-test OpenAI-compatible servers (pippin or its peers) with streaming "
        "requests: concurrency sweeps or Poisson request rates; prints TTFT, inter-token "
        "latency, TPOT and end-to-end percentiles and aggregate tokens/s; with several --url or "
        "--serve (servers it starts and stops itself), runs them in one sweep and reports "
        "ratios to the first.",
    )
    add_bench_args(bench)
    bench_serve = sub.add_parser(
        "bench-serve",
        help="pippin bench under vllm-mlx's name, with its flag names",
        description="The same as 'pippin bench', also under vllm-mlx's bench-serve flag "
        "names: --prompts (one workload), --concurrency 1,4, --max-tokens, --format and "
        "--output.",
    )
    add_bench_serve_args(bench_serve)
    _add_embed_args(serve)
    _add_tts_args(serve)
    _add_stt_args(serve)
    _add_admission_args(serve)
    add_media_flags(serve)
    return parser


def _model_specs(args: argparse.Namespace) -> tuple[str | None, list[Any]]:
    """(the one model, or None) and the specs of several (empty for one model)."""
    from pippin.serving.model_specs import ModelSpec, SpecError, load_specs

    given = ([args.model] if args.model else []) + list(args.model_flag or [])
    given = list(dict.fromkeys(given))  # `serve M --model M` is one model
    if args.models:
        if given:
            raise SystemExit("pippin serve: give the models either as MODEL/--model or --models")
        try:
            specs = load_specs(args.models)
        except SpecError as e:
            raise SystemExit(f"pippin serve: --models: {e}") from None
        for spec in specs:
            if spec.idle_ttl is None and not spec.pinned:
                spec.idle_ttl = args.idle_ttl
        return None, specs
    if len(given) <= 1:
        return (given[0] if given else None), []
    names = list(args.served_model_name or [])
    return None, [
        ModelSpec(
            model=m,
            names=names if i == 0 else [],
            pinned=i == 0,
            idle_ttl=None if i == 0 else args.idle_ttl,
        )
        for i, m in enumerate(given)
    ]


def settings_from_args(args: argparse.Namespace) -> Any:
    from pippin.serving.model_specs import SpecError, parse_alias, parse_size
    from pippin.serving.settings import CorsSettings
    from pippin.serving.state import MIB, ServerSettings

    model, specs = _model_specs(args)
    try:
        aliases = [parse_alias(a) for a in args.model_alias]
        budget = parse_size(args.memory_budget) if args.memory_budget else None
    except SpecError as e:
        raise SystemExit(f"pippin serve: {e}") from None
    overrides = {
        "temperature": args.default_temperature,
        "top_p": args.default_top_p,
        "top_k": args.default_top_k,
        "min_p": args.default_min_p,
        "presence_penalty": args.default_presence_penalty,
        "repetition_penalty": args.default_repetition_penalty,
    }
    _check_draft_model(args.speculative_config)
    engine = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        # 0 is vllm-mlx's "chunked prefill off"; pippin always chunks, at the default size.
        max_num_batched_tokens=args.prefill_step_size or default_batched_tokens(),
        block_size=args.block_size,
        num_blocks=args.num_kv_blocks,
        cache_memory_percent=args.cache_memory_percent,
        cache_memory_bytes=args.cache_memory_mb * MIB if args.cache_memory_mb else None,
        buffer_cache_bytes=args.buffer_cache_mb * MIB if args.buffer_cache_mb else None,
        enable_prefix_caching=args.prefix_caching,
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
    from pippin.chat.reasoning import HARMONY_NAMES, REASONING_PARSERS
    from pippin.chat.tool_parsers import registry

    special = ("auto", "none")
    if args.metrics_flag and not args.metrics:
        raise SystemExit("pippin serve: --metrics and --no-metrics contradict each other")
    # gpt-oss's harmony parser reads its reasoning: vllm-mlx's harmony names mean "auto".
    if args.reasoning_parser in HARMONY_NAMES:
        args.reasoning_parser = "auto"
    for i, spec in enumerate(specs):
        if spec.reasoning_parser in HARMONY_NAMES:
            specs[i] = replace(spec, reasoning_parser="auto")
    tools = [("--tool-call-parser", args.tool_call_parser)]
    reasoning = [("--reasoning-parser", args.reasoning_parser)]
    for i, spec in enumerate(specs):
        tools.append((f"models[{i}].tool_call_parser", spec.tool_call_parser or "auto"))
        reasoning.append((f"models[{i}].reasoning_parser", spec.reasoning_parser or "auto"))
    for what, name in tools:
        if name not in special and name not in registry():
            raise SystemExit(
                f"pippin serve: unknown {what} {name!r}; choose "
                f"one of {', '.join([*special, *sorted(registry())])}"
            )
    for what, name in reasoning:
        if name not in special and name not in REASONING_PARSERS:
            raise SystemExit(
                f"pippin serve: unknown {what} {name!r}; choose "
                f"one of {', '.join([*special, *sorted(REASONING_PARSERS)])}"
            )
    return ServerSettings(
        model=model,
        models=specs,
        model_aliases=aliases,
        memory_budget=budget,
        model_load_timeout=args.model_load_timeout,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        served_model_names=list(args.served_model_name or []),
        api_key=args.api_key or None,
        dtype=None if args.dtype == "auto" else args.dtype,
        trust_remote_code=args.trust_remote_code,
        revision=args.revision,
        max_request_body_bytes=int(args.max_request_body_mb * MIB),
        engine=engine,
        engine_process=(
            default_engine_process() if args.engine_process is None else args.engine_process
        ),
        sampling_overrides={k: v for k, v in overrides.items() if v is not None},
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        metrics=args.metrics,
        embed=EmbedSettings(
            embedding_model=args.embedding_model,
            embedding_names=list(args.embedding_served_model_name or []),
            rerank_model=args.rerank_model,
            rerank_names=list(args.rerank_served_model_name or []),
            auto_truncate=args.auto_truncate,
            matryoshka=args.matryoshka_dimensions,
            max_batch_tokens=args.embedding_batch_tokens,
            max_batch_size=args.embedding_batch_size,
        ),
        stt=SttSettings(
            model=args.stt_model,
            names=list(args.stt_served_model_name or []),
            max_bytes=int(args.stt_max_mb * MIB),
            max_seconds=args.stt_max_seconds,
        ),
        warm_prompts=args.warm_prompts,
        cors=CorsSettings(
            tuple(args.allowed_origins),
            tuple(args.allowed_methods),
            tuple(args.allowed_headers),
            args.allow_credentials,
        ),
        log_prompts=args.log_prompts,
        max_queue=args.max_queue,
        api_keys=_api_keys(args.api_keys),
        drain_timeout_s=args.drain_timeout,
        mcp=mcp_settings(args),
        media=limits_from_args(args),
        tts_model=args.tts_model,
        tts_names=list(args.tts_served_model_name or []),
    )


def mcp_settings(args: argparse.Namespace) -> McpSettings:
    """The `--mcp-*` flags; a config pippin cannot run is one line and exit code 3."""
    if args.mcp_config is None:
        if args.mcp_auto:
            raise SystemExit("pippin serve: --mcp-auto needs --mcp-config")
        return McpSettings()
    if importlib.util.find_spec("mcp") is None:
        raise SystemExit("pippin serve: --mcp-config needs the MCP SDK: pip install 'pippin[mcp]'")
    try:
        servers = load_config(args.mcp_config)
    except McpConfigError as e:
        print(f"pippin serve: --mcp-config {args.mcp_config}: {e}", file=sys.stderr)
        raise SystemExit(3) from None
    return McpSettings(
        servers=tuple(servers),
        call_timeout=args.mcp_call_timeout,
        max_calls=args.mcp_max_calls,
        auto=args.mcp_auto,
    )


def _api_keys(path: str | None) -> list[Any]:
    from pippin.serving.admission import KeyFileError, load_keys

    if path is None:
        return []
    try:
        return load_keys(path)
    except KeyFileError as e:
        raise SystemExit(f"pippin serve: --api-keys: {e}") from None


def _tts_problem(path: str) -> str | None:
    """Why --tts-model cannot be served, found before the server starts (None: it can)."""
    if importlib.util.find_spec("mlx_audio") is None or importlib.util.find_spec("av") is None:
        return "text to speech needs the audio extra: pip install 'pippin[audio]'"
    if not (Path(path) / "config.json").is_file():
        return f"{path} is not a model folder (no config.json)"
    return None


def serve(args: argparse.Namespace) -> int:
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub when it is imported
    from pippin.obs.logs import setup_logging
    from pippin.server import create_app
    from pippin.serving import drain

    level = "debug" if args.log_level == "trace" else args.log_level
    setup_logging(level, args.log_format)
    settings = settings_from_args(args)
    open_to_all = settings.api_key is None and not settings.api_keys
    if open_to_all and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "listening on %s without --api-key: anyone who can reach it can use it", args.host
        )
    from pippin.embed.models import resolve_served
    from pippin.store.loader import ModelLoadError, resolve_spec

    # Found (or downloaded) before the server starts: a wrong name or path is then one
    # clear line, not the traceback of a failed application startup.
    served = (("embedding", args.embedding_model), ("rerank", args.rerank_model))
    what = "the model"
    try:
        for model in settings.model_specs():
            what = f"the model {model.model}" if settings.models else "the model"
            resolve_spec(model.model, settings.revision)
        for kind, spec in served:
            if spec:
                what = f"the {kind} model"
                resolve_served(spec, kind, settings.revision)
        if args.stt_model and not Path(args.stt_model).expanduser().is_dir():
            what = "the speech-to-text model"
            raise ModelLoadError(f"{args.stt_model}: not a model folder")
    except ModelLoadError as e:
        print(f"pippin serve: cannot load {what}: {e}", file=sys.stderr)
        return 3
    if args.tts_model:
        problem = _tts_problem(args.tts_model)
        if problem:
            print(f"pippin serve: cannot load the TTS model: {problem}", file=sys.stderr)
            return 3
    from pippin.serving.model_specs import SpecError

    try:
        app = create_app(settings)
    except SpecError as e:
        print(f"pippin serve: {e}", file=sys.stderr)
        return 2
    if settings.api_keys:
        from pippin.serving.admission import describe

        log.info("API keys from --api-keys: %s", describe(settings.api_keys))
    started = drain.serve(
        app,
        app.state.pippin,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # uvicorn's loggers go through ours (and its --log-format)
        access_log=False,  # replaced by pippin's own line per request (pippin.request)
        # Requests were drained already (--drain-timeout); what is left is idle connections.
        timeout_graceful_shutdown=10,
    )
    return 0 if started else 3


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        if argv is None:
            # Before MLX is imported: re-exec with OpenBLAS preloaded on Linux CPU.
            from pippin.blas import maybe_reexec_with_openblas

            maybe_reexec_with_openblas()
        return serve(args)
    if args.command in ("bench", "bench-serve"):
        from pippin.bench.cli import from_bench_serve, run

        return run(from_bench_serve(args) if args.command == "bench-serve" else args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
