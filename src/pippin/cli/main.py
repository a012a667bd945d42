"""`pippin`'s parser, its subcommands (serve, bench, bench-serve, pull, ls, rm, ps) and
`main`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from pippin import __version__
from pippin.bench.cli import add_bench_args, add_bench_serve_args
from pippin.cli.admission_flags import add_admission_flags
from pippin.cli.audio_flags import add_stt_flags, add_tts_flags
from pippin.cli.chat_flags import add_chat_flags
from pippin.cli.embed_flags import add_embed_flags
from pippin.cli.engine_flags import add_engine_flags
from pippin.cli.mcp_flags import add_mcp_flags
from pippin.cli.media_flags import add_media_flags
from pippin.cli.model_flags import add_model_flags
from pippin.cli.models_cmds import add_models_parsers
from pippin.cli.pull import add_pull_parser, pull_command
from pippin.cli.serve import serve
from pippin.cli.server_flags import add_server_flags

DESCRIPTION = """\
pippin: an inference server for large language models on MLX. One process
serves the OpenAI API (chat completions, completions, responses, embeddings,
rerank, audio), the Anthropic Messages API and the Ollama API, and a web page
with live metrics and a chat. 'pippin serve --help' lists the routes and flags."""

# Where to read more: docs/ is in the repository, not in the installed package.
DOCS = """\
Documentation: README.md and docs/ in pippin's repository: api-compatibility.md
(every request field of every API, and the errors), architecture.md (the engine,
the metrics), reliability.md (limits, security), deployment.md, bench.md."""

SERVE_DESCRIPTION = """\
Serve one or several models over HTTP (127.0.0.1:8000 by default; with no MODEL,
the bundled SmolLM2-135M-Instruct). Routes:

  OpenAI      /v1/chat/completions, /v1/completions, /v1/responses, /v1/models;
              /v1/embeddings (--embedding-model), /v1/rerank (--rerank-model),
              /v1/audio/speech (--tts-model), /v1/audio/transcriptions and
              /v1/audio/translations (--stt-model); /v1/mcp/tools (--mcp-config);
              GET and DELETE /v1/responses/{id}
  Anthropic   /v1/messages, /v1/messages/count_tokens
  Ollama      /api/chat, /api/generate, /api/embed, /api/embeddings, /api/tags,
              /api/show, /api/ps, /api/version; /api/pull, /api/create, /api/copy,
              /api/delete, /api/blobs (model management; /api/push is refused)
  web page    / (live metrics and a chat playground)
  operations  /health, /version, /metrics (Prometheus), /v1/engine/stats,
              /openapi.json, GET /v1/cache/stats and DELETE /v1/cache (the prefix
              cache), /v1/mcp/servers; POST /sleep, POST /wake_up, GET /is_sleeping
              (vLLM's sleep mode)"""


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


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of `pippin serve`, group by group in the order `--help` lists them."""
    add_model_flags(p)
    add_server_flags(p)
    add_engine_flags(p)
    add_mcp_flags(p)
    add_chat_flags(p)
    add_embed_flags(p)
    add_tts_flags(p)
    add_stt_flags(p)
    add_admission_flags(p)
    add_media_flags(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pippin",
        description=DESCRIPTION,
        epilog=DOCS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"pippin {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve_parser = sub.add_parser(
        "serve",
        help="serve a model over HTTP (OpenAI, Anthropic and Ollama APIs, web page)",
        description=SERVE_DESCRIPTION,
        epilog=DOCS,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name in (None, "store"):  # every flag that takes a value, given once
        serve_parser.register("action", name, _StoreOnce)
    add_serve_flags(serve_parser)
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
    add_pull_parser(sub)
    add_models_parsers(sub)
    return parser


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
    if args.command == "pull":
        return pull_command(args)
    command = getattr(args, "models_command", None)
    if command is not None:
        return command(args)
    parser.print_help(sys.stderr)
    return 2
