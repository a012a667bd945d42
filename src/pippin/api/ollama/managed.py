"""What the model-management routes share: their OpenAPI entries (Ollama's, plus the 403
a request gets that may not manage models, and the answers without a body), and the model
a name means exactly."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pippin.api.ollama.served import chat_entry
from pippin.api.openapi import OllamaErrorBody, ollama_route
from pippin.serving.registry import ModelEntry
from pippin.serving.state import ServerState

FORBIDDEN = (
    "Model management is turned off (--disable-model-management), or the API key is not "
    "an admin key."
)


def managed_route(
    body: type[BaseModel] | None = None,
    *,
    stream: bool = False,
    empty: dict[int, str] | None = None,
) -> dict[str, Any]:
    """`ollama_route` with the 403; ``empty``: success statuses answered without a body."""
    kwargs = ollama_route(body, stream=stream)
    responses = kwargs["responses"]
    responses[403] = {"description": FORBIDDEN, "model": OllamaErrorBody}
    if empty:
        del responses[200]
        responses.update({status: {"description": text} for status, text in empty.items()})
    return kwargs


def named_entry(state: ServerState, name: str) -> ModelEntry | None:
    """The chat model ``name`` names itself (``x`` and ``x:latest`` alike), never one an
    alias pattern (``claude-*``) or ``default`` leads to."""
    entry = chat_entry(state, name)
    if entry is None or not {name, name.removesuffix(":latest")} & set(entry.names):
        return None
    return entry
