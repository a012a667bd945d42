"""The engine as the HTTP front sees it: submit a request, iterate its outputs."""

from __future__ import annotations

from collections.abc import AsyncIterator

from pippin.engine.config import EngineConfig
from pippin.engine.types import RequestOutput, SamplingParams
from pippin.store.loaded import LoadedModel


class EngineError(Exception):
    """A request the engine could not take (e.g. its prompt does not fit)."""


class AsyncEngine:
    """Owns the one MLX thread; the event loop only talks to it through queues.

    Interface (stable; the HTTP front relies on it):
    - ``AsyncEngine(loaded, config)``; ``await start()``; ``await stop()``.
    - ``ready``: True once the model is loaded and the engine thread runs.
    - ``max_model_len``: the context limit in tokens.
    - ``generate(prompt_token_ids, params, request_id)``: async iterator of
      ``RequestOutput`` deltas; the last one has ``finished=True``. Leaving the
      iteration early (client gone, ``aclose()``, task cancelled) aborts the
      request; its KV blocks are freed at the next step. An engine failure ends
      the stream with an output whose ``error`` is set.
    - ``abort(request_id)``.
    - ``stats()``: dict with running, waiting, blocks_total, blocks_free, ...
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    @property
    def ready(self) -> bool:
        raise NotImplementedError

    @property
    def max_model_len(self) -> int:
        raise NotImplementedError

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        raise NotImplementedError
