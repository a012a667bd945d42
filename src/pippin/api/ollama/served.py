"""The one place the Ollama routes look models up: names as Ollama clients send them,
the chat model behind a name (through the registry, `pippin.serving.registry`), what
/api/tags and /api/ps list, and `keep_alive`.

Chat models load on demand and unload after their idle time; a request's `keep_alive`
replaces that time from then on (`ModelRegistry.acquire`), and `keep_alive: 0` unloads the
model once its requests end, the model of `pippin serve MODEL` too (the next request loads
it again). A model the operator pinned is never unloaded: `keep_alive: 0` for it is a 400
that says so. The embedding and rerank models stay loaded for good, so their `keep_alive`
is only checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pippin.api.ollama.protocol import KeepAlive, keep_alive_seconds
from pippin.serving.errors import ApiError
from pippin.serving.live_model import LiveModel
from pippin.serving.registry import LOADED, ModelEntry, ModelRegistry
from pippin.serving.state import ServerState, require_engine, use_model

# What /api/ps reports for a model that stays loaded: far in the future, as Ollama does
# for `keep_alive: -1`.
FOREVER = datetime(2318, 1, 1, tzinfo=timezone.utc)


def not_found(state: ServerState, name: str) -> ApiError:
    """Ollama's 404, with what this server serves instead and how a model is added."""
    names = ", ".join(dict.fromkeys(m.name for m in listed(state))) or "none"
    return ApiError(
        404,
        f'model "{name}" not found, try pulling it first (ollama pull / POST /api/pull '
        f"takes Hugging Face names such as hf.co/ORG/REPO:Q4_K_M); this server serves: "
        f"{names} (GET /api/tags lists them).",
        param="model",
    )


def registry_of(state: ServerState) -> ModelRegistry:
    assert state.registry is not None
    return state.registry


def _candidates(name: str) -> tuple[str, ...]:
    # Ollama's default tag: `smollm2:latest` is `smollm2`.
    return (name, name.removesuffix(":latest"))


def _chat(state: ServerState, name: str) -> tuple[str, ModelEntry] | None:
    """The name that resolved (as sent, or without `:latest`) and its chat model."""
    for candidate in _candidates(name):
        try:
            return candidate, registry_of(state).resolve(candidate)
        except ApiError:
            continue
    return None


def chat_entry(state: ServerState, name: str) -> ModelEntry | None:
    """The chat model `name` stands for (`ModelRegistry.resolve`), or None."""
    found = _chat(state, name)
    return found[1] if found is not None else None


def resolve(state: ServerState, name: str, kind: str) -> str | None:
    """The served name of the `kind` model ("embedding" or "rerank") `name` stands for."""
    names = state.extra_names.get(kind, [])
    return next((c for c in _candidates(name) if c in names), None)


def chat_name(state: ServerState, name: str) -> str:
    """The name of the chat model a request names, as answers carry it (without
    `:latest`); 400 for an embedding model, 404 for an unknown one. Loads nothing."""
    if not name:
        raise ApiError(400, "model is required", param="model")
    lora = next((c for c in _candidates(name) if state.adapters.get(c) is not None), None)
    if lora is not None:  # a LoRA adapter on a chat model (`serving.adapters`)
        return lora
    found = _chat(state, name)
    if found is None:
        if resolve(state, name, "embedding") is not None:
            raise ApiError(400, f'"{name}" does not support chat', param="model")
        raise not_found(state, name)
    return found[0]


def registry_keep_alive(keep_alive: KeepAlive) -> float | None:
    """A request's `keep_alive` as the registry takes it (negative: forever; None: the
    model's own); a bad one is a 400."""
    if keep_alive is None:
        return None
    seconds = keep_alive_seconds(keep_alive)
    return -1.0 if seconds is None else seconds


def refuse_unpinning(state: ServerState, name: str, seconds: float | None) -> None:
    """`keep_alive: 0` asks for an unload that a pinned model never gets: a 400 saying so,
    not an answer that looks as if it had been unloaded."""
    if seconds == 0 and registry_of(state).resolve(name).pinned:
        raise ApiError(
            400,
            f'model "{name}" is pinned by this server (pinned: true in its --models file) '
            "and is never unloaded; send no keep_alive, or one other than 0",
            param="keep_alive",
        )


