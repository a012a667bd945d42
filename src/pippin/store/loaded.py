"""A model ready to serve: weights, tokenizer and the model's own defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn
from mlx_lm.tokenizer_utils import TokenizerWrapper


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: TokenizerWrapper
    # The model's config.json (or the equivalent built from GGUF metadata).
    config: dict[str, Any]
    # Where it came from: a local path, a GGUF file or a Hub id.
    source: str
    # Default name under which /v1/models lists it.
    name: str
    # Sampling defaults from generation_config.json, in SamplingParams field
    # names (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens).
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    eos_token_ids: set[int] = field(default_factory=set)
    # The model's own context length (max_position_embeddings or GGUF's context_length).
    max_position_embeddings: int | None = None
    dtype: str = "float32"
    # A vision-language model's vision tower and processor (pippin.vision.load.VisionParts).
    vision: Any = None

    @property
    def vocab_size(self) -> int:
        """Width of the logits (token ids must be below it); the config knows it best."""
        cfg = self.config
        for c in (cfg, cfg.get("text_config") or {}):
            v = c.get("vocab_size")
            if isinstance(v, int) and v > 0:
                return v
        return len(self.tokenizer)


class ModelLoadError(Exception):
    """A model could not be found, read or built; the message is one line."""
