"""LoRA adapters served as models: the set of them (`--lora-modules`, and those loaded at
run time), and the one hook every route's model lookup passes through.

An adapter is a name on a base chat model of the registry. A request that names it gets
the base model (`ModelRegistry.acquire`, so the base loads on demand and is leased as
usual) with an engine whose requests run with the adapter (`AdapterEngine`): the engine
batches them with the base model's and other adapters' rows. The adapter is loaded into
the base model's engine on first use, and again into each new engine (the base model
unloaded and loaded again, an engine process restarted: `EngineClient.loras`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pippin.engine.client import EngineClient, EngineError
from pippin.engine.types import RequestOutput, SamplingParams
from pippin.serving.errors import ApiError, bad_request, server_error
from pippin.serving.model_specs import SpecError
from pippin.store import lora as lora_files

if TYPE_CHECKING:
    from pippin.serving.live_model import LiveModel
    from pippin.serving.registry import ModelRegistry
    from pippin.serving.settings import ServerSettings


@dataclass(frozen=True)
class ServedAdapter:
    name: str
    path: str
    base: str | None  # the base model's registry name; None: the default model


def parse_module(item: tuple[str, str]) -> ServedAdapter:
    """One `--lora-modules` item: (NAME, PATH), or ("", JSON) for vLLM's JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}``."""
    name, path = item
    if name:
        return ServedAdapter(name, path, None)
    try:
        raw = json.loads(path)
    except ValueError as e:
        raise SpecError(f"--lora-modules {path!r}: not JSON ({e})") from None
    if not isinstance(raw, dict) or not raw.get("name") or not raw.get("path"):
        raise SpecError(f"--lora-modules {path!r}: a JSON item needs 'name' and 'path'")
    base = raw.get("base_model_name")
    return ServedAdapter(str(raw["name"]), str(raw["path"]), str(base) if base else None)


class AdapterEngine:
    """The base model's engine, as a request for the adapter sees it: every request
    it generates runs with the adapter."""

    def __init__(self, engine: EngineClient, name: str) -> None:
        self.base = engine
        self.name = name

    def __getattr__(self, attr: str) -> Any:  # the rest of `EngineClient`, as the base's
        return getattr(self.base, attr)

    @property
    def ready(self) -> bool:
        return self.base.ready

    @property
    def max_model_len(self) -> int:
        return self.base.max_model_len

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.base.check(prompt_token_ids, params)

    def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        return self.base.generate(prompt_token_ids, replace(params, lora=self.name), request_id)


class Adapters:
    """The adapters this server serves, by name."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.by_name: dict[str, ServedAdapter] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        for item in settings.lora_modules:
            a = parse_module(item)
            if a.name in self.by_name:
                raise SpecError(f"--lora-modules: the name {a.name!r} is given twice")
            try:
                lora_files.inspect(a.path)  # a bad folder stops the start, in one line
            except lora_files.LoraError as e:
                raise SpecError(f"--lora-modules {a.name}: {e}") from None
            self.by_name[a.name] = a

    def get(self, name: str) -> ServedAdapter | None:
        return self.by_name.get(name)

    def base_name(self, registry: ModelRegistry, adapter: ServedAdapter) -> str:
        return adapter.base or registry.default.name

    async def acquire(
        self, registry: ModelRegistry, adapter: ServedAdapter, *, keep_alive: float | None = None
    ) -> LiveModel:
        """The base model, loaded and leased, with the adapter loaded into its engine; its
        engine runs every request with the adapter."""
        live = await registry.acquire(self.base_name(registry, adapter), keep_alive=keep_alive)
        engine = live.engine
        if engine is None or not engine.ready:
            raise server_error("The model is not ready; try again shortly.", "model_not_ready", 503)
        await self.ensure_loaded(engine, adapter)
        ident = f"{live.fingerprint}|{adapter.name}|{adapter.path}"
        return replace(
            live,
            engine=AdapterEngine(engine, adapter.name),
            fingerprint="fp_" + hashlib.sha256(ident.encode()).hexdigest()[:10],
        )

    async def ensure_loaded(self, engine: EngineClient, adapter: ServedAdapter) -> None:
        if engine.loras.get(adapter.name) == adapter.path:
            return
        lock = self._locks.setdefault(adapter.name, asyncio.Lock())
        async with lock:
            if engine.loras.get(adapter.name) == adapter.path:
                return
            try:
                await engine.add_lora(adapter.name, adapter.path)
            except EngineError as e:
                raise bad_request(str(e), param="model", code="lora_load_failed") from None

    # --- run time (the routes of `api/openai/lora.py`) ---------------------------
    async def load(self, registry: ModelRegistry, adapter: ServedAdapter) -> None:
        """Serve a new adapter: its folder checked, loaded into its base model's engine
        (loading the base if need be), then listed. 400s say what is wrong."""
        if adapter.name in self.by_name:
            raise bad_request(
                f"The lora adapter '{adapter.name}' has already been loaded.",
                param="lora_name",
                code="lora_exists",
            )
        if any(adapter.name in e.names for e in registry.entries()):
            raise bad_request(
                f"'{adapter.name}' is the name of a served model.",
                param="lora_name",
                code="lora_exists",
            )
        try:
            lora_files.inspect(adapter.path)
        except lora_files.LoraError as e:
            raise bad_request(
                f"The lora adapter cannot be loaded: {e}", param="lora_path"
            ) from None
        base = self.base_name(registry, adapter)
        try:
            registry.resolve(base)
        except ApiError as e:
            raise bad_request(e.message, param="base_model_name", code="model_not_found") from None
        async with registry.lease(base) as live:
            if live.engine is not None:
                await self.ensure_loaded(live.engine, adapter)
        self.by_name[adapter.name] = adapter

    async def unload(self, registry: ModelRegistry, name: str) -> None:
        """Stop serving `name`; refused (409) while requests run with it."""
        adapter = self.by_name.get(name)
        if adapter is None:
            raise bad_request(
                f"The lora adapter '{name}' cannot be found.",
                param="lora_name",
                code="lora_not_found",
            )
        base = registry.resolve(self.base_name(registry, adapter))
        engine = base.live.engine if base.live is not None else None
        if engine is not None and name in engine.loras:
            try:
                await engine.remove_lora(name)
            except EngineError as e:
                raise ApiError(409, str(e), param="lora_name", code="lora_in_use") from None
        del self.by_name[name]
