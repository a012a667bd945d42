"""Ollama's model routes: /api/tags, /api/show, /api/ps and /api/version."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Request

from pippin.api.common import get_state, parse_request
from pippin.api.ollama.modelfile import write_modelfile
from pippin.api.ollama.protocol import ShowRequest
from pippin.api.ollama.served import Listed, config_on_disk, expires_at, find, listed, running
from pippin.api.openapi import ollama_route
from pippin.serving.live_model import LiveModel
from pippin.serving.media import takes_images
from pippin.serving.state import ServerState
from pippin.store.library import StoredModel

router = APIRouter()

# The Ollama API version whose routes and fields pippin implements; clients read it to
# know which features (tools, think, structured format) they may use.
OLLAMA_VERSION = "0.12.6"


def _stored(m: Listed) -> StoredModel | None:
    """The library model behind a listed name, if it is one."""
    return m.entry.stored if m.entry is not None else None


def _digest(m: Listed) -> str:
    stored = _stored(m)
    if stored is not None:
        return stored.digest
    return hashlib.sha256(f"{m.name}|{m.source}".encode()).hexdigest()


def _live(m: Listed) -> LiveModel | None:
    """A chat model's `LiveModel` while it is loaded."""
    return m.entry.live if m.entry is not None else None


def _quantization(config: dict[str, Any]) -> str:
    q = config.get("quantization") or {}
    return f"Q{q['bits']}" if isinstance(q, dict) and "bits" in q else ""


def _details(m: Listed) -> dict[str, Any]:
    stored = _stored(m)
    fmt = "gguf" if m.source.endswith(".gguf") else "safetensors"
    quant = ""
    live = _live(m)
    if live is not None and live.loaded is not None:
        quant = _quantization(live.loaded.config) or live.loaded.dtype
    elif stored is not None and stored.format == "safetensors":
        quant = _quantization(config_on_disk(str(stored.path)))
    return {
        "parent_model": (stored.parent or "") if stored is not None else "",
        "format": stored.format if stored is not None else fmt,
        "family": m.family,
        "families": [m.family] if m.family else None,
        "parameter_size": "",
        "quantization_level": quant,
    }


def _entry(m: Listed, state: ServerState) -> dict[str, Any]:
    stored = _stored(m)
    return {
        "name": m.name,
        "model": m.name,
        "modified_at": _iso(stored.created if stored is not None else state.created),
        "size": stored.size if stored is not None else m.size,
        "digest": _digest(m),
        "details": _details(m),
    }


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, timezone.utc).isoformat().replace("+00:00", "Z")


@router.get("/api/tags", **ollama_route())
async def tags(request: Request) -> dict[str, Any]:
    state = get_state(request)
    return {"models": [_entry(m, state) for m in listed(state)]}


@router.get("/api/ps", **ollama_route())
async def ps(request: Request) -> dict[str, Any]:
    state = get_state(request)
    out = []
    for m in running(state):
        entry = _entry(m, state)
        entry |= {
            "expires_at": expires_at(m).isoformat().replace("+00:00", "Z"),
            "size_vram": m.size,
            "context_length": m.context_length,
        }
        del entry["modified_at"]
        out.append(entry)
    return {"models": out}


def _capabilities(m: Listed, live: LiveModel | None) -> list[str]:
    if m.kind != "chat":
        return [m.kind]  # "embedding" (and pippin's "rerank")
    # Tools on any model: a template without them gets the generic tool format.
    caps = ["completion", "tools"]
    if live is not None and live.parsers is not None and live.parsers.reasoning is not None:
        caps.append("thinking")
    if m.entry is not None and takes_images(m.entry):
        caps.append("vision")
    return caps


@router.post("/api/show", **ollama_route(ShowRequest))
async def show(request: Request) -> dict[str, Any]:
    req = await parse_request(ShowRequest, await request.body())
    state = get_state(request)
    m = find(state, req.model or req.name)
    live = None
    if m.entry is not None:
        # Its template, defaults and thinking mode come from the loaded model: clients
        # ask before their first chat, which would load it anyway.
        assert state.registry is not None
        live = await state.registry.acquire(m.entry.name)
        m = find(state, m.name)
    info: dict[str, Any] = {"general.architecture": m.family}
    if live is not None and live.loaded is not None:
        cfg = live.loaded.config
        for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            if isinstance(cfg.get(key), int):
                info[f"{m.family}.{key}"] = cfg[key]
    if m.context_length:
        info[f"{m.family or 'general'}.context_length"] = m.context_length
    stored = _stored(m)
    if stored is not None:
        return _show_stored(stored, m, live, info)
    params = ""
    if live is not None:
        params = "\n".join(
            f"{k:<20}{v}" for k, v in sorted(live.defaults.items()) if k != "max_tokens"
        )
    return {
        "modelfile": f"FROM {m.name}\n",
        "parameters": params,
        "template": live.template_source if live is not None else "",
        "details": _details(m),
        "model_info": info,
        "capabilities": _capabilities(m, live),
        "modified_at": _iso(state.created),
    }


def _show_stored(
    stored: StoredModel, m: Listed, live: LiveModel | None, info: dict[str, Any]
) -> dict[str, Any]:
    """/api/show of a library model: its own settings, as Ollama shows a Modelfile's."""
    settings = stored.settings
    params = []
    for key, value in (settings.get("parameters") or {}).items():
        for v in value if isinstance(value, list) else [value]:
            params.append(f"{key:<30} {json.dumps(v) if isinstance(v, str) else v}")
    out = {
        "modelfile": write_modelfile(stored.name, settings),
        "parameters": "\n".join(params),
        "template": settings.get("template") or (live.template_source if live else ""),
        "system": settings.get("system") or "",
        "details": _details(m),
        "model_info": info,
        "capabilities": _capabilities(m, live),
        "modified_at": _iso(stored.created),
    }
    if settings.get("license"):
        out["license"] = "\n".join(settings["license"])
    if settings.get("messages"):
        out["messages"] = settings["messages"]
    return out


@router.get("/api/version", **ollama_route())
async def version() -> dict[str, str]:
    return {"version": OLLAMA_VERSION}
