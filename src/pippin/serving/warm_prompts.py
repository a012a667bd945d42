"""`--warm-prompts FILE`: prompts prefilled at start-up, before /health turns ready.

The file is a JSON list. Each item is a text (sent as a completions prompt), a chat
request body (an object with `messages`, and anything else a chat request may carry:
`tools`, `chat_template_kwargs`, `cache_salt`, ...) or a completions body (an object
with `prompt`). Each is sent through the app itself, in process, exactly as a client's
request would be, with `max_tokens` 1: so it is rendered and tokenized the same way, and
the prefix cache then holds its prompt's full blocks (and the SSD tier, if on, gets
them when they are evicted or at shutdown).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message

from pippin.serving.registry import DEFAULT_NAME

if TYPE_CHECKING:
    from pippin.serving.state import ServerState

log = logging.getLogger(__name__)


class WarmPromptsError(Exception):
    pass


def load_warm_prompts(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(route, request body) for each item of the file; WarmPromptsError if it is malformed."""
    try:
        items = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise WarmPromptsError(f"cannot read the warm prompts file: {e}") from None
    if not isinstance(items, list):
        raise WarmPromptsError("the warm prompts file must hold a JSON list")
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            out.append(("/v1/completions", {"prompt": item}))
        elif isinstance(item, dict) and "messages" in item:
            out.append(("/v1/chat/completions", dict(item)))
        elif isinstance(item, dict) and "prompt" in item:
            out.append(("/v1/completions", dict(item)))
        else:
            raise WarmPromptsError(
                f"warm prompt {i}: expected a text or an object with 'messages' or 'prompt'"
            )
    return out


async def _post(
    app: ASGIApp, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
) -> tuple[int, bytes]:
    """One request through the ASGI app, without a socket."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    sent = False
    done = asyncio.Event()
    status = 0
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal sent
        if sent:
            await done.wait()  # the "client" stays until the whole response is sent
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def warm_up(app: ASGIApp, state: ServerState, path: str | Path) -> None:
    prompts = load_warm_prompts(path)
    headers = []
    if state.settings.api_key:
        headers.append((b"authorization", f"Bearer {state.settings.api_key}".encode()))
    t0 = time.monotonic()
    tokens = 0
    for i, (route, body) in enumerate(prompts):
        body.setdefault("model", DEFAULT_NAME)
        for key in ("stream", "stream_options", "max_completion_tokens", "n", "best_of"):
            body.pop(key, None)
        body["max_tokens"] = 1
        status, raw = await _post(app, route, json.dumps(body).encode(), headers)
        if status != 200:
            try:
                msg = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = raw[:200].decode(errors="replace")
            raise WarmPromptsError(f"warm prompt {i} was refused ({status}): {msg}")
        tokens += int(json.loads(raw)["usage"]["prompt_tokens"])
    log.info(
        "prefilled %d warm prompts (%d prompt tokens) in %.1fs",
        len(prompts),
        tokens,
        time.monotonic() - t0,
    )
