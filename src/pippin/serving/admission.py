"""Who may start a request now: draining, the bounded queue and per-key limits.

- **Draining** (SIGTERM, `pippin.serving.drain`): every new request gets 503 with
  ``Retry-After`` (Anthropic's route: 529 ``overloaded_error``) while those in flight finish.
- **Queue** (``--max-queue N``): a generation request that arrives while N others are
  held without output yet (queued in the engine, or still in their prefill) gets 429
  (OpenAI routes) or 529 ``overloaded_error`` (``/v1/messages``) with ``Retry-After``.
- **Keys** (``--api-keys FILE``): each key has a name and optional limits: requests per
  minute, concurrent requests, tokens (prompt plus output) per minute. Over a limit: 429
  with ``Retry-After`` in the route's error format (Anthropic: ``rate_limit_error``). A
  request's tokens are counted when it ends, so one request may take a key past its
  token limit; the next waits. Each key gets its own prefix cache: its requests are
  salted as the request field ``cache_salt`` salts them (`salted`). Secrets are never
  logged: a key is known by its name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
from collections import deque
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from pippin.obs.http import RequestRecord
from pippin.serving.errors import ApiError

WINDOW_S = 60.0


class KeyFileError(ValueError):
    """The --api-keys file cannot be used; the message says why (never the secrets)."""


@dataclass
class ApiKey:
    name: str
    secret: str = field(repr=False)
    requests_per_minute: int | None = None
    concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    # May manage models (pull, create, copy, delete, LoRA adapters): `admin: true`.
    admin: bool = False

    @property
    def salt(self) -> str:
        # From the secret, not the name: two keys never share a cache by sharing a name.
        return "key:" + hashlib.sha256(self.secret.encode()).hexdigest()[:32]


_LIMITS = ("requests_per_minute", "concurrent_requests", "tokens_per_minute")


def load_keys(path: str | Path) -> list[ApiKey]:
    """Keys from a JSON or YAML file: a list of ``{key, name?, admin?, requests_per_minute?,
    concurrent_requests?, tokens_per_minute?}``, or ``{"keys": [...]}``."""
    import yaml  # YAML is a superset of JSON: one parser reads both

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise KeyFileError(f"cannot read the API keys file: {e.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise KeyFileError(f"the API keys file is not valid JSON or YAML: {e}") from None
    entries = doc.get("keys") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or not entries:
        raise KeyFileError("the API keys file must hold a non-empty list of keys")
    keys: list[ApiKey] = []
    for i, e in enumerate(entries):
        where = f"key {i + 1}"
        if not isinstance(e, dict) or not isinstance(e.get("key"), str) or not e["key"]:
            raise KeyFileError(f"{where}: needs a non-empty string 'key'")
        unknown = set(e) - {"key", "name", "admin", *_LIMITS}
        if unknown:
            raise KeyFileError(f"{where}: unknown field(s) {sorted(unknown)}")
        limits: dict[str, int | None] = {}
        for name in _LIMITS:
            v = e.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise KeyFileError(f"{where}: {name} must be a positive integer")
            limits[name] = v
        admin = e.get("admin", False)
        if not isinstance(admin, bool):
            raise KeyFileError(f"{where}: admin must be true or false")
        name = str(e.get("name") or f"key-{i + 1}")
        keys.append(ApiKey(name, e["key"], admin=admin, **limits))
    if len({k.secret for k in keys}) != len(keys):
        raise KeyFileError("the API keys file holds the same key twice")
    if len({k.name for k in keys}) != len(keys):
        raise KeyFileError("the API keys file holds the same name twice")
    return keys


class KeyUse:
    """One key's use: request starts and tokens in the last minute, requests in flight."""

    def __init__(self, key: ApiKey) -> None:
        self.key = key
        self.starts: deque[float] = deque()
        self.tokens: deque[tuple[float, int]] = deque()
        self.token_sum = 0
        self.in_flight = 0

    def refusal(self, now: float) -> ApiError | None:
        """The 429 this key gets now, if any."""
        k = self.key
        while self.starts and self.starts[0] <= now - WINDOW_S:
            self.starts.popleft()
        while self.tokens and self.tokens[0][0] <= now - WINDOW_S:
            self.token_sum -= self.tokens.popleft()[1]
        if k.concurrent_requests is not None and self.in_flight >= k.concurrent_requests:
            return _rate_limited(f"{k.concurrent_requests} concurrent requests", 1.0, "requests")
        if k.requests_per_minute is not None and len(self.starts) >= k.requests_per_minute:
            wait = self.starts[0] + WINDOW_S - now
            return _rate_limited(f"{k.requests_per_minute} requests per minute", wait, "requests")
        if k.tokens_per_minute is not None and self.token_sum >= k.tokens_per_minute:
            # Wait until enough of the window's tokens have aged out.
            over, wait = self.token_sum - k.tokens_per_minute, 1.0
            for t, n in self.tokens:
                over -= n
                wait = t + WINDOW_S - now
                if over < 0:
                    break
            return _rate_limited(f"{k.tokens_per_minute} tokens per minute", wait, "tokens")
        return None

    def charge(self, now: float, tokens: int) -> None:
        if tokens > 0:
            self.tokens.append((now, tokens))
            self.token_sum += tokens


def _rate_limited(what: str, wait: float, kind: str) -> ApiError:
    seconds = max(1, math.ceil(wait))
    return ApiError(
        429,
        f"Rate limit reached for this API key: {what}. Try again in {seconds}s.",
        type=kind,  # as OpenAI: "requests" or "tokens"; Anthropic's body says rate_limit_error
        code="rate_limit_exceeded",
        headers={"Retry-After": str(seconds)},
    )


current_key: ContextVar[ApiKey | None] = ContextVar("pippin_api_key", default=None)


def salted(cache_salt: str | None) -> str | None:
    """The request's cache salt, joined with its key's when it came with one of the
    --api-keys: keys never share prefix-cache blocks."""
    key = current_key.get()
    if key is None:
        return cache_salt
    return key.salt if cache_salt is None else f"{key.salt}|{cache_salt}"


@dataclass
class Admission:
    """Shared by the middleware and the drain; one per server."""

    max_queue: int | None = None
    retry_after_s: int = 1
    keys: list[ApiKey] = field(default_factory=list)
    draining: bool = False
    in_flight: int = 0  # every request in the app, any route
    generating: dict[int, RequestRecord] = field(default_factory=dict)  # by id()

    def __post_init__(self) -> None:
        self.uses = {k.secret.encode(): KeyUse(k) for k in self.keys}

    def key_for(self, supplied: str) -> KeyUse | None:
        """The --api-keys entry `supplied` matches (compared in constant time)."""
        raw = supplied.encode()
        found = None
        for secret, use in self.uses.items():
            if hmac.compare_digest(raw, secret):
                found = use
        return found

    def queued(self) -> int:
        """Generation requests held without output yet: in the engine's queue, in their
        prefill, or still being templated and tokenized on their way to it."""
        return sum(
            1 for r in self.generating.values() if r.timing is None or r.timing.t_first is None
        )


def describe(keys: list[ApiKey]) -> str:
    """For the startup log: names and limits, never the secrets."""
    return json.dumps(
        [{"name": k.name, **{n: getattr(k, n) for n in _LIMITS if getattr(k, n)}} for k in keys]
    )
