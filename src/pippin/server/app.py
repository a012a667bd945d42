"""The app factory: settings, shared state, routes, `/metrics`, the lifespan and the
middleware stack."""

from __future__ import annotations

from fastapi import FastAPI, Request, Response

from pippin import __version__
from pippin.api import cache_control, mcp_routes, rerank, sleep_mode, status
from pippin.api.anthropic import messages as anthropic_messages
from pippin.api.errors import install_error_handlers
from pippin.api.ollama import chat as ollama_chat
from pippin.api.ollama import embed as ollama_embed
from pippin.api.ollama import manage as ollama_manage
from pippin.api.ollama import models as ollama_models
from pippin.api.ollama import pull as ollama_pull
from pippin.api.openai import chat as openai_chat
from pippin.api.openai import completions as openai_completions
from pippin.api.openai import embeddings as openai_embeddings
from pippin.api.openai import lora as openai_lora
from pippin.api.openai import models as openai_models
from pippin.api.openai import responses as openai_responses
from pippin.api.openai import speech as openai_speech
from pippin.api.openai import tokenize as openai_tokenize
from pippin.api.openai import transcriptions as openai_transcriptions
from pippin.api.openapi import install_openapi, openai_route
from pippin.obs.metrics import CONTENT_TYPE, Metrics
from pippin.server.lifespan import lifespan
from pippin.server.middleware_stack import add_middleware_stack
from pippin.serving.admission import Admission
from pippin.serving.registry import ModelRegistry
from pippin.serving.settings import ServerSettings
from pippin.serving.state import ServerState
from pippin.web import router as web_router


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

    app = FastAPI(
        title="pippin", version=__version__, lifespan=lifespan(state, load_model=load_model)
    )
    app.state.pippin = state
    install_error_handlers(app)
    install_openapi(app)
    routers = (
        openai_models.router,
        openai_lora.router,
        status.router,
        openai_chat.router,
        openai_completions.router,
        openai_tokenize.router,
        anthropic_messages.router,
        openai_responses.router,
        openai_embeddings.router,
        openai_speech.router,
        openai_transcriptions.router,
        rerank.router,
        ollama_chat.router,
        ollama_embed.router,
        ollama_models.router,
        ollama_pull.router,
        ollama_manage.router,
        cache_control.router,
        sleep_mode.router,
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

    add_middleware_stack(app, state, [route for router in routers for route in router.routes])
    return app
