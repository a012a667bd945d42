"""Command line: ``pippin serve [MODEL]`` and ``pippin --version``.

Flag names follow pippin's own vocabulary; the names vLLM and vllm-mlx use for the
same settings are accepted as aliases so existing launch scripts keep working. Flags
whose meaning differs in those servers are not aliased.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from pippin import __version__
from pippin.engine.config import EngineConfig

log = logging.getLogger("pippin.cli")

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DTYPES = ("auto", "float32", "float16", "bfloat16")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


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


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


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
        help="the same as the positional MODEL (vLLM spelling)",
    )
    m.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) clients use in the 'model' field; default: the model's own name",
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
        default=os.environ.get("PIPPIN_API_KEY"),
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

    e = p.add_argument_group("engine")
    e.add_argument(
        "--max-num-seqs",
        type=_positive_int,
        default=EngineConfig.max_num_seqs,
        help="most sequences decoded together in one batch (default: %(default)s)",
    )
    e.add_argument(
        "--max-model-len",
        type=_positive_int,
        help="context limit in tokens (prompt + completion); default: the model's own",
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
        default=EngineConfig.max_num_batched_tokens,
        help="tokens one scheduler step may process (prefill chunks plus decodes); long "
        "prompts are prefilled in chunks of this size so running decodes never stall for "
        "long (aliases: vLLM's --max-num-batched-tokens, vllm-mlx's --chunked-prefill-tokens, "
        "where 0 means the default) (default: %(default)s)",
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
        "--continuous-batching",
        action="store_true",
        help="accepted for vllm-mlx compatibility; pippin always batches continuously",
    )
    e.add_argument(
        "--use-paged-cache",
        action="store_true",
        help="accepted for vllm-mlx compatibility; pippin's KV cache is always paged",
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

    o = p.add_argument_group("chat output")
    o.add_argument(
        "--tool-call-parser",
        default="auto",
        metavar="NAME",
        help="format of the model's tool calls: 'auto' (from the chat template and model "
        "type), 'none', or a parser name such as hermes, qwen3_coder, llama3_json, "
        "mistral, deepseek_v3, kimi_k2, glm45, gemma4, gpt_oss (default: %(default)s)",
    )
    o.add_argument(
        "--reasoning-parser",
        default="auto",
        metavar="NAME",
        help="format of the model's reasoning: 'auto', 'none', or one of think, qwen3, "
        "deepseek_r1, glm45, mistral, granite, gemma4 (default: %(default)s)",
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
        description="Serve one model over HTTP with the OpenAI API "
        "(/v1/chat/completions, /v1/completions, /v1/models; /health and /version; the "
        "prefix cache's GET /v1/cache/stats and DELETE /v1/cache).",
    )
    _add_serve_args(serve)
    return parser


def settings_from_args(args: argparse.Namespace) -> Any:
    from pippin.server import MIB, ServerSettings

    if args.model and args.model_flag and args.model != args.model_flag:
        raise SystemExit("pippin serve: give the model once (positional MODEL or --model)")
    overrides = {
        "temperature": args.default_temperature,
        "top_p": args.default_top_p,
        "top_k": args.default_top_k,
        "min_p": args.default_min_p,
        "presence_penalty": args.default_presence_penalty,
        "repetition_penalty": args.default_repetition_penalty,
    }
    engine = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        # 0 is vllm-mlx's "chunked prefill off"; pippin always chunks, at the default size.
        max_num_batched_tokens=args.prefill_step_size or EngineConfig.max_num_batched_tokens,
        block_size=args.block_size,
        num_blocks=args.num_kv_blocks,
        cache_memory_percent=args.cache_memory_percent,
        cache_memory_bytes=args.cache_memory_mb * MIB if args.cache_memory_mb else None,
        enable_prefix_caching=args.prefix_caching,
        max_tokens_cap=args.max_tokens,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        ssd_cache_dir=args.ssd_cache_dir,
        ssd_cache_max_gb=args.ssd_cache_max_gb,
    )
    from pippin.chat.reasoning import REASONING_PARSERS
    from pippin.chat.tool_parsers import registry

    special = ("auto", "none")
    if args.tool_call_parser not in special and args.tool_call_parser not in registry():
        raise SystemExit(
            f"pippin serve: unknown --tool-call-parser {args.tool_call_parser!r}; choose "
            f"one of {', '.join([*special, *sorted(registry())])}"
        )
    if args.reasoning_parser not in special and args.reasoning_parser not in REASONING_PARSERS:
        raise SystemExit(
            f"pippin serve: unknown --reasoning-parser {args.reasoning_parser!r}; choose "
            f"one of {', '.join([*special, *sorted(REASONING_PARSERS)])}"
        )
    return ServerSettings(
        model=args.model or args.model_flag,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        served_model_names=list(args.served_model_name or []),
        api_key=args.api_key or None,
        dtype=None if args.dtype == "auto" else args.dtype,
        trust_remote_code=args.trust_remote_code,
        revision=args.revision,
        max_request_body_bytes=int(args.max_request_body_mb * MIB),
        engine=engine,
        sampling_overrides={k: v for k, v in overrides.items() if v is not None},
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        warm_prompts=args.warm_prompts,
    )


def serve(args: argparse.Namespace) -> int:
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub when it is imported
    import uvicorn

    from pippin.server import create_app

    level = "debug" if args.log_level == "trace" else args.log_level
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    settings = settings_from_args(args)
    if settings.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "listening on %s without --api-key: anyone who can reach it can use it", args.host
        )
    app = create_app(settings)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        # Streams can run for minutes; a stop signal should not wait for all of them.
        timeout_graceful_shutdown=10,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        if argv is None:
            # Before MLX is imported: re-exec with OpenBLAS preloaded on Linux CPU.
            from pippin.blas import maybe_reexec_with_openblas

            maybe_reexec_with_openblas()
        return serve(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
