"""The one seam between the HTTP front and the engine: the `EngineClient` protocol.

The front holds an `EngineClient` and nothing else of the engine. Two implement it:
`InprocClient` (the engine on a thread of this process) and `ProcessClient` (the engine
in a process of its own, over a pipe). Both are built by composition from the same
parts: `OutputStreams` on the event loop side and `EngineLoop` on the engine side.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from pippin.engine.types import EngineError, RequestOutput, SamplingParams

__all__ = ["SLEEP_TAGS", "EngineClient", "EngineError"]

# What sleep mode puts to sleep and wakes (vLLM's tags of /wake_up).
SLEEP_TAGS = frozenset({"weights", "kv_cache"})


class EngineClient(Protocol):
    async def start(self) -> None:
        """Start the engine (load, build the pools) and return once it takes requests.
        Raises if it cannot start; the error says why."""

    async def stop(self) -> None:
        """Stop the engine. Streams still open end with an output whose ``error`` says the
        server is shutting down; the SSD tier's pending blocks are written first."""

    @property
    def ready(self) -> bool:
        """True once started and while the engine runs (its thread or process alive)."""

    @property
    def max_model_len(self) -> int:
        """The context limit in tokens (prompt plus output); valid once ``ready``."""

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``EngineError`` if the engine cannot take this request (empty prompt, a
        prompt that does not fit the context). Cheap; runs on the event loop."""

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs as deltas; the last has ``finished=True``.

        A request the engine cannot take raises ``EngineError`` on the first iteration
        (so does a ``request_id`` already in use, or an engine that is not running).
        Leaving the iteration early (client gone, ``aclose()``, task cancelled) aborts
        the request; its KV blocks are freed at the next step. An engine failure ends
        the stream with an output whose ``error`` is set, never with a hang. A reader
        that falls behind gets what queued up merged into one delta. The front's own
        limits end a stream the same way, with ``error_kind`` set: "timeout" (past
        ``EngineConfig.request_timeout_s``) or "slow_reader" (a reader that left
        ``streams.MAX_BUFFERED`` deliveries unread); both abort the request."""

    def abort(self, request_id: str) -> None:
        """End the request at the next step (its stream gets a finished ``abort``
        output). Unknown ids are ignored. Thread-safe; never blocks."""

    def stats(self) -> dict[str, int]:
        """Counters as of the last step: running, waiting, blocks_total, blocks_free,
        block_size, ... Cheap; never waits for the engine."""

    async def cache_stats(self) -> dict[str, Any]:
        """The prefix cache's tiers (memory, SSD), read between two steps."""

    async def clear_cache(self, tier: str | None = None) -> dict[str, int]:
        """Drop the prefix cache's unreferenced blocks from ``tier`` ("memory", "ssd",
        or both when None), between two steps; returns what was dropped."""

    @property
    def loras(self) -> dict[str, str]:
        """The LoRA adapters loaded, name → path (as `add_lora` was given them)."""

    async def add_lora(self, name: str, path: str) -> dict[str, Any]:
        """Load the LoRA adapter folder at ``path`` (mlx-lm or PEFT) between two steps;
        requests whose ``SamplingParams.lora`` is ``name`` then run with it, in batches
        with any others. The same name and adapter again is a no-op. Raises
        ``EngineError`` (one line) for an adapter the model cannot take. An engine
        process that restarts loads its adapters again."""

    async def remove_lora(self, name: str) -> None:
        """Stop serving ``name`` between two steps. Raises ``EngineError`` while a
        request (waiting or running) uses it, or if it is not loaded; nothing changes
        then."""

    async def sleep(self, tags: frozenset[str], abort: bool) -> None:
        """Put ``tags`` to sleep between two steps (`pippin.engine.sleep`): "kv_cache"
        frees the KV pool (the prefix cache in memory empties), "weights" moves the
        weights to host memory on a GPU. With ``abort`` the running requests end first
        (their streams with an ``error``); without, ``EngineError`` while any runs.
        Requests are refused until `wake_up` has brought every tag back."""

    async def wake_up(self, tags: frozenset[str]) -> None:
        """Bring ``tags`` back from sleep (a tag awake already is a no-op)."""
