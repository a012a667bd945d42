"""POST /api/create: a library model from a model (library or served), a path under
``--models-dir`` or uploaded blobs, with Ollama's template, system prompt, parameters,
messages and license, optionally quantised to MLX 4 or 8 bits.

Everything the request says is checked before the answer starts (400s name the field);
the file work (links, checksums, quantisation) then runs in worker threads while statuses
stream as Ollama's do, ending with ``{"status": "success"}`` once the model is listed.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from pippin.api.common import parse_request, require_admin
from pippin.api.ollama.chat import NDJSON, line
from pippin.api.ollama.managed import managed_route, named_entry
from pippin.api.ollama.modelfile import parse_modelfile
from pippin.serving.errors import ApiError, bad_request, server_error
from pippin.serving.library_models import ParameterError, merge_parameters, normalize_parameters
from pippin.serving.model_admin import allowed_path
from pippin.serving.state import ServerState
from pippin.serving.streams import guarded
from pippin.store import model_files as mf
from pippin.store.library import LibraryError, ModelLibrary, StoredModel, normalize

router = APIRouter()

ADAPTERS_REFUSED = (
    "LoRA adapters in /api/create are not supported yet; serve them with --lora-modules"
)
_GO_TEMPLATE = re.compile(r"\{\{-?\s*(?:[.$]|(?:if|range|with|end|else|template|block|define)\b)")


class CreateMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: str
    content: str = ""


class CreateRequest(BaseModel):
    """Ollama's fields, and the legacy ones (``name``, ``modelfile``, ``quantization``);
    an unknown field is a 400 naming it."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    model: str = ""
    name: str = ""
    from_: str | None = Field(None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[CreateMessage] | None = None
    quantize: str | None = None
    quantization: str | None = None
    modelfile: str | None = None
    path: str | None = None
    stream: bool = True


@dataclass
class Plan:
    """What a create does, all checked."""

    name: str
    source: str  # for the manifest: a path, "blobs", or the model it is made from
    settings: dict[str, Any]
    parent: str | None = None
    base: StoredModel | None = None  # a library model whose files it shares (or quantises)
    files: dict[str, Path] = field(default_factory=dict)  # to gather into its folder
    digests: dict[str, str] = field(default_factory=dict)  # known sha256 of `files`
    format: str = "safetensors"
    entry: str = ""
    quantize: str | None = None
    parsed_modelfile: bool = False


def _library(state: ServerState) -> ModelLibrary:
    assert state.registry is not None
    return state.registry.library


def check_template(text: str) -> None:
    """A chat template pippin can render: Jinja (as Hugging Face tokenizers carry it)."""
    if _GO_TEMPLATE.search(text):
        raise bad_request(
            "template: pippin renders Jinja chat templates (as in a model's "
            "tokenizer_config.json), not Ollama's Go templates ({{ .Prompt }})",
            param="template",
        )
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise bad_request(f"template: line {e.lineno}: {e.message}", param="template") from None


def _settings(req: CreateRequest, base: dict[str, Any]) -> dict[str, Any]:
    """The new model's settings: the request's over those of the model it is made from."""
    out = {k: v for k, v in base.items()}
    if req.template is not None:
        check_template(req.template)
        out["template"] = req.template
    if req.system is not None:
        out["system"] = req.system
    if req.parameters:
        try:
            params = normalize_parameters(req.parameters)
        except ParameterError as e:
            raise bad_request(str(e), param="parameters") from None
        out["parameters"] = merge_parameters(base.get("parameters") or {}, params)
    if req.messages is not None:
        for i, m in enumerate(req.messages):
            if m.role not in ("system", "user", "assistant"):
                raise bad_request(f"invalid role {m.role!r} in messages[{i}]", param="messages")
        out["messages"] = [m.model_dump() for m in req.messages]
    if req.license is not None:
        out["license"] = [req.license] if isinstance(req.license, str) else list(req.license)
    return out


def _merge_modelfile(req: CreateRequest) -> CreateRequest:
    """The legacy ``modelfile`` text's instructions as the request's fields (fields the
    request also gives win)."""
    assert req.modelfile is not None
    parsed = parse_modelfile(req.modelfile)
    given = req.model_dump(exclude_none=True, by_alias=True)
    fields = {
        "from": parsed.from_,
        "template": parsed.template,
        "system": parsed.system,
        "parameters": parsed.parameters or None,
        "messages": parsed.messages or None,
        "license": parsed.license or None,
        "adapters": {a: a for a in parsed.adapters} or None,
    }
    fields = {k: v for k, v in fields.items() if v is not None and k not in given}
    return CreateRequest.model_validate({**given, **fields})


def _files_source(
    state: ServerState, files: dict[str, str]
) -> tuple[dict[str, Path], dict[str, str]]:
    library = _library(state)
    paths, digests = {}, {}
    for raw, digest in files.items():
        try:
            name = mf.safe_name(raw)
            blob = mf.blob_path(library.root, digest)
        except mf.ModelFilesError as e:
            raise bad_request(str(e), param="files") from None
        if not blob.is_file():
            raise bad_request(
                f"file {raw!r}: blob {digest} not found; upload it with POST /api/blobs/{digest}",
                param="files",
            )
        paths[name], digests[name] = blob, mf.blob_hex(digest)
    return paths, digests


def _path_source(path: Path) -> dict[str, Path]:
    if not path.exists():
        raise bad_request("'from': there is no model file or folder at that path", param="from")
    return mf.source_files(path)


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", ".", "~")) or "\\" in text or text.endswith(".gguf")


def plan(state: ServerState, req: CreateRequest) -> Plan:
    """The create ``req`` asks for, or the 400 (404 for an unknown model) it gets."""
    if req.path is not None:
        raise bad_request(
            "'path' (a Modelfile on the server) is not supported; send 'from'", param="path"
        )
    parsed = req.modelfile is not None
    if parsed:
        req = _merge_modelfile(req)
    try:
        name = normalize(req.model or req.name)
    except LibraryError as e:
        raise bad_request(
            str(e) if (req.model or req.name) else "model is required", param="model"
        ) from None
    taken = named_entry(state, name)
    if taken is not None and taken.stored is None:
        raise bad_request(
            f"model '{name}' is given on the server's command line: choose another name",
            param="model",
        )
    if req.adapters:
        raise bad_request(ADAPTERS_REFUSED, param="adapters")
    quantize = req.quantize or req.quantization
    if quantize is not None and quantize.lower() not in mf.QUANT_BITS:
        raise bad_request(
            f"unsupported quantization type {quantize!r}: this server quantizes to MLX 4-bit "
            "(q4_K_M, q4_K_S, q4_0, q4_1) or 8-bit (q8_0)",
            param="quantize",
        )
    if req.files and req.from_:
        raise bad_request("give 'from' or 'files', not both", param="files")
    library = _library(state)
    base = library.get(req.from_) if req.from_ else None
    out = Plan(name, "", _settings(req, base.settings if base else {}), quantize=quantize)
    out.parsed_modelfile = parsed
    if req.files:
        out.source = "files"
        out.files, out.digests = _files_source(state, req.files)
    elif base is not None:
        out.base, out.parent, out.source = base, base.name, base.name
        out.format, out.entry = base.format, base.entry
    elif req.from_:
        entry = named_entry(state, req.from_)
        given = entry.spec.model if entry is not None and entry.stored is None else None
        if given is not None and Path(given).expanduser().exists():
            path = Path(given).expanduser().resolve()  # a model the operator serves
            out.parent = req.from_
        elif _looks_like_path(req.from_):
            path = allowed_path(state.settings, req.from_, "from")
        elif entry is not None:
            raise bad_request(
                f"'from': model '{req.from_}' is not kept in local files pippin can copy "
                "(a Hub id): create from a path under --models-dir or a library model",
                param="from",
            )
        else:
            raise ApiError(404, f"model '{req.from_}' not found", param="from")
        out.source = str(path)
        out.files = _path_source(path)
    else:
        raise bad_request("neither 'from' nor 'files' was specified", param="from")
    if out.files:
        try:
            out.format, out.entry = mf.model_format(out.files)
        except mf.ModelFilesError as e:
            raise bad_request(str(e), param="files" if req.files else "from") from None
    if quantize is not None:
        _check_quantizable(out)
    return out


def _check_quantizable(p: Plan) -> None:
    if p.format == "gguf":
        raise bad_request(
            "quantize: a GGUF model is quantized already; this server quantizes safetensors "
            "models to MLX (create from a safetensors folder, or from a GGUF of the "
            "quantization you want)",
            param="quantize",
        )
    config = p.files.get("config.json") or (p.base.folder / "config.json" if p.base else None)
    try:
        quantized = config is not None and "quantization" in json.loads(config.read_text())
    except (OSError, ValueError):
        quantized = False
    if quantized:
        raise bad_request("quantize: the model is quantized already", param="quantize")


# --- the work ----------------------------------------------------------------------


def _status(text: str) -> dict[str, Any]:
    return {"status": text}


async def run(state: ServerState, p: Plan) -> AsyncIterator[dict[str, Any]]:
    """The create's statuses while it works; the model is listed before "success"."""
    library = _library(state)
    if p.parsed_modelfile:
        yield _status("parsing modelfile")
    files = list(p.base.files) if p.base is not None else []
    folder: Path | None = None
    try:
        if p.files:
            await asyncio.to_thread(library.discard_partial, p.name)
            folder = await asyncio.to_thread(library.partial, p.name)
            for name, src in p.files.items():
                got = await asyncio.to_thread(mf.gather, folder, {name: src}, p.digests)
                files.extend(got)
                yield _status(f"using existing layer sha256:{got[0].sha256}")
        else:
            for f in files:
                yield _status(f"using existing layer sha256:{f.sha256 or model_digest(p)}")
        if p.quantize is not None:
            source = folder if folder is not None else p.base.folder if p.base else None
            assert source is not None
            partial = await asyncio.to_thread(library.partial, p.name)
            target = partial / "quantized"
            yield _status(f"quantizing {p.format} model to {p.quantize}")
            await asyncio.to_thread(mf.quantize, source, target, mf.QUANT_BITS[p.quantize.lower()])
            folder, files = target, await asyncio.to_thread(mf.listing, target)
        yield _status("writing manifest")
        model = StoredModel(
            name=p.name,
            content=p.base.content if p.base is not None else "",
            source=p.source,
            files=files,
            entry=p.entry,
            format=p.format,
            parent=p.parent,
            settings=p.settings,
        )
        await asyncio.to_thread(library.publish, model, folder)
        # The blobs now live on in the model's folder (linked, or copied): the upload
        # area keeps nothing (a client uploads again what a later create needs).
        for digest in set(p.digests.values()) if p.source == "files" else ():
            mf.blob_path(library.root, f"sha256:{digest}").unlink(missing_ok=True)
    except (mf.ModelFilesError, LibraryError) as e:
        raise bad_request(str(e)) from None
    except OSError as e:
        raise server_error(f"could not write the model's files: {e.strerror}") from None
    finally:
        await asyncio.to_thread(library.discard_partial, p.name)
    assert state.registry is not None
    state.registry.sync_library(force=True)
    yield _status("success")


def model_digest(p: Plan) -> str:
    return p.base.digest if p.base is not None else ""


@router.post("/api/create", response_model=None, **managed_route(CreateRequest, stream=True))
async def create(request: Request) -> Any:
    state = require_admin(request)
    req = await parse_request(CreateRequest, await request.body())
    p = plan(state, req)  # light file checks; the heavy work runs in `run`'s threads
    if req.stream:
        lines = (line(s) async for s in run(state, p))
        return StreamingResponse(
            guarded(lines, lambda err: line({"error": err.message})), media_type=NDJSON
        )
    last: dict[str, Any] = {}
    async for status in run(state, p):
        last = status
    return JSONResponse(last)
