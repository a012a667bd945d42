"""The registry of chat models: request names to models, loading on demand, unloading after
an idle time, least-recently-used eviction under a memory budget, and the leases that keep
a model loaded while a request uses it.

Every chat-shaped route (OpenAI, Anthropic, and any other API surface) gets its model here;
there is no other path to an engine. The API for routes:

- `ModelRegistry.resolve(name) -> ModelEntry`: the model a request's ``model`` field names
  (served names, aliases, the path or Hub id as given, its basename, ``default``, alias
  patterns such as ``claude-*``); a 404 `ApiError` (``model_not_found``) otherwise.
  Never loads anything.
- ``await ModelRegistry.acquire(name, keep_alive=None) -> LiveModel``: the model, loaded
  (waiting for it if it is loading, at most ``load_timeout`` seconds, then a 503 with
  ``Retry-After``). Inside an HTTP request it holds a lease until the response has been
  sent, so the model is neither unloaded nor evicted meanwhile. ``keep_alive`` (seconds;
  negative: forever; 0: unload as soon as idle) replaces the model's idle time-to-live
  from this request on, as Ollama's ``keep_alive`` does, until the model unloads; None
  leaves the model's own. A pinned model ignores it (the Ollama routes refuse a 0).
- `ModelRegistry.entries()`: every model (`ModelEntry`: ``name``, ``names``, ``state``
  loaded/loading/unloaded, ``memory_bytes``, ``expires_at()``, ``pinned``), for listings
  such as /v1/models and Ollama's /api/ps.
- ``await ModelRegistry.unload(name)``: unload now if idle, else as soon as it is idle
  (never a pinned model; the model loaded at start-up of `pippin serve MODEL` is not
  pinned, and loads again on its next request).
- The library's models (``--models-dir``, `pippin.store.library`) are entries too, added
  as their manifests appear (a pull, a create, a copy, another process) and served on
  demand under their own names (``name:tag``, and ``name`` for ``name:latest``); names
  given on the command line win. `ModelRegistry.add` adds any other entry at run time.
- ``await ModelRegistry.forget(entry, on_gone)``: the entry's names stop resolving at
  once; once no request holds it, it is unloaded and ``on_gone`` runs (in a worker
  thread), e.g. its files are deleted (`delete_stored`).

- ``await ModelRegistry.sleep(level, wait=...)`` and ``await ModelRegistry.wake_up(tags)``:
  vLLM's sleep mode, for every chat model loaded (see `sleep`); meanwhile ``acquire``
  answers 503 with ``Retry-After``.

Loading runs in a worker thread (and the engine on its own thread or process), so the event
loop and the other models' streams never wait for it; loads run one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fnmatch
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pippin.engine.client import SLEEP_TAGS as TAGS
from pippin.engine.client import EngineError
from pippin.obs.observer import ServerObserver
from pippin.serving.errors import ApiError, retry_later, server_error
from pippin.serving.library_models import spec_from_stored
from pippin.serving.live_model import LiveModel
from pippin.serving.model_specs import ModelSpec, SpecError
from pippin.store.library import ModelLibrary, StoredModel

if TYPE_CHECKING:
    from pippin.engine.client import EngineClient
    from pippin.obs.metrics import Metrics
    from pippin.serving.settings import ServerSettings

log = logging.getLogger("pippin.server")

LOADED, LOADING, UNLOADED = "loaded", "loading", "unloaded"
DEFAULT_NAME = "default"
# Request names that go to the default model unless --model-alias says otherwise:
# Claude Code asks for its own model names (claude-sonnet-4-5, claude-haiku-...).
BUILTIN_PATTERNS = (("claude*", DEFAULT_NAME),)
REAP_INTERVAL_S = 0.25
LIBRARY_SETTLE_NS = 100_000_000  # the library's folder is read again while this fresh
RETRY_AFTER_S = 5

# The entries the current HTTP request holds; released by `LeaseMiddleware` once the
# response (a whole stream included) has been sent.
_LEASES: contextvars.ContextVar[list[ModelEntry] | None] = contextvars.ContextVar(
    "pippin_model_leases", default=None
)


@dataclass
class ModelEntry:
    """One chat model of the registry and its run-time state."""

    spec: ModelSpec
    served_names: list[str]  # the names /v1/models lists; the first is the main one
    names: list[str]  # every exact name that resolves to it
    state: str = UNLOADED
    live: LiveModel | None = None
    active: int = 0  # requests holding it (leases)
    last_used: float = field(default_factory=time.monotonic)
    # From the last request that gave one, until the model unloads; None: the spec's.
    keep_alive: float | None = None
    memory_bytes: int = 0  # weights + KV pool, measured at its last load
    error: str | None = None  # why its last load failed
    task: asyncio.Task[None] | None = None
    # What added it at run time (`ModelRegistry.add`): a library model's `StoredModel`;
    # None for the models of the command line.
    origin: Any = None
    # Forgotten (`ModelRegistry.forget`): resolves no more; unloaded once idle, then this.
    on_gone: Callable[[], None] | None = None

    @property
    def stored(self) -> StoredModel | None:
        """The library model it serves, if it is one."""
        return self.origin if isinstance(self.origin, StoredModel) else None

    @property
    def name(self) -> str:
        return self.served_names[0]

    @property
    def pinned(self) -> bool:
        return self.spec.pinned

    @property
    def ttl(self) -> float | None:
        """Seconds idle before unloading; None: never."""
        if self.pinned:
            return None
        ttl = self.keep_alive if self.keep_alive is not None else self.spec.idle_ttl
        return None if ttl is None or math.isinf(ttl) else ttl

    def expires_at(self) -> float | None:
        """Unix time at which it unloads if nothing uses it; None: not loaded, or never."""
        ttl = self.ttl
        if self.state != LOADED or ttl is None:
            return None
        idle = 0.0 if self.active else time.monotonic() - self.last_used
        return time.time() + max(ttl - idle, 0.0)

    def engine_idle(self) -> bool:
        engine = self.live.engine if self.live is not None else None
        if engine is None:
            return True
        s = engine.stats()
        return not s.get("running") and not s.get("waiting")


def _own_names(spec: ModelSpec) -> tuple[str, list[str]]:
    """The name a model is listed under by default, and the names clients may send for it
    besides: the argument exactly as given and its basename (and a GGUF file's stem)."""
    from pippin.store.loader import DEFAULT_MODEL_NAME, model_name

    if spec.model is None:
        return DEFAULT_MODEL_NAME, []
    given = spec.model
    base = Path(given.rstrip("/")).name
    extra = [given, given.rstrip("/"), base]
    if base.endswith(".gguf"):
        extra.append(base.removesuffix(".gguf"))
    return model_name(given), extra


class ModelRegistry:
    """The chat models of one server; see the module's docstring for the API."""

    def __init__(
        self,
        settings: ServerSettings,
        specs: list[ModelSpec],
        *,
        metrics: Metrics | None = None,
        enabled: bool = True,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.enabled = enabled  # False: names resolve, nothing loads (validation tests)
        self.budget = settings.memory_budget
        self.load_timeout = settings.model_load_timeout
        self._lock = asyncio.Lock()
        self._reaper: asyncio.Task[None] | None = None
        self.entries_: list[ModelEntry] = []
        self._by_name: dict[str, ModelEntry] = {}
        self._build(specs)
        self.library = ModelLibrary(settings.library_dir)
        self._library_seen: int | None = None  # manifests folder's mtime at the last sync
        self._retiring: list[ModelEntry] = []  # forgotten or replaced, still in use
        self._deleting: set[str] = set()  # library names whose deletion waits for a request
        # Sleep mode: the level (0: awake), what still sleeps, the models put to sleep.
        self.sleep_level = 0
        self._asleep: frozenset[str] = frozenset()
        self._sleepers: list[ModelEntry] = []
        self._sleep_lock = asyncio.Lock()

    # --- names ---------------------------------------------------------------
    def _build(self, specs: list[ModelSpec]) -> None:
        implicit: dict[str, list[ModelEntry]] = {}
        for spec in specs:
            own, extra = _own_names(spec) if self.enabled or spec.model else (None, [])
            served = list(spec.names) or ([own] if own else [])
            if not served:
                served = [spec.model or "default-model"]
            entry = ModelEntry(spec, served + list(spec.aliases), [])
            for name in [*served, *spec.aliases]:
                if name in self._by_name:
                    raise SpecError(f"the model name {name!r} is given to two models")
                self._by_name[name] = entry
            for name in ([own] if own else []) + extra:
                implicit.setdefault(name, [])
                if entry not in implicit[name]:
                    implicit[name].append(entry)
            self.entries_.append(entry)
        for name, owners in implicit.items():
            # An explicit name wins; an implicit one two models share resolves to neither.
            if name not in self._by_name and len(owners) == 1:
                self._by_name[name] = owners[0]
        for name, entry in self._by_name.items():
            entry.names.append(name)
        defaults = [e for e in self.entries_ if e.spec.default]
        self.default = defaults[0] if defaults else self.entries_[0]
        self.patterns: list[tuple[str, ModelEntry]] = []
        for pattern, target in [*self.settings.model_aliases, *BUILTIN_PATTERNS]:
            entry = self.default if target == DEFAULT_NAME else self._by_name.get(target)
            if entry is None:
                raise SpecError(f"--model-alias {pattern}={target}: no model is named {target!r}")
            self.patterns.append((pattern, entry))

    def entries(self) -> list[ModelEntry]:
        """Every model: the command line's in the order given, then the library's."""
        self.sync_library()
        return list(self.entries_)

    def add(self, spec: ModelSpec, served: list[str], names: list[str], origin: Any) -> ModelEntry:
        """An entry added at run time, under ``served`` (listed) and ``names`` (more names
        that resolve to it); a name another model has is left to that one."""
        entry = ModelEntry(spec, list(served), [], origin=origin)
        for name in dict.fromkeys([*served, *names]):
            if name not in self._by_name:
                self._by_name[name] = entry
                entry.names.append(name)
        self.entries_.append(entry)
        return entry

    def _drop(self, entry: ModelEntry) -> None:
        """Take ``entry`` out of the names and listings; it unloads once idle."""
        for name in entry.names:
            if self._by_name.get(name) is entry:
                del self._by_name[name]
        if entry in self.entries_:
            self.entries_.remove(entry)
            self._retiring.append(entry)

    def sync_library(self, *, force: bool = False) -> None:
        """Entries for the library's models as its manifests are now: new ones added,
        removed or replaced ones dropped (unloaded once idle). Reads the folder only when
        it changed (or ``force``)."""
        try:
            seen: int | None = (self.library.root / "manifests").stat().st_mtime_ns
        except OSError:
            seen = None
        # A folder changed moments ago may change again within the clock's tick, unseen.
        settled = seen is None or time.time_ns() - seen > LIBRARY_SETTLE_NS
        if seen == self._library_seen and settled and not force:
            return
        self._library_seen = seen
        stored = {m.name: m for m in self.library.list() if m.name not in self._deleting}
        for entry in [e for e in self.entries_ if e.stored is not None]:
            assert entry.stored is not None
            now = stored.get(entry.stored.name)
            if now is None or now.to_json() != entry.stored.to_json():
                self._drop(entry)
            else:
                del stored[now.name]
        for model in stored.values():
            if model.name in self._by_name:
                continue  # the command line's model of that name wins
            short = model.name.removesuffix(":latest")
            self.add(spec_from_stored(model, self.settings.idle_ttl), [model.name], [short], model)

    def resolve(self, name: str) -> ModelEntry:
        """The model ``name`` means (404 `ApiError` if none). Never loads."""
        entry = self._by_name.get(name)
        if entry is None:
            self.sync_library()  # a model pulled or created since (cheap when none was)
            entry = self._by_name.get(name)
        if entry is None and name == DEFAULT_NAME:
            entry = self.default
        if entry is None:
            entry = next((e for p, e in self.patterns if fnmatch.fnmatchcase(name, p)), None)
        if entry is None:
            listed = ", ".join(n for e in self.entries_ for n in e.served_names)
            raise ApiError(
                404,
                f"The model '{name}' does not exist or you do not have access to it "
                f"(served: {listed}).",
                param="model",
                code="model_not_found",
            )
        return entry

    # --- use -----------------------------------------------------------------
    async def acquire(self, name: str, *, keep_alive: float | None = None) -> LiveModel:
        """The loaded model ``name`` means; see the module's docstring."""
        entry = self.resolve(name)
        if self.sleep_level:
            raise retry_later(
                "The server is asleep (POST /wake_up wakes it); try again later.",
                "model_sleeping",
                RETRY_AFTER_S,
            )
        if keep_alive is not None:
            entry.keep_alive = math.inf if keep_alive < 0 else float(keep_alive)
        leases = _LEASES.get()
        if leases is not None:
            entry.active += 1
            leases.append(entry)
        entry.last_used = time.monotonic()
        if not self.enabled:
            raise server_error("The model is not ready; try again shortly.", "model_not_ready", 503)
        if entry.state != LOADED:
            await self._wait_loaded(entry)
        assert entry.live is not None
        return entry.live

    @contextlib.asynccontextmanager
    async def lease(self, name: str, **kw: Any) -> AsyncIterator[LiveModel]:
        """``acquire`` with a lease outside an HTTP request (held for the block)."""
        token = _LEASES.set([])
        try:
            yield await self.acquire(name, **kw)
        finally:
            self.release(_LEASES.get() or [])
            _LEASES.reset(token)

    def release(self, entries: list[ModelEntry]) -> None:
        now = time.monotonic()
        for entry in entries:
            entry.active -= 1
            entry.last_used = now
        entries.clear()

    async def unload(self, name: str) -> None:
        """Unload now if nothing uses it; else as soon as it is idle (keep_alive 0)."""
        entry = self.resolve(name)
        if entry.pinned or entry.state == UNLOADED:
            return  # nothing to do (nor to remember for its next load)
        entry.keep_alive = 0.0
        if entry.state == LOADED and entry.active == 0:
            async with self._lock:
                if entry.state == LOADED and entry.active == 0 and entry.engine_idle():
                    await self._unload(entry)

    async def forget(self, entry: ModelEntry, on_gone: Callable[[], None] | None = None) -> None:
        """``entry``'s names stop resolving now (new requests get a 404); once no request
        holds it (a stream from it ends as usual) it is unloaded, then ``on_gone`` runs in
        a worker thread. Done before returning when nothing holds it."""
        entry.on_gone = on_gone
        self._drop(entry)
        if entry.active == 0 and entry.task is None and entry.engine_idle():
            await self._retire(entry)

    async def delete_stored(self, entry: ModelEntry) -> None:
        """Delete a library model: `forget` it, then remove its name from the library and
        its files unless another name shares them."""
        stored = entry.stored
        assert stored is not None
        self._deleting.add(stored.name)

        def remove() -> None:
            # Unless the name was made anew meanwhile (a create after the delete).
            now = self.library.get(stored.name)
            if now is not None and now.created == stored.created:
                self.library.remove(stored.name)
            self._deleting.discard(stored.name)
            self._library_seen = None

        await self.forget(entry, remove)

    async def _retire(self, entry: ModelEntry) -> None:
        if entry not in self._retiring:
            return  # retired already
        self._retiring.remove(entry)
        async with self._lock:
            if entry.state == LOADED:
                await self._unload(entry)
        if entry.on_gone is not None:
            await asyncio.to_thread(entry.on_gone)

    async def _wait_loaded(self, entry: ModelEntry) -> None:
        if entry.task is None:
            entry.state, entry.error = LOADING, None
            entry.task = asyncio.create_task(self._load(entry))
        try:
            await asyncio.wait_for(asyncio.shield(entry.task), self.load_timeout)
        except TimeoutError:
            raise retry_later(
                f"The model '{entry.name}' is loading; try again shortly.",
                "model_loading",
                RETRY_AFTER_S,
            ) from None
        if entry.state != LOADED or entry.live is None:
            raise server_error(
                f"The model '{entry.name}' could not be loaded: {entry.error}",
                "model_load_failed",
                503,
            )

    # --- sleep mode ----------------------------------------------------------
    async def sleep(self, level: int, *, wait: bool) -> None:
        """Put every chat model loaded to sleep (vLLM has one model; pippin sleeps them
        all). From now on requests get a 503 with ``Retry-After``; with ``wait`` those in
        flight finish first, else they end now with an error. Level 1 frees each engine's
        KV pool and, on a GPU, moves its weights to host memory; level 2 unloads the
        models (their weights are read from disk again on waking). The prefix cache in
        memory is empty after either. Asleep already: nothing changes."""
        async with self._sleep_lock:
            if self.sleep_level:
                return
            self.sleep_level, self._asleep = level, TAGS
            async with self._lock:  # a load under way finishes first
                entries = [e for e in self.entries_ if e.state == LOADED and e.live is not None]
                if wait:  # their leases last until each response has been sent
                    while any(e.active or not e.engine_idle() for e in entries):
                        await asyncio.sleep(REAP_INTERVAL_S)
                self._sleepers = entries
                try:
                    for entry in entries:
                        assert entry.live is not None and entry.live.engine is not None
                        await entry.live.engine.sleep(TAGS, abort=True)
                        if level == 2:
                            await self._unload(entry)
                except EngineError as e:  # e.g. speculative decoding: awake again
                    for entry in entries:
                        if entry.live is not None and entry.live.engine is not None:
                            await entry.live.engine.wake_up(TAGS)
                    self.sleep_level, self._asleep, self._sleepers = 0, frozenset(), []
                    raise server_error(f"Cannot sleep: {e}", "sleep_unavailable") from None
            log.info("asleep (level %d): %d model(s)", level, len(entries))

    async def wake_up(self, tags: frozenset[str] = TAGS) -> None:
        """Bring ``tags`` ("weights", "kv_cache") of the sleeping models back; awake once
        both are (a model unloaded by level 2 loads again with its "weights")."""
        async with self._sleep_lock:
            still = self._asleep - tags
            for entry in self._sleepers:
                if entry.state == LOADED:
                    assert entry.live is not None and entry.live.engine is not None
                    await entry.live.engine.wake_up(tags)
                elif "weights" in tags:
                    await self._load(entry)
                    if entry.state != LOADED or entry.live is None:
                        raise server_error(
                            f"The model '{entry.name}' could not be loaded: {entry.error}",
                            "model_load_failed",
                            503,
                        )
                    if "kv_cache" in still:  # loaded with its pool: that sleeps on
                        assert entry.live.engine is not None
                        await entry.live.engine.sleep(frozenset({"kv_cache"}), abort=True)
            self._asleep = still
            if not still and self.sleep_level:
                log.info("awake: %d model(s)", len(self._sleepers))
                self.sleep_level, self._sleepers = 0, []

    # --- lifecycle -----------------------------------------------------------
    async def start(self) -> None:
        """Load the pinned and preloaded models (a failure raises: the server does not
        start) and start unloading idle ones."""
        for entry in self.entries_:
            if entry.pinned or entry.spec.preload:
                entry.state = LOADING
                entry.task = asyncio.create_task(self._load(entry))
                await entry.task
                if entry.state != LOADED:
                    raise RuntimeError(f"cannot load the model '{entry.name}': {entry.error}")
        self._reaper = asyncio.create_task(self._reap())

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for entry in [*self.entries_, *self._retiring]:
            if entry.task is not None:
                entry.task.cancel()
            if entry.live is not None and entry.live.engine is not None:
                await entry.live.engine.stop()

    @property
    def ready(self) -> bool:
        """The pinned models are loaded and the engines of those and of the preloaded
        models run (one unloaded by a request's keep_alive loads again on demand)."""
        return all(
            e.state == LOADED
            and e.live is not None
            and e.live.engine is not None
            and e.live.engine.ready
            for e in self.entries_
            if e.pinned or (e.spec.preload and e.state == LOADED)
        )

    def engine_stats(self) -> dict[str, dict[str, int]]:
        """Each loaded model's engine counters, by main name (for the metrics)."""
        return {
            e.name: e.live.engine.stats()
            for e in self.entries_
            if e.live is not None and e.live.engine is not None
        }

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            if self.sleep_level:
                continue  # sleeping models are neither unloaded nor removed
            for entry in list(self._retiring):
                if entry.active == 0 and entry.task is None and entry.engine_idle():
                    try:
                        await self._retire(entry)
                    except Exception as e:  # the reaper goes on for the other models
                        log.error("model '%s' could not be removed: %s", entry.name, e)
            now = time.monotonic()
            for entry in self.entries_:
                ttl = entry.ttl
                if (
                    entry.state == LOADED
                    and ttl is not None
                    and entry.active == 0
                    and now - entry.last_used >= ttl
                    and entry.engine_idle()
                    and not self._lock.locked()
                ):
                    async with self._lock:
                        log.info("model '%s' idle for %.0fs: unloading", entry.name, ttl)
                        await self._unload(entry)

    async def _load(self, entry: ModelEntry) -> None:
        async with self._lock:
            try:
                entry.state = LOADING
                await self._make_room(entry, entry.memory_bytes)
                t0 = time.monotonic()
                entry.live = await self._start_engine(entry)
                stats = entry.live.engine.stats() if entry.live.engine else {}
                entry.memory_bytes = stats.get("weight_bytes", 0) + stats.get("kv_bytes", 0)
                entry.state, entry.last_used = LOADED, time.monotonic()
                log.info(
                    "model '%s' ready in %.1fs: context %s tokens, %s KV blocks of %s "
                    "tokens, %.0f MB",
                    entry.name,
                    time.monotonic() - t0,
                    entry.live.limits.max_model_len if entry.live.limits else "?",
                    stats.get("blocks_total", "?"),
                    stats.get("block_size", "?"),
                    entry.memory_bytes / 1e6,
                )
                await self._make_room(entry, 0)
            except Exception as e:  # the waiting requests get the reason
                from pippin.store.loader import one_line

                entry.live, entry.state, entry.error = None, UNLOADED, one_line(e)
                log.error("model '%s' failed to load: %s", entry.name, entry.error)
            finally:
                entry.task = None

    async def _make_room(self, entry: ModelEntry, need: int) -> None:
        """Unload least recently used idle models until ``need`` bytes more (beside what is
        loaded) fit the budget."""
        if self.budget is None:
            return
        while True:
            loaded = [e for e in self.entries_ if e.state == LOADED and e is not entry]
            used = sum(e.memory_bytes for e in loaded) + need
            if entry.state == LOADED:
                used += entry.memory_bytes
            if used <= self.budget:
                return
            idle = [e for e in loaded if not e.pinned and e.active == 0 and e.engine_idle()]
            if not idle:
                log.warning(
                    "over the memory budget (%.0f MB of %.0f MB): nothing idle to unload",
                    used / 1e6,
                    self.budget / 1e6,
                )
                return
            victim = min(idle, key=lambda e: e.last_used)
            log.info("memory budget: unloading model '%s' (least recently used)", victim.name)
            await self._unload(victim)

    async def _unload(self, entry: ModelEntry) -> None:
        live, entry.live, entry.state = entry.live, None, UNLOADED
        # A request's keep_alive lasts while the model is loaded: after `keep_alive: 0`,
        # the next load keeps the model's own idle time rather than unloading again.
        entry.keep_alive = None
        if live is not None and live.engine is not None:
            await live.engine.stop()
        del live
        from pippin.store.loader import release_memory

        await asyncio.to_thread(release_memory)

    async def _start_engine(self, entry: ModelEntry) -> LiveModel:
        """Load the model off the loop and start its engine (its own KV pool)."""
        from pippin.engine.inproc_client import InprocClient
        from pippin.engine.process_client import ProcessClient
        from pippin.engine.tp.rank0 import child_main as tp_child_main
        from pippin.obs import logs
        from pippin.obs.logs import setup_logging
        from pippin.store.loader import load_model, materialize
        from pippin.structured.compiler import serve_in_engine_process

        s, spec = self.settings, entry.spec
        log.info("loading the model '%s'", entry.name)
        log.debug("model spec: %s", spec.model or "(default)")
        load_kwargs: dict[str, Any] = dict(
            spec=spec.model,
            dtype=s.dtype,
            trust_remote_code=s.trust_remote_code,
            revision=s.revision,
        )
        config = s.engine
        if spec.max_model_len is not None:
            config = replace(config, max_model_len=spec.max_model_len)
        model_metrics = self.metrics.for_model(entry.name) if self.metrics else None
        observer = ServerObserver(model_metrics)
        engine: EngineClient
        if s.engine_process or config.tensor_parallel is not None:
            # This process keeps the tokenizer and config; the engine process the weights.
            loaded = await asyncio.to_thread(lambda: load_model(**load_kwargs, weights=False))
            engine = ProcessClient(
                load_kwargs,
                config,
                observer=observer,
                on_start=partial(setup_logging, *(logs.CURRENT or ("info", "text"))),
                on_loaded=serve_in_engine_process,
                child_main=tp_child_main if config.tensor_parallel is not None else None,
            )
        else:
            loaded = await asyncio.to_thread(lambda: materialize(load_model(**load_kwargs)))
            engine = InprocClient(loaded, config, observer=observer)
        if spec.chat_template is not None:
            loaded.tokenizer.chat_template = spec.chat_template
        await engine.start()
        live = LiveModel(s, model_names=list(entry.served_names), observer=observer)
        live.attach(
            loaded,
            engine,
            sampling=spec.sampling,
            tool_call_parser=spec.tool_call_parser,
            reasoning_parser=spec.reasoning_parser,
        )
        live.system, live.preset = spec.system, list(spec.messages)
        return live


@contextmanager
def request_leases() -> Iterator[list[ModelEntry]]:
    """The models one request acquires (`ModelRegistry.acquire` adds them), for the lease
    middleware to release once its response has been sent."""
    leases: list[ModelEntry] = []
    token = _LEASES.set(leases)
    try:
        yield leases
    finally:
        _LEASES.reset(token)
