"""The app factory: settings, shared state, middleware, routes and the lifespan.

The lifespan loads the pinned chat models through the registry (in a worker thread, so
the loop stays free) and starts their engines before the server accepts requests, then
the embedding/rerank models; it stops them all on exit.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware

from pippin import __version__
from pippin.api import cache_control, mcp_routes, rerank, status
from pippin.api.anthropic import messages as anthropic_messages
from pippin.api.errors import install_error_handlers
from pippin.api.middleware import (
    AdmissionMiddleware,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HeadLimitsMiddleware,
    LeaseMiddleware,
    key_check,
)
from pippin.api.ollama import chat as ollama_chat
from pippin.api.ollama import embed as ollama_embed
from pippin.api.ollama import models as ollama_models
from pippin.api.openai import chat as openai_chat
from pippin.api.openai import completions as openai_completions
from pippin.api.openai import embeddings as openai_embeddings
from pippin.api.openai import models as openai_models
from pippin.api.openai import responses as openai_responses
from pippin.api.openai import speech as openai_speech
from pippin.api.openai import transcriptions as openai_transcriptions
from pippin.api.openapi import install_openapi, openai_route
from pippin.obs.http import ObservabilityMiddleware
from pippin.obs.metrics import CONTENT_TYPE, Metrics
from pippin.serving.admission import Admission
from pippin.serving.registry import ModelRegistry
from pippin.serving.state import MIB, ServerSettings, ServerState
from pippin.web import STATIC_PATHS
from pippin.web import router as web_router

log = logging.getLogger("pippin.server")


# --- middleware ---------------------------------------------------------------


# --- app ------------------------------------------------------------------------


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


def create_app(settings: ServerSettings, *, load_model: bool = True) -> FastAPI:
    """The ASGI app. With ``load_model=False`` no model is loaded (routes answer 503),
    which is how request validation is tested without an engine."""
    state = ServerState(
        settings, admission=Admission(max_queue=settings.max_queue, keys=settings.api_keys)
    )
    if settings.metrics:
        state.metrics = Metrics(state.engine_stats, state.model_states)
    state.registry = ModelRegistry(
        settings, settings.model_specs(), metrics=state.metrics, enabled=load_model
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            if load_model:
                await state.registry.start()
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
            await state.registry.stop()

    app = FastAPI(title="pippin", version=__version__, lifespan=lifespan)
    app.state.pippin = state
    install_error_handlers(app)
    install_openapi(app)
    routers = (
        openai_models.router,
        status.router,
        openai_chat.router,
        openai_completions.router,
        anthropic_messages.router,
        openai_responses.router,
        openai_embeddings.router,
        openai_speech.router,
        openai_transcriptions.router,
        rerank.router,
        ollama_chat.router,
        ollama_embed.router,
        ollama_models.router,
        cache_control.router,
        mcp_routes.router,
        web_router,
    )
    for router in routers:
        app.include_router(router)
    if state.metrics is not None:
        metrics = state.metrics

        @app.get("/metrics", response_class=Response, **openai_route(media=("text/plain",)))
        async def prometheus_metrics(_: Request) -> Response:
            return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    # Added last = runs first: unauthenticated requests are refused before any body is read.
    app.add_middleware(AdmissionMiddleware, admission=state.admission)
    # Audio uploads have their own cap (--stt-max-bytes), plus room for the other fields.
    audio_cap = max(settings.max_request_body_bytes, settings.stt.max_bytes + MIB)
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_request_body_bytes,
        per_path={p: audio_cap for p in ("/v1/audio/transcriptions", "/v1/audio/translations")}
        if settings.stt.enabled
        else None,
    )
    app.add_middleware(
        ApiKeyMiddleware,
        api_key=settings.api_key,
        open_paths=frozenset({"/health"}),
        other_keys=key_check(state.admission) if settings.api_keys else None,
        page_paths=STATIC_PATHS,
    )
    cors = settings.cors
    if cors.allowed_origins:  # outside the key check: preflights carry no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
        )
    app.add_middleware(HeadLimitsMiddleware, limits=settings.head_limits)
    # Holds the models a request uses until its response is sent.
    app.add_middleware(LeaseMiddleware, registry=lambda: state.registry)
    # Outermost: counts and logs every request, the refused ones too.
    routes = [route for router in routers for route in router.routes]
    app.add_middleware(
        ObservabilityMiddleware,
        metrics=state.metrics,
        routes=routes,
        log_bodies=settings.log_prompts,
    )
    return app
