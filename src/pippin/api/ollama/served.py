"""The one place the Ollama routes look models up: names as Ollama clients send them,
the chat model behind a name, what /api/tags and /api/ps list, and `keep_alive`.

Today the server has one chat model (and maybe an embedding and a rerank model), so a
request's `keep_alive` is checked but unloads nothing, and /api/ps shows every model as
loaded for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from pippin.api.errors import OpenAIError
from pippin.api.ollama.protocol import KeepAlive, keep_alive_seconds
from pippin.api.state import ServerState, require_engine
from pippin.engine.client import EngineClient
from pippin.store.loaded import LoadedModel

# What /api/ps reports for a model that stays loaded: far in the future, as Ollama does
# for `keep_alive: -1`.
FOREVER = datetime(2318, 1, 1, tzinfo=timezone.utc)


def not_found(name: str) -> OpenAIError:
    return OpenAIError(404, f'model "{name}" not found, try pulling it first', param="model")


def _names(state: ServerState, kind: str | None) -> list[str]:
    if kind is None:
        return list(state.model_names)
    return list(state.extra_names.get(kind, []))


def resolve(state: ServerState, name: str, kind: str | None = None) -> str | None:
    """The served name `name` stands for, or None: as sent, or without Ollama's default
    tag (`smollm2:latest` is `smollm2`)."""
    names = _names(state, kind)
    for candidate in (name, name.removesuffix(":latest")):
        if candidate in names:
            return candidate
    return None


def chat_model(state: ServerState, name: str) -> tuple[str, EngineClient, LoadedModel]:
    """The chat model a request names: its served name, engine and weights."""
    if not name:
        raise OpenAIError(400, "model is required", param="model")
    served = resolve(state, name)
    if served is None:
        if resolve(state, name, "embedding") is not None:
            raise OpenAIError(400, f'"{name}" does not support chat', param="model")
        raise not_found(name)
    engine, loaded = require_engine(state)
    return served, engine, loaded


@dataclass
class Listed:
    name: str
    kind: str  # "chat", "embedding" or "rerank"
    source: str
    family: str
    size: int  # bytes of weights, when known
    context_length: int | None


def listed(state: ServerState) -> list[Listed]:
    """Every served model, for /api/tags, /api/ps and /api/show."""
    out: list[Listed] = []
    loaded = state.loaded
    if loaded is not None:
        family = str(loaded.config.get("model_type", ""))
        ctx = state.engine.max_model_len if state.engine is not None else None
        for n in state.model_names:
            out.append(Listed(n, "chat", loaded.source, family, _weights_bytes(loaded), ctx))
    for kind, names in state.extra_names.items():
        model = state.embed.models.get(kind) if state.embed is not None else None
        for n in names:
            src = str(getattr(model, "source", "")) if model is not None else ""
            ctx = getattr(model, "max_len", None)
            out.append(Listed(n, kind, src, "", 0, ctx))
    return out


def find(state: ServerState, name: str) -> Listed:
    for kind in (None, "embedding", "rerank"):
        served = resolve(state, name, kind)
        if served is not None:
            return next(m for m in listed(state) if m.name == served)
    raise not_found(name)


_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".npz", ".bin")


def _weights_bytes(loaded: LoadedModel) -> int:
    """The weights' size on disk, as Ollama reports a model's size (0 for a Hub id
    whose files are not at `source`)."""
    path = Path(loaded.source)
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for f in path.iterdir() if f.suffix in _WEIGHT_SUFFIXES)
    return 0


# --- keep_alive ------------------------------------------------------------------


def touch(state: ServerState, name: str, keep_alive: KeepAlive) -> None:
    """A request used `name` with this `keep_alive` (a bad one is a 400). The one chat
    model is pinned until the registry of models loads and unloads them, so a valid
    `keep_alive` changes nothing yet."""
    keep_alive_seconds(keep_alive)


def expires_at(state: ServerState, name: str) -> datetime:
    """When `name` will be unloaded: never, for today's pinned models."""
    return FOREVER
