"""The embedding worker: one thread that owns the embedding and rerank models and runs
every forward pass for them, batching requests of all clients together.

Requests hand in a list of ``Item``s and await a future. The thread takes pending items
in arrival order, up to a round of ``4 x max_batch_tokens`` tokens, sorts the round by
length and cuts it into batches of at most ``max_batch_tokens`` padded tokens and
``max_batch_size`` rows, each padded (right) to a length bucket, so the shapes repeat and
little is spent on padding. A request that arrives during a round waits for that round
only, however large the requests before it. One forward pass is bounded by the token
budget, so the chat engine's thread, which runs beside this one, is never held up long on
a shared device.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from pippin.embed.config import EmbedSettings
from pippin.embed.inputs import Item
from pippin.embed.models import Kind, LoadOptions, ServedModel, load_served_model

log = logging.getLogger(__name__)

_ROUND_BATCHES = 4


def bucket(n: int) -> int:
    """Padded length for a batch whose longest row has ``n`` tokens."""
    step = 16 if n <= 128 else 64 if n <= 1024 else 256
    return -(-n // step) * step


@dataclass
class _Job:
    model: ServedModel
    items: list[Item]
    future: asyncio.Future[np.ndarray]
    left: int = 0
    out: np.ndarray | None = None
    cancelled: bool = False


@dataclass
class _Pending:
    job: _Job
    index: int

    @property
    def length(self) -> int:
        return len(self.job.items[self.index].ids)


@dataclass
class EmbedWorker:
    settings: EmbedSettings
    options: LoadOptions
    models: dict[Kind, ServedModel] = field(default_factory=dict)
    _inbox: queue.SimpleQueue[_Job | None] = field(default_factory=queue.SimpleQueue)
    _thread: threading.Thread | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _started: threading.Event = field(default_factory=threading.Event)
    _error: BaseException | None = None
    _running: bool = False

    async def start(self) -> None:
        """Load the models on the worker thread (their arrays live on its stream)."""
        self._loop = asyncio.get_running_loop()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="pippin-embed", daemon=True)
        self._thread.start()
        await asyncio.to_thread(self._started.wait)
        if self._error is not None:
            raise self._error

    async def stop(self) -> None:
        self._running = False
        self._inbox.put(None)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    @property
    def ready(self) -> bool:
        return self._running and self._thread is not None and self._thread.is_alive()

    async def run(self, model: ServedModel, items: list[Item]) -> np.ndarray:
        """One output row per item: a vector (embedders) or a score (rerankers)."""
        assert self._loop is not None
        job = _Job(model, items, self._loop.create_future(), left=len(items))
        self._inbox.put(job)
        try:
            return await job.future
        finally:
            job.cancelled = True  # a client gone: its remaining items are skipped

    # -- worker thread ------------------------------------------------------
    def _run(self) -> None:
        stream = mx.new_stream(mx.default_device())
        with mx.stream(stream):
            try:
                self._load()
            except BaseException as e:  # reported to start()
                self._error = e
                self._running = False
                self._started.set()
                return
            self._started.set()
            pending: deque[_Pending] = deque()
            while self._running:
                if not pending:
                    mx.clear_cache()
                self._drain(pending, block=not pending)
                if pending:
                    self._round(pending)

    def _load(self) -> None:
        s = self.settings
        if s.embedding_model:
            self.models["embedding"] = load_served_model(
                s.embedding_model, "embedding", self.options
            )
        if s.rerank_model:
            self.models["rerank"] = load_served_model(s.rerank_model, "rerank", self.options)

    def _drain(self, pending: deque[_Pending], block: bool) -> None:
        while True:
            try:
                job = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            if job is None:
                continue
            pending.extend(_Pending(job, i) for i in range(len(job.items)))

    def _round(self, pending: deque[_Pending]) -> None:
        budget = self.settings.max_batch_tokens * _ROUND_BATCHES
        taken: list[_Pending] = []
        tokens = 0
        while pending and (not taken or tokens + pending[0].length <= budget):
            p = pending.popleft()
            if p.job.cancelled:
                continue
            taken.append(p)
            tokens += p.length
        by_model: dict[int, list[_Pending]] = {}
        for p in taken:
            by_model.setdefault(id(p.job.model), []).append(p)
        for group in by_model.values():
            group.sort(key=lambda p: p.length)
            for batch in self._batches(group):
                self._forward(batch)

    def _batches(self, group: list[_Pending]) -> list[list[_Pending]]:
        s = self.settings
        out: list[list[_Pending]] = []
        cur: list[_Pending] = []
        for p in group:  # ascending length: the newest row is the longest
            rows = len(cur) + 1
            if cur and (rows > s.max_batch_size or rows * bucket(p.length) > s.max_batch_tokens):
                out.append(cur)
                cur = []
            cur.append(p)
        if cur:
            out.append(cur)
        return out

    def _forward(self, batch: list[_Pending]) -> None:
        batch = [p for p in batch if not p.job.cancelled]
        if not batch:
            return
        model = batch[0].job.model
        items = [p.job.items[p.index] for p in batch]
        width = min(bucket(max(len(it.ids) for it in items)), max(model.max_len, 1))
        width = max(width, max(len(it.ids) for it in items))
        ids = np.full((len(items), width), model.pad_id, dtype=np.int32)
        types = np.zeros((len(items), width), dtype=np.int32) if model.uses_type_ids else None
        lengths = np.empty(len(items), dtype=np.int32)
        for r, it in enumerate(items):
            n = len(it.ids)
            ids[r, :n] = it.ids
            lengths[r] = n
            if types is not None and it.type_ids is not None:
                types[r, :n] = it.type_ids
        try:
            out = model.forward(
                mx.array(ids), None if types is None else mx.array(types), mx.array(lengths)
            )
            result = np.array(out.astype(mx.float32))
        except Exception as e:
            log.exception("embedding forward pass failed")
            for job in {id(p.job): p.job for p in batch}.values():
                self._finish(job, e)
                job.cancelled = True
            return
        for r, p in enumerate(batch):
            job = p.job
            if job.out is None:
                job.out = np.empty((len(job.items), *result.shape[1:]), dtype=np.float32)
            job.out[p.index] = result[r]
            job.left -= 1
            if job.left == 0:
                self._finish(job, job.out)

    def _finish(self, job: _Job, result: np.ndarray | BaseException) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_settle, job.future, result)


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
