"""The server's shared state, and the lookups every route makes in it.

`ServerSettings` is what the CLI decided; `ServerState` is reached by the routes through
``app.state.pippin``; its registry gives each request its chat model (a `LiveModel`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pippin.engine.client import EngineClient
from pippin.obs.metrics import Metrics
from pippin.serving.adapters import Adapters
from pippin.serving.admission import Admission
from pippin.serving.errors import ApiError, server_error
from pippin.serving.live_model import LiveModel
from pippin.serving.registry import ModelRegistry
from pippin.serving.settings import MIB, ServerSettings
from pippin.store.loaded import LoadedModel

if TYPE_CHECKING:
    from pippin.embed.models import Kind, ServedModel
    from pippin.embed.worker import EmbedWorker

__all__ = ["MIB", "LiveModel", "ServerSettings", "ServerState"]

log = logging.getLogger("pippin.server")


@dataclass
class ServerState:
    """Shared by the routes through ``app.state.pippin``. The chat models are in the
    registry (`pippin.serving.registry`); the embedding and rerank models beside them."""

    settings: ServerSettings
    registry: ModelRegistry | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics | None = None
    admission: Admission = field(default_factory=Admission)

    # The embedding/rerank worker and the names of its models, by kind.
    embed: Any = None
    # The MCP servers' manager (pippin.mcp.manager.McpManager), when any are configured.
    mcp: Any = None
    # The text-to-speech worker (pippin.audio.tts.TTSWorker), with --tts-model.
    tts: Any = None
    # The speech-to-text worker (pippin.audio.stt.SttWorker), with --stt-model.
    stt: Any = None
    extra_names: dict[str, list[str]] = field(default_factory=dict)
    # The LoRA adapters served as models on a base chat model (pippin.serving.adapters).
    adapters: Adapters = field(init=False)

    def __post_init__(self) -> None:
        self.adapters = Adapters(self.settings)

    def engine_stats(self) -> dict[str, dict[str, int]]:
        return self.registry.engine_stats() if self.registry is not None else {}

    def extra_model(self, name: str) -> Any:
        """The embedding or rerank model served under ``name``, if any."""
        for kind, names in self.extra_names.items():
            if name in names and self.embed is not None:
                return self.embed.models.get(kind)
        return None

    def model_states(self) -> dict[str, tuple[str, int]]:
        """(state, memory bytes) of every chat model, by main name (for the metrics)."""
        reg = self.registry
        return {e.name: (e.state, e.memory_bytes) for e in reg.entries()} if reg else {}

    @property
    def model_names(self) -> list[str]:
        """Every chat model's listed names."""
        reg = self.registry
        return [n for e in reg.entries() for n in e.served_names] if reg is not None else []


# --- lookups the routes make ---------------------------------------------------


def check_model(state: ServerState, name: str, names: list[str] | None = None) -> None:
    """404 unless ``name`` is one of ``names`` (default: a chat model's, see
    `ModelRegistry.resolve`, or a LoRA adapter's)."""
    if names is None:
        if state.adapters.get(name) is not None:
            return
        assert state.registry is not None
        state.registry.resolve(name)
        return
    if name not in names:
        raise ApiError(
            404,
            f"The model '{name}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


async def use_model(state: ServerState, name: str, *, keep_alive: float | None = None) -> LiveModel:
    """The chat model ``name`` means, loaded (`ModelRegistry.acquire`: 404, or 503 while
    it loads too long). A LoRA adapter's name gives its base model, whose engine runs
    the request with the adapter (`Adapters.acquire`): every route comes through here,
    so adapters are resolved before the registry."""
    assert state.registry is not None
    adapter = state.adapters.get(name)
    if adapter is not None:
        return await state.adapters.acquire(state.registry, adapter, keep_alive=keep_alive)
    return await state.registry.acquire(name, keep_alive=keep_alive)


def require_engine(live: LiveModel) -> tuple[EngineClient, LoadedModel]:
    engine, loaded = live.engine, live.loaded
    if engine is None or loaded is None or not engine.ready:
        raise server_error("The model is not ready; try again shortly.", "model_not_ready", 503)
    return engine, loaded


def require_extra_model(
    state: ServerState, kind: Kind, name: str | None
) -> tuple[EmbedWorker, ServedModel]:
    """The embedding or rerank model a request names (None: the only one served)."""
    names = state.extra_names.get(kind, [])
    if not names:
        raise ApiError(
            404,
            f"This server serves no {kind} model (start it with --{kind}-model).",
            param="model",
            code="model_not_found",
        )
    if name is not None:
        check_model(state, name, names)
    worker = state.embed
    if worker is None or not worker.ready or kind not in worker.models:
        raise server_error(
            f"The {kind} model is not ready; try again shortly.", "model_not_ready", 503
        )
    return worker, worker.models[kind]