async def chat_model(state: ServerState, name: str, keep_alive: KeepAlive) -> LiveModel:
    """The loaded chat model `name` (loading it if need be), held until the response is
    sent; `keep_alive` becomes its idle time from now on (0: unloaded once idle)."""
    seconds = registry_keep_alive(keep_alive)
    resolved = chat_name(state, name)
    refuse_unpinning(state, _base(state, resolved), seconds)
    live = await use_model(state, resolved, keep_alive=seconds)
    require_engine(live)
    return live


def _base(state: ServerState, name: str) -> str:
    """The chat model a resolved name loads: a LoRA adapter's base, else itself."""
    adapter = state.adapters.get(name)
    return name if adapter is None else state.adapters.base_name(registry_of(state), adapter)


async def load_or_unload(state: ServerState, name: str, keep_alive: KeepAlive) -> bool:
    """An empty request (no messages, no prompt): Ollama's way to load a model, or with
    `keep_alive` 0 to unload it. True when it unloads."""
    seconds = registry_keep_alive(keep_alive)
    resolved = chat_name(state, name)
    base = _base(state, resolved)  # an adapter's: its base model loads and unloads
    refuse_unpinning(state, base, seconds)
    if seconds == 0:
        await registry_of(state).unload(base)
        return True
    await use_model(state, resolved, keep_alive=seconds)
    return False


@dataclass
class Listed:
    name: str
    kind: str  # "chat", "embedding" or "rerank"
    source: str
    family: str
    size: int  # bytes of weights, when known
    context_length: int | None
    entry: ModelEntry | None = None  # a chat model's registry entry


def _chat_listed(entry: ModelEntry) -> list[Listed]:
    live = entry.live
    if live is not None and live.loaded is not None:
        loaded = live.loaded
        source, config = loaded.source, loaded.config
        ctx = live.engine.max_model_len if live.engine is not None else None
    else:
        source, config = entry.spec.model or "", config_on_disk(entry.spec.model)
        ctx = entry.spec.max_model_len
    family = str(config.get("model_type", ""))
    size = _weights_bytes(source)
    return [Listed(n, "chat", source, family, size, ctx, entry) for n in entry.served_names]


def listed(state: ServerState) -> list[Listed]:
    """Every served model, loaded or not, for /api/tags, /api/ps and /api/show."""
    out = [m for e in registry_of(state).entries() for m in _chat_listed(e)]
    for kind, names in state.extra_names.items():
        model = state.embed.models.get(kind) if state.embed is not None else None
        for n in names:
            src = str(getattr(model, "source", "")) if model is not None else ""
            ctx = getattr(model, "max_len", None)
            out.append(Listed(n, kind, src, "", 0, ctx))
    return out


def running(state: ServerState) -> list[Listed]:
    """The loaded models, for /api/ps: a chat model's size is its memory (weights and KV
    pool, as the registry measured it at load)."""
    out = []
    for m in listed(state):
        if m.entry is not None:
            live = m.entry.live
            if m.entry.state != LOADED or live is None or live.engine is None:
                continue
            if not live.engine.ready:
                continue
            m.size = m.entry.memory_bytes or m.size
        out.append(m)
    return out


def find(state: ServerState, name: str) -> Listed:
    entry = chat_entry(state, name)
    if entry is not None:
        return next(m for m in listed(state) if m.entry is entry)
    for kind in ("embedding", "rerank"):
        served = resolve(state, name, kind)
        if served is not None:
            return next(m for m in listed(state) if m.name == served and m.kind == kind)
    raise not_found(state, name)


_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".npz", ".bin")


def _weights_bytes(source: str) -> int:
    """The weights' size on disk, as Ollama reports a model's size (0 for a Hub id
    whose files are not at `source`)."""
    if not source:
        return 0
    path = Path(source)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.suffix in _WEIGHT_SUFFIXES)
    return 0


def config_on_disk(source: str | None) -> dict[str, object]:
    """A model folder's config.json, read without loading the model ({} if none)."""
    path = Path(source) / "config.json" if source else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


# --- keep_alive ------------------------------------------------------------------


def touch(keep_alive: KeepAlive) -> None:
    """An embedding request's `keep_alive`: checked (a bad one is a 400); those models
    stay loaded."""
    keep_alive_seconds(keep_alive)


def expires_at(m: Listed) -> datetime:
    """When a loaded model will be unloaded if nothing uses it (far away: never)."""
    at = m.entry.expires_at() if m.entry is not None else None
    return FOREVER if at is None else datetime.fromtimestamp(at, timezone.utc)
