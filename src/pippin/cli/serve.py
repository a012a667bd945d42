"""`pippin serve`: from its flags to a running server, after checking that the models can
be found (a wrong one is one line on stderr and exit code 3)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from pippin.cli.audio_flags import tts_problem
from pippin.cli.settings import settings_from_args

if TYPE_CHECKING:
    from pippin.serving.state import ServerState

log = logging.getLogger("pippin.cli")


def ready_line(host: str, port: int, state: ServerState) -> str:
    """The one line that says where to go once the server answers: the page, the API and
    the models (the first is the default)."""
    # A wildcard address is not one to browse to; this machine's loopback is.
    shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    base = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
    names = [e.name for e in state.registry.entries()] if state.registry is not None else []
    models = f"model {names[0]}" if len(names) == 1 else f"models {', '.join(names)}"
    key = " · API key required" if state.settings.api_key or state.settings.api_keys else ""
    return (
        f"pippin ready: {base}/ (page) · API {base}/v1 (OpenAI, Anthropic), {base}/api "
        f"(Ollama) · {models}{key}"
    )


def serve(args: argparse.Namespace) -> int:
    if args.offline:
        os.environ["HF_HUB_OFFLINE"] = "1"  # read by huggingface_hub when it is imported
    from pippin.obs.logs import setup_logging
    from pippin.server.app import create_app
    from pippin.serving import drain

    level = "debug" if args.log_level == "trace" else args.log_level
    setup_logging(level, args.log_format)
    settings = settings_from_args(args)
    open_to_all = settings.api_key is None and not settings.api_keys
    if open_to_all and args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "listening on %s without --api-key: anyone who can reach it can use it", args.host
        )
    from pippin.embed.models import resolve_served
    from pippin.store.loader import ModelLoadError, resolve_spec

    # Found (or downloaded) before the server starts: a wrong name or path is then one
    # clear line, not the traceback of a failed application startup.
    served = (("embedding", args.embedding_model), ("rerank", args.rerank_model))
    what = "the model"
    try:
        for model in settings.model_specs():
            what = f"the model {model.model}" if settings.models else "the model"
            resolve_spec(model.model, settings.revision)
        for kind, spec in served:
            if spec:
                what = f"the {kind} model"
                resolve_served(spec, kind, settings.revision)
        if args.stt_model and not Path(args.stt_model).expanduser().is_dir():
            what = "the speech-to-text model"
            raise ModelLoadError(f"{args.stt_model}: not a model folder")
    except ModelLoadError as e:
        print(f"pippin serve: cannot load {what}: {e}", file=sys.stderr)
        return 3
    if args.tts_model:
        problem = tts_problem(args.tts_model)
        if problem:
            print(f"pippin serve: cannot load the TTS model: {problem}", file=sys.stderr)
            return 3
    from pippin.serving.model_specs import SpecError

    try:
        app = create_app(settings)
    except SpecError as e:
        print(f"pippin serve: {e}", file=sys.stderr)
        return 2
    if settings.api_keys:
        from pippin.serving.admission import describe

        log.info("API keys from --api-keys: %s", describe(settings.api_keys))
    state = app.state.pippin
    started = drain.serve(
        app,
        state,
        on_ready=lambda: log.info("%s", ready_line(args.host, args.port, state)),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        log_config=None,  # uvicorn's loggers go through ours (and its --log-format)
        access_log=False,  # replaced by pippin's own line per request (pippin.request)
        # Requests were drained already (--drain-timeout); what is left is idle connections.
        timeout_graceful_shutdown=10,
    )
    return 0 if started else 3
