"""The app's lifespan: before the server accepts requests it starts the registry (which
loads the pinned chat models in a worker thread, so the loop stays free, and starts their
engines), then the embedding/rerank, TTS and Whisper models, the MCP servers and the warm
prompts; it stops them all on exit."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI

from pippin import heap
from pippin.serving.state import ServerState

log = logging.getLogger("pippin.server")


async def start_extra_models(state: ServerState) -> None:
    """Load the embedding and rerank models onto their worker thread and name them."""
    from pippin.embed.models import LoadOptions
    from pippin.embed.worker import EmbedWorker
    from pippin.store.loader import ModelLoadError

    s = state.settings
    opts = LoadOptions(
        dtype=s.dtype,
        trust_remote_code=s.trust_remote_code,
        revision=s.revision,
        truncate=s.embed.auto_truncate,
        matryoshka=s.embed.matryoshka,
    )
    worker = EmbedWorker(s.embed, opts)
    await worker.start()
    state.embed = worker
    assert state.registry is not None
    taken = {n for e in state.registry.entries() for n in e.names}
    for kind, model in worker.models.items():
        wanted = s.embed.embedding_names if kind == "embedding" else s.embed.rerank_names
        names = list(wanted) or [model.name]
        clash = taken.intersection(names)
        if clash:
            raise ModelLoadError(
                f"the {kind} model's name {sorted(clash)[0]!r} is already taken by another "
                f"model; give it one with --{kind}-served-model-name"
            )
        taken.update(names)
        state.extra_names[kind] = names
        log.info("%s model '%s' ready (max %d tokens)", kind, names[0], model.max_len)


async def start_stt(state: ServerState) -> None:
    """Load the Whisper model onto its worker thread (a CTranslate2 one is converted once,
    into the cache folder)."""
    from pathlib import Path

    from pippin.audio.stt import SttWorker
    from pippin.store.gguf_loader import cache_root

    s = state.settings.stt
    assert s.model is not None
    path = Path(s.model).expanduser()
    names = s.names or [path.name, "whisper-1"]  # the name OpenAI's clients default to
    worker = SttWorker(path, names[0], cache_root())
    await worker.start()
    state.stt = worker
    state.extra_names["speech-to-text"] = names


async def start_mcp(state: ServerState) -> None:
    """Starts (or connects to) the configured MCP servers; /health waits for their first
    attempt. One that fails is reported by /v1/mcp/servers and retried with a backoff."""
    from pippin.mcp.manager import McpManager

    mcp = state.settings.mcp
    manager = McpManager(list(mcp.servers), call_timeout=mcp.call_timeout)
    state.mcp = manager
    await manager.start()
    for conn in manager.servers.values():
        log.info("MCP server %s: %s", conn.name, conn.state)


async def start_tts(state: ServerState) -> None:
    """Load the --tts-model on its worker thread and name it (its folder name by default)."""
    from pippin.audio.tts import TTSWorker
    from pippin.store.loader import ModelLoadError

    s = state.settings
    assert s.tts_model is not None
    worker = TTSWorker(s.tts_model, s.tts_names[0] if s.tts_names else None)
    await worker.start()
    state.tts = worker
    assert worker.model is not None and state.registry is not None
    names = list(s.tts_names) or [worker.model.name]
    taken = {n for e in state.registry.entries() for n in e.names}
    taken.update(n for ns in state.extra_names.values() for n in ns)
    clash = taken.intersection(names)
    if clash:
        raise ModelLoadError(
            f"the TTS model's name {sorted(clash)[0]!r} is already taken by another model; "
            "give it one with --tts-served-model-name"
        )
    state.extra_names["speech"] = names


def lifespan(
    state: ServerState, *, load_model: bool
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The lifespan of an app serving ``state``; with ``load_model=False`` it starts and
    stops nothing but the (empty) registry."""
    settings = state.settings

    @asynccontextmanager
    async def run(app: FastAPI) -> AsyncIterator[None]:
        registry = state.registry
        assert registry is not None
        try:
            if load_model:
                await registry.start()
                if settings.embed.enabled:
                    await start_extra_models(state)
                if settings.tts_model:
                    await start_tts(state)
                if settings.stt.enabled:
                    await start_stt(state)
                if settings.mcp.enabled:
                    await start_mcp(state)
                if settings.warm_prompts:
                    # Still inside the lifespan: /health answers only once they are cached.
                    from pippin.serving.warm_prompts import warm_up

                    await warm_up(app, state, settings.warm_prompts)
                heap.freeze()  # the API process's startup heap: out of the collector's scans
            yield
        finally:
            if state.mcp is not None:
                await state.mcp.stop()
            if state.embed is not None:
                await state.embed.stop()
            if state.tts is not None:
                await state.tts.stop()
            if state.stt is not None:
                await state.stt.stop()
            await registry.stop()

    return run
