"""`ServerSettings`: what the CLI decided, everything the app needs besides the models."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pippin.audio.config import SttSettings
from pippin.embed.config import EmbedSettings
from pippin.engine.config import EngineConfig
from pippin.mcp.config import McpSettings
from pippin.serving.admission import ApiKey
from pippin.serving.model_specs import ModelSpec
from pippin.vision.media import MediaLimits

MIB = 1024 * 1024
KIB = 1024


@dataclass(frozen=True)
class HeadLimits:
    max_headers: int = 100
    max_header_bytes: int = 32 * KIB  # names and values of all headers together
    max_url_bytes: int = 8 * KIB  # path and query string


@dataclass(frozen=True)
class CorsSettings:
    """Cross-origin access from browsers (vLLM's flags); off unless origins are given."""

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


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
    # --stt-model and its limits: speech to text on /v1/audio/transcriptions.
    stt: SttSettings = field(default_factory=SttSettings)
    # --warm-prompts: a JSON file of prompts prefilled before the server turns ready.
    warm_prompts: str | None = None
    # --allowed-origins etc.: browsers on other origins may call the API (off by default).
    cors: CorsSettings = field(default_factory=CorsSettings)
    # --log-prompts: request and response bodies in the request log (never otherwise).
    log_prompts: bool = False
    head_limits: HeadLimits = field(default_factory=HeadLimits)
    # Admission (pippin.serving.admission): --max-queue, --api-keys, and --drain-timeout
    # (how long SIGTERM waits for requests in flight).
    max_queue: int | None = None
    api_keys: list[ApiKey] = field(default_factory=list)
    drain_timeout_s: float = 30.0
    # --mcp-config and friends: the MCP servers pippin runs tools on.
    mcp: McpSettings = field(default_factory=McpSettings)
    # Several chat models (--model repeated, --models FILE); empty: the one above.
    models: list[ModelSpec] = field(default_factory=list)
    # --model-alias PATTERN=MODEL: request names matching PATTERN go to MODEL.
    model_aliases: list[tuple[str, str]] = field(default_factory=list)
    # --memory-budget: bytes the loaded chat models may take (weights + KV pools).
    memory_budget: int | None = None
    # --idle-ttl: seconds an on-demand model (a library model too) stays loaded idle.
    idle_ttl: float | None = None
    # --model-load-timeout: how long a request waits for its model to load.
    model_load_timeout: float = 300.0
    # --limit-mm-per-prompt, --allowed-local-media-path and friends: what images and
    # videos a request may bring and where from (pippin.vision.media).
    media: MediaLimits = field(default_factory=MediaLimits)
    # --tts-model: a text-to-speech model for /v1/audio/speech (mlx-audio), and its names.
    tts_model: str | None = None
    tts_names: list[str] = field(default_factory=list)
    # --models-dir (repeatable): the first holds the models pulled and created through the
    # server (`pippin.store.library`); paths a request names (a create's source, a LoRA
    # adapter) must lie inside one of them. Empty: the default library folder only.
    models_dirs: list[str] = field(default_factory=list)
    # --disable-model-management: /api/pull, /api/create, /api/copy, /api/delete,
    # /api/blobs and the LoRA routes answer 403.
    model_management: bool = True
    # --lora-modules NAME=PATH (vLLM's flag): adapters served as models on their base.
    lora_modules: list[tuple[str, str]] = field(default_factory=list)

    @property
    def library_dir(self) -> str:
        from pippin.store.library import default_root

        return self.models_dirs[0] if self.models_dirs else str(default_root())

    def model_specs(self) -> list[ModelSpec]:
        """The chat models: ``models``, else the one model (loaded at start-up)."""
        if self.models:
            return self.models
        return [ModelSpec(model=self.model, names=list(self.served_model_names), preload=True)]
