"""`pippin serve`'s server flags: where it listens, the API key, the body cap, logging,
CORS and the /metrics switch."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from pippin import envs
from pippin.argtypes import positive_float
from pippin.obs.logs import LOG_FORMATS

if TYPE_CHECKING:
    from pippin.serving.settings import CorsSettings

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


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


def add_server_flags(p: argparse.ArgumentParser) -> None:
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
        type=positive_float,
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


def metrics_on(args: argparse.Namespace) -> bool:
    """--no-metrics (metrics are on by default); with --metrics too it is an error."""
    if args.metrics_flag and not args.metrics:
        raise SystemExit("pippin serve: --metrics and --no-metrics contradict each other")
    return bool(args.metrics)


def cors_settings(args: argparse.Namespace) -> CorsSettings:
    from pippin.serving.settings import CorsSettings

    return CorsSettings(
        tuple(args.allowed_origins),
        tuple(args.allowed_methods),
        tuple(args.allowed_headers),
        args.allow_credentials,
    )
