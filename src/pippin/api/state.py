"""The server's shared state, and the lookups every route makes in it.

`ServerSettings` is what the CLI decided; `ServerState` is filled in by the lifespan once
the model is loaded and reached by the routes through ``app.state.pippin``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from pippin import __version__
from pippin.api.admission import Admission, ApiKey
from pippin.api.errors import OpenAIError, server_error
from pippin.api.http_limits import CorsSettings, HeadLimits
from pippin.api.limits import Limits, merge_defaults
from pippin.api.logprobs import TokenRenderer
from pippin.chat import generic_tools
from pippin.chat.output import ParserChoice
from pippin.chat.template import TemplateInfo, inspect_template
from pippin.embed.config import EmbedSettings
from pippin.engine.client import EngineClient
from pippin.engine.config import EngineConfig
from pippin.obs.metrics import Metrics
from pippin.obs.observer import ServerObserver
from pippin.store.loaded import LoadedModel
from pippin.structured.compiler import GrammarCompiler

if TYPE_CHECKING:
    from pippin.embed.models import Kind, ServedModel
    from pippin.embed.worker import EmbedWorker

log = logging.getLogger("pippin.server")

MIB = 1024 * 1024


@dataclass
class ServerSettings:
    """What the CLI decided; everything the app needs besides the model itself."""

    # Local folder, GGUF file or Hub id; None: the default model.
    model: str | None = None
    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    dtype: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    max_request_body_bytes: int = 16 * MIB
    engine: EngineConfig = field(default_factory=EngineConfig)
    # Run the engine in a process of its own (--engine-process): its own GIL.
    engine_process: bool = False
    # --default-temperature etc.: above the model's defaults, below the request.
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_call_parser: str = "auto"  # a parser name, "auto" or "none"
    reasoning_parser: str = "auto"
    # Serve Prometheus metrics on /metrics (--no-metrics turns them off).
    metrics: bool = True
    # Optional embedding and rerank models served beside the chat model.
    embed: EmbedSettings = field(default_factory=EmbedSettings)
    # --warm-prompts: a JSON file of prompts prefilled before the server turns ready.
    warm_prompts: str | None = None
    # --allowed-origins etc.: browsers on other origins may call the API (off by default).
    cors: CorsSettings = field(default_factory=CorsSettings)
    # --log-prompts: request and response bodies in the request log (never otherwise).
    log_prompts: bool = False
    head_limits: HeadLimits = field(default_factory=HeadLimits)
    # Admission (pippin.api.admission): --max-queue, --api-keys, and --drain-timeout
    # (how long SIGTERM waits for requests in flight).
    max_queue: int | None = None
    api_keys: list[ApiKey] = field(default_factory=list)
    drain_timeout_s: float = 30.0


@dataclass
class ServerState:
    """Shared by the routes through ``app.state.pippin``; filled in by the lifespan."""

    settings: ServerSettings
    model_names: list[str] = field(default_factory=list)
    loaded: LoadedModel | None = None
    engine: EngineClient | None = None
    limits: Limits | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    template: TemplateInfo | None = None
    template_source: str = ""
    parsers: ParserChoice | None = None
    # The parsers of a request whose tools the template cannot show (chat/generic_tools).
    generic_parsers: ParserChoice | None = None
    grammars: GrammarCompiler | None = None  # structured output for this model
    token_renderer: Any = None
    fingerprint: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: Metrics | None = None
    observer: ServerObserver = field(default_factory=lambda: ServerObserver(None))
    admission: Admission = field(default_factory=Admission)

    def engine_stats(self) -> dict[str, int]:
        return self.engine.stats() if self.engine is not None else {}

    # The embedding/rerank worker and the names of its models, by kind.
    embed: Any = None
    extra_names: dict[str, list[str]] = field(default_factory=dict)

    def extra_model(self, name: str) -> Any:
        """The embedding or rerank model served under ``name``, if any."""
        for kind, names in self.extra_names.items():
            if name in names and self.embed is not None:
                return self.embed.models.get(kind)
        return None

    def attach(self, loaded: LoadedModel, engine: EngineClient) -> None:
        s = self.settings
        self.loaded, self.engine = loaded, engine
        self.model_names = list(s.served_model_names) or [loaded.name]
        self.limits = Limits(
            max_model_len=engine.max_model_len,
            vocab_size=loaded.vocab_size,
            max_tokens_cap=s.engine.max_tokens_cap,
        )
        self.defaults = merge_defaults(loaded.generation_defaults, s.sampling_overrides)
        self.template = inspect_template(loaded.tokenizer)
        tmpl = getattr(loaded.tokenizer, "chat_template", None)
        self.template_source = str(tmpl or "")
        self.token_renderer = TokenRenderer(loaded.tokenizer)
        model_type = str(loaded.config.get("model_type", ""))

        def parsers(tool_parser: str) -> ParserChoice:
            return ParserChoice.for_model(
                loaded.tokenizer, model_type, self.template_source, tool_parser, s.reasoning_parser
            )

        self.parsers = parsers(s.tool_call_parser)
        if self.parsers.tool is not None:
            self.parsers.tool.prepare()
        self.generic_parsers = parsers(generic_tools.PARSER)
        log.info(
            "output parsers: tool calls %s, reasoning %s",
            self.parsers.tool.name if self.parsers.tool else "none",
            self.parsers.reasoning.name if self.parsers.reasoning else "none",
        )
        self.grammars = GrammarCompiler(
            loaded.tokenizer, self.limits.vocab_size, loaded.eos_token_ids
        )
        # Changes whenever what produces the tokens changes (OpenAI's meaning).
        ident = (
            f"{__version__}|{loaded.source}|{loaded.dtype}|{s.engine.block_size}"
            f"|{s.engine.kv_bits}|{s.engine.kv_group_size}"
        )
        self.fingerprint = "fp_" + hashlib.sha256(ident.encode()).hexdigest()[:10]


# --- lookups the routes make ---------------------------------------------------


def get_state(request: Request) -> ServerState:
    return request.app.state.pippin


def check_model(state: ServerState, name: str, names: list[str] | None = None) -> None:
    """404 unless ``name`` is one of ``names`` (default: the chat model's names)."""
    if name not in (state.model_names if names is None else names):
        raise OpenAIError(
            404,
            f"The model '{name}' does not exist or you do not have access to it.",
            param="model",
            code="model_not_found",
        )


def require_engine(state: ServerState) -> tuple[EngineClient, LoadedModel]:
    engine, loaded = state.engine, state.loaded
    if engine is None or loaded is None or not engine.ready:
        raise server_error("The model is not ready; try again shortly.", "model_not_ready", 503)
    return engine, loaded


def require_extra_model(
    state: ServerState, kind: Kind, name: str | None
) -> tuple[EmbedWorker, ServedModel]:
    """The embedding or rerank model a request names (None: the only one served)."""
    names = state.extra_names.get(kind, [])
    if not names:
        raise OpenAIError(
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
