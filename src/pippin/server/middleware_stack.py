"""The app's middleware stack, in one place so its order can be read top to bottom.

Starlette runs the middleware added last first, so this adds them innermost first; the
classes live in `pippin.api.middleware` (CORS is Starlette's).
"""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from starlette.routing import BaseRoute

from pippin.api.middleware import (
    AdmissionMiddleware,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HeadLimitsMiddleware,
    LeaseMiddleware,
    key_check,
)
from pippin.api.ollama.blobs import BLOB_MAX_BYTES, BLOBS
from pippin.obs.http import ObservabilityMiddleware
from pippin.serving.settings import MIB
from pippin.serving.state import ServerState
from pippin.web import STATIC_PATHS


def add_middleware_stack(app: FastAPI, state: ServerState, routes: Sequence[BaseRoute]) -> None:
    """Admission, body limit, API key, CORS, head limits, model leases and observability,
    innermost first; ``routes`` name the endpoints in the metrics and request logs."""
    settings = state.settings
    # Added last = runs first: unauthenticated requests are refused before any body is read.
    app.add_middleware(AdmissionMiddleware, admission=state.admission)
    # Audio uploads have their own cap (--stt-max-bytes), plus room for the other fields.
    audio_cap = max(settings.max_request_body_bytes, settings.stt.max_bytes + MIB)
    per_path = {p: audio_cap for p in ("/v1/audio/transcriptions", "/v1/audio/translations")}
    if not settings.stt.enabled:
        per_path = {}
    if settings.model_management:
        per_path[BLOBS] = BLOB_MAX_BYTES  # model files (admin keys only, see the route)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=settings.max_request_body_bytes, per_path=per_path
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
    app.add_middleware(
        ObservabilityMiddleware,
        metrics=state.metrics,
        routes=routes,
        log_bodies=settings.log_prompts,
    )
