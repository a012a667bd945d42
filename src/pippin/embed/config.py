"""Settings of the embedding and rerank models (filled from the CLI)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EmbedSettings:
    # Local folder or Hub id; None: not served.
    embedding_model: str | None = None
    embedding_names: list[str] = field(default_factory=list)
    rerank_model: str | None = None
    rerank_names: list[str] = field(default_factory=list)
    # Inputs past the model's length: cut (True) or refused with a 400 (False).
    auto_truncate: bool = False
    # Matryoshka widths for the embedding model: None from config.json, () any width.
    matryoshka: tuple[int, ...] | None = None
    # Padded tokens in one forward pass (rows x bucketed length), and rows per pass.
    max_batch_tokens: int = 8192
    max_batch_size: int = 128

    @property
    def enabled(self) -> bool:
        return bool(self.embedding_model or self.rerank_model)
