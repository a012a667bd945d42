"""`LiveModel`: one loaded chat model and what the routes need of it.

Its engine, its `LoadedModel`, its limits and sampling defaults, template info, output
parsers, grammar compiler, token renderer and fingerprint. The registry
(`pippin.serving.registry`) builds one per model when it loads; every chat-shaped route gets
its `LiveModel` from the registry by the request's ``model`` field.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pippin import __version__
from pippin.chat import generic_tools
from pippin.chat.output import ParserChoice
from pippin.chat.template import TemplateInfo, inspect_template
from pippin.engine.client import EngineClient
from pippin.obs.observer import ServerObserver
from pippin.serving.limits import Limits, merge_defaults
from pippin.serving.logprobs import TokenRenderer
from pippin.store.default_model import describe_sampling
from pippin.store.loaded import LoadedModel
from pippin.structured.compiler import GrammarCompiler

if TYPE_CHECKING:
    from pippin.serving.settings import ServerSettings

log = logging.getLogger("pippin.server")


@dataclass
class LiveModel:
    """A chat model being served. ``model_names`` are its names (the first is the one
    responses carry); ``settings`` the server's (shared by every model)."""

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
    observer: ServerObserver = field(default_factory=lambda: ServerObserver(None))
    # A library model's SYSTEM and MESSAGE (Ollama's Modelfile), see `with_preset`.
    system: str | None = None
    preset: list[dict[str, Any]] = field(default_factory=list)

    def with_preset(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """A request's messages as the model's template sees them: after the model's own
        conversation, with the model's system prompt first unless the request has one
        (Ollama's order, the request's system message kept first)."""
        if not self.system and not self.preset:
            return messages
        head: list[dict[str, Any]] = []
        if messages and messages[0].get("role") == "system":
            head, messages = [messages[0]], messages[1:]
        elif self.system:
            head = [{"role": "system", "content": self.system}]
        return [*head, *self.preset, *messages]

    def sampling_defaults(self) -> dict[str, Any]:
        """What a request that leaves them out samples with (max_tokens aside)."""
        shown = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        return {k: self.defaults[k] for k in shown if k in self.defaults}

    def attach(
        self,
        loaded: LoadedModel,
        engine: EngineClient,
        *,
        sampling: dict[str, Any] | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        """Fill in everything derived from the model, once its engine runs. ``sampling``
        (the model's own defaults from --models) goes above the server's --default-*."""
        s = self.settings
        self.loaded, self.engine = loaded, engine
        self.model_names = self.model_names or [loaded.name]
        self.limits = Limits(
            max_model_len=engine.max_model_len,
            vocab_size=loaded.vocab_size,
            max_tokens_cap=s.engine.max_tokens_cap,
            priorities=s.engine.scheduling_policy == "priority",
        )
        overrides = {**s.sampling_overrides, **(sampling or {})}
        self.defaults = merge_defaults(loaded.generation_defaults, overrides)
        # What a request that sets no sampling field gets: a surprise here (temperature 1.0
        # on a small model) reads as a bad model, so it is said once, at load.
        log.info(
            "model '%s' sampling defaults: %s",
            self.model_names[0],
            describe_sampling(self.sampling_defaults()),
        )
        self.template = inspect_template(loaded.tokenizer)
        tmpl = getattr(loaded.tokenizer, "chat_template", None)
        self.template_source = str(tmpl or "")
        self.token_renderer = TokenRenderer(loaded.tokenizer)
        model_type = str(loaded.config.get("model_type", ""))
        reasoning = reasoning_parser or s.reasoning_parser

        def parsers(tool_parser: str) -> ParserChoice:
            return ParserChoice.for_model(
                loaded.tokenizer, model_type, self.template_source, tool_parser, reasoning
            )

        self.parsers = parsers(tool_call_parser or s.tool_call_parser)
        if self.parsers.tool is not None:
            self.parsers.tool.prepare()
        self.generic_parsers = parsers(generic_tools.PARSER)
        log.info(
            "model '%s' output parsers: tool calls %s, reasoning %s",
            self.model_names[0],
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
