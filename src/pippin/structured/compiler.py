"""Grammar specs -> constraints compiled for one model's vocabulary (llguidance).

Compiling runs in a worker thread under a timeout, so a pathological schema gets a 400
instead of holding the request (llguidance's own limits bound the work the thread does
after the timeout). Compiled grammars are cached: requests reuse their schemas.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance import LLMatcher
from mlx_lm.tokenizer_utils import TokenizerWrapper

from pippin.engine.constraint import Constraint
from pippin.structured.spec import GrammarSpec, StructuredOutputError

if TYPE_CHECKING:
    from pippin.store.loaded import LoadedModel

COMPILE_TIMEOUT_S = 10.0
_CACHE_SIZE = 128
_MAX_MESSAGE = 600


class NoTokenizer(RuntimeError):
    """The model's tokenizer cannot be read by llguidance."""


class GrammarCompiler:
    """One per served model. Also the `Vocab` the tool-call formats ask about markers."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_ids: Iterable[int],
        timeout: float = COMPILE_TIMEOUT_S,
    ) -> None:
        # mlx-lm's TokenizerWrapper holds the Hugging Face tokenizer.
        self.hf = tokenizer._tokenizer if isinstance(tokenizer, TokenizerWrapper) else tokenizer
        self.vocab = dict(self.hf.get_vocab())
        # Masks cover the logits and every token id the tokenizer knows.
        self.n_vocab = max(vocab_size, max(self.vocab.values(), default=0) + 1)
        self.eos_ids = sorted(eos_ids)
        self.timeout = timeout
        # Added tokens, special or not: the tokenizer splits them out of any text first.
        self.added = set(getattr(self.hf, "added_tokens_decoder", {}) or {})
        self._lltok: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()

    # --- Vocab ---------------------------------------------------------------

    def marker(self, text: str) -> str:
        tid = self.vocab.get(text)
        if tid is not None and tid in self.added:
            # The token by id: llguidance reads some added tokens that the tokenizer does
            # not mark special (Qwen2.5's <tool_call>) as special tokens, whose bytes never
            # match a text literal, so a literal would reject the very token the model
            # writes. Encoding the text gives that one token anyway.
            return f"<[{tid}]>"
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'

    def has_token(self, text: str) -> bool:
        return text in self.vocab

    # --- compiling -----------------------------------------------------------

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary; built on first use (about a second)."""
        with self._lock:
            if self._lltok is None:
                backend = getattr(self.hf, "backend_tokenizer", None)
                if backend is None:
                    raise NoTokenizer(
                        "Structured output needs a fast (Rust) tokenizer; this model has none."
                    )
                # As llguidance.hf.from_tokenizer does, for any transformers version.
                backend = copy.copy(backend)
                backend.no_padding()
                backend.no_truncation()
                self._lltok = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.n_vocab, eos_token=self.eos_ids or None
                )
            return self._lltok

    def build(self, spec: GrammarSpec) -> LLMatcher:
        """The compiled matcher of `spec` (blocking; cached)."""
        with self._lock:
            hit = self._cache.get(spec.grammar)
            if hit is not None:
                self._cache.move_to_end(spec.grammar)
                return hit
        m = LLMatcher(self.tokenizer(), spec.grammar, log_level=0)
        if not m.is_error():
            m.compute_bitmask()  # the first mask builds lazy tables; errors show up here too
        if m.is_error():
            msg = m.get_error()
            if len(msg) > _MAX_MESSAGE:
                msg = msg[:_MAX_MESSAGE] + "..."
            raise StructuredOutputError(spec.param, f"{spec.what} cannot be compiled: {msg}")
        m.reset()
        with self._lock:
            self._cache[spec.grammar] = m
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return m

    async def constraint(self, spec: GrammarSpec) -> Constraint:
        """Compile `spec` off the event loop; a StructuredOutputError if it cannot be."""
        try:  # once per model, not under the timeout
            await asyncio.to_thread(self.tokenizer)
        except NoTokenizer as exc:
            raise StructuredOutputError(spec.param, str(exc)) from None
        try:
            matcher = await asyncio.wait_for(asyncio.to_thread(self.build, spec), self.timeout)
        except asyncio.TimeoutError:
            raise StructuredOutputError(
                spec.param,
                f"{spec.what} took longer than {self.timeout:g} s to compile; simplify it.",
            ) from None
        return Constraint(matcher, spec.what, self.n_vocab, grammar=spec.grammar)


def serve_in_engine_process(loaded: LoadedModel) -> None:
    """In an engine process: compile the grammars of the constraints that arrive (they
    cross the pipe as their JSON text, `Constraint.__reduce__`)."""
    from pippin.engine import constraint

    grammars = GrammarCompiler(loaded.tokenizer, loaded.vocab_size, loaded.eos_token_ids)
    constraint.MATCHER_BUILDER = lambda g: grammars.build(GrammarSpec(g, "", ""))
