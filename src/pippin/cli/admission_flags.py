"""`pippin serve`'s admission, limits and stopping flags, and the --api-keys file."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pippin.argtypes import non_negative_float, positive_float, positive_int

if TYPE_CHECKING:
    from pippin.serving.admission import ApiKey


def add_admission_flags(p: argparse.ArgumentParser) -> None:
    a = p.add_argument_group("admission, limits and stopping (docs/reliability.md)")
    a.add_argument(
        "--max-queue",
        type=positive_int,
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
        type=positive_float,
        metavar="SECONDS",
        help="end a request still queued or generating this long after it arrived, with the "
        "API's error (in a stream: an error event); its KV blocks are freed (default: none)",
    )
    a.add_argument(
        "--drain-timeout",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long requests in flight may take to finish while new ones get "
        "503; then they end with an error (default: %(default)s)",
    )


def api_keys(path: str | None) -> list[ApiKey]:
    from pippin.serving.admission import KeyFileError, load_keys

    if path is None:
        return []
    try:
        return load_keys(path)
    except KeyFileError as e:
        raise SystemExit(f"pippin serve: --api-keys: {e}") from None
