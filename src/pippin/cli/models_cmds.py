"""`pippin ls`, `pippin rm` and `pippin ps`: the library's models (``--models-dir``,
`pippin.store.library`) and a running server's loaded ones, printed as `ollama ls` and
`ollama ps` print theirs.

`ls` and `rm` read and change the folder itself, no server needed (a running server sees
the change at its next request); `ps` asks a server's /api/ps.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from typing import Any

from pippin import envs


def _models_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models-dir",
        metavar="DIR",
        help="the library folder (default: models in pippin's cache folder, "
        "$PIPPIN_CACHE_DIR or ~/.cache/pippin); as the first --models-dir of pippin serve",
    )


def add_models_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The ls, rm and ps subcommands; each sets ``models_command`` to its function."""
    ls = sub.add_parser("ls", help="list the models in pippin's library")
    _models_dir(ls)
    ls.set_defaults(models_command=list_models)
    rm = sub.add_parser("rm", help="delete models from pippin's library")
    rm.add_argument("names", nargs="+", metavar="NAME", help="model name (name:tag)")
    _models_dir(rm)
    rm.set_defaults(models_command=remove_models)
    ps = sub.add_parser("ps", help="list the models a running pippin server has loaded")
    ps.add_argument(
        "--host", default="127.0.0.1", help="the server's address (default: %(default)s)"
    )
    ps.add_argument(
        "--port", type=int, default=8000, help="the server's port (default: %(default)s)"
    )
    ps.add_argument(
        "--api-key",
        default=envs.PIPPIN_API_KEY,
        help="the server's API key (default: $PIPPIN_API_KEY)",
    )
    _models_dir(ps)  # accepted for symmetry; the server knows its own
    ps.set_defaults(models_command=running_models)


def _library(args: argparse.Namespace) -> Any:
    from pippin.store.library import ModelLibrary, default_root

    return ModelLibrary(args.models_dir or default_root())


def human_size(n: float) -> str:
    """Decimal units, as Ollama prints sizes."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def ago(ts: float, now: float | None = None) -> str:
    """``3 minutes ago``, as Ollama prints a model's age."""
    seconds = max((now or time.time()) - ts, 0)
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count > 1 else ''} ago"
    return "Less than a minute ago" if seconds >= 1 else "Just now"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "    ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def list_models(args: argparse.Namespace) -> int:
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    for m in reversed(_library(args).list()):  # newest first, as `ollama ls`
        rows.append([m.name, m.digest[:12], human_size(m.size), ago(m.created)])
    print(_table(rows))
    return 0


def remove_models(args: argparse.Namespace) -> int:
    from pippin.store.library import LibraryError

    library, status = _library(args), 0
    for name in args.names:
        try:
            library.remove(name)
        except LibraryError as e:
            print(f"Error: {e}", file=sys.stderr)
            status = 1
            continue
        print(f"deleted '{name}'")
    return status


def _until(text: str | None) -> str:
    if not text:
        return ""
    at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    seconds = at.timestamp() - time.time()
    if seconds > 100 * 365 * 86400:
        return "Forever"
    for unit, size in (("hour", 3600), ("minute", 60)):
        if seconds >= size:
            count = int(seconds // size)
            return f"{count} {unit}{'s' if count > 1 else ''} from now"
    return "Less than a minute from now" if seconds > 0 else "Stopping..."


def running_models(args: argparse.Namespace) -> int:
    import httpx

    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
    url = f"http://{host}:{args.port}/api/ps"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        r = httpx.get(url, headers=headers, timeout=30)
    except httpx.HTTPError as e:
        print(f"Error: cannot reach a pippin server at {host}:{args.port}: {e}", file=sys.stderr)
        return 1
    if r.status_code != 200:
        print(f"Error: {r.status_code} from {url}: {r.text.strip()[:300]}", file=sys.stderr)
        return 1
    rows = [["NAME", "ID", "SIZE", "CONTEXT", "UNTIL"]]
    for m in r.json().get("models", []):
        rows.append(
            [
                m.get("name", ""),
                str(m.get("digest", ""))[:12],
                human_size(m.get("size") or 0),
                str(m.get("context_length") or ""),
                _until(m.get("expires_at")),
            ]
        )
    print(_table(rows))
    return 0
