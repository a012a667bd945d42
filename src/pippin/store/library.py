"""pippin's own models: what `pippin pull`, Ollama's /api/pull, /api/create and /api/copy
put in the models folder (``--models-dir``), and the names they are listed under.

Layout, as Ollama keeps blobs apart from manifests::

    <root>/manifests/<key>.json   one per model name: which content folder, and its settings
    <root>/content/<id>/          the files (a model folder, or one GGUF file), shared by
                                  the names that point at it (a copy is a second manifest)
    <root>/partial/<key>/         a pull or create in progress; kept across interruptions
                                  so that a pull resumes, never listed, never served

A model exists once its manifest does: `publish` moves the finished folder into
``content/`` and then writes the manifest atomically, so no partial model is ever listed
or served. `remove` drops the manifest and then every content folder no manifest names.

Names follow Ollama: ``name:tag`` with the tag ``latest`` when none is given
(`normalize`); Hub pulls are named as the user asked (``hf.co/org/repo:Q4_K_M``,
``org/repo``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9][\w.\-/]*(:[\w.\-]+)?$")


def default_root() -> Path:
    """The library's folder when --models-dir is not given: ``models`` in pippin's cache."""
    from pippin.store.gguf_loader import cache_root

    return cache_root() / "models"


class LibraryError(ValueError):
    """A bad model name, or a model that is not there; the message is one line."""


def normalize(name: str) -> str:
    """``name:tag`` with tag ``latest`` when none is given; raises `LibraryError` on a name
    that could escape the folder or that Ollama would not accept."""
    name = name.strip()
    if not _NAME.match(name) or ".." in name or "//" in name or name.endswith("/"):
        raise LibraryError(f"invalid model name {name!r}")
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def _key(name: str) -> str:
    """A file name for a normalized model name (readable, and unique by its hash)."""
    readable = re.sub(r"[^\w.\-]+", "_", name)[:80]
    return f"{readable}-{hashlib.sha256(name.encode()).hexdigest()[:12]}"


@dataclass
class StoredFile:
    name: str  # path inside the content folder
    size: int
    sha256: str | None = None  # None: not known from the source (then not verified)


@dataclass
class StoredModel:
    """One model name of the library and what it serves."""

    name: str  # normalized
    content: str  # the content folder's id
    source: str  # where the files came from: a Hub repo@commit, a path, another model
    files: list[StoredFile]
    created: float = field(default_factory=time.time)
    # The file the loader is given, inside the content folder; "" for the folder itself.
    entry: str = ""
    format: str = "safetensors"  # or "gguf"
    parent: str | None = None  # a copy's or create's model it was made from
    # Ollama's settings of this name: template, system, parameters (sampling, stop),
    # messages, license, adapters. Applied when the model is served under this name.
    settings: dict[str, Any] = field(default_factory=dict)
    root: Path = field(default=Path("."), repr=False)

    @property
    def folder(self) -> Path:
        return self.root / "content" / self.content

    @property
    def path(self) -> Path:
        """What the loader is given: the content folder, or the GGUF file in it."""
        return self.folder / self.entry if self.entry else self.folder

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def digest(self) -> str:
        """sha256 of the content's file list (names, sizes and checksums): equal for copies."""
        listing = json.dumps([asdict(f) for f in self.files], sort_keys=True)
        return hashlib.sha256(f"{self.entry}|{listing}".encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("root")
        return {"version": MANIFEST_VERSION, **d}

    @classmethod
    def from_json(cls, d: dict[str, Any], root: Path) -> StoredModel:
        d = {k: v for k, v in d.items() if k != "version"}
        files = [StoredFile(**f) for f in d.pop("files")]
        return cls(files=files, root=root, **d)


class ModelLibrary:
    """The models folder; safe for one writer process (the server or one CLI command)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()

    # --- reading ---------------------------------------------------------------
    def _manifest(self, name: str) -> Path:
        return self.root / "manifests" / f"{_key(name)}.json"

    def list(self) -> list[StoredModel]:
        """Every model name, oldest first."""
        out = []
        for p in sorted((self.root / "manifests").glob("*.json")):
            try:
                out.append(StoredModel.from_json(json.loads(p.read_text()), self.root))
            except (OSError, ValueError, TypeError, KeyError):
                continue  # a manifest being replaced, or not ours
        return sorted(out, key=lambda m: m.created)

    def get(self, name: str) -> StoredModel | None:
        """The model ``name`` means (its tag may be left out for ``latest``), or None."""
        try:
            path = self._manifest(normalize(name))
        except LibraryError:
            return None
        try:
            return StoredModel.from_json(json.loads(path.read_text()), self.root)
        except (OSError, ValueError, TypeError, KeyError):
            return None

    def require(self, name: str) -> StoredModel:
        model = self.get(name)
        if model is None:
            raise LibraryError(f"model '{name}' not found")
        return model

    # --- writing ---------------------------------------------------------------
    def partial(self, name: str) -> Path:
        """The folder a pull or create of ``name`` fills; the same one after an interruption,
        so that what was already fetched is kept."""
        path = self.root / "partial" / _key(normalize(name))
        path.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, model: StoredModel, folder: Path | None = None) -> StoredModel:
        """Make ``model`` listed: move ``folder`` (a finished partial folder) into the content
        store under a new id, then write the manifest. ``folder`` None: ``model.content``
        names an existing content folder (a copy)."""
        model.name = normalize(model.name)
        model.root = self.root
        if folder is not None:
            model.content = uuid.uuid4().hex
            (self.root / "content").mkdir(parents=True, exist_ok=True)
            os.replace(folder, model.folder)
        elif not model.folder.is_dir():
            raise LibraryError(f"content {model.content!r} is missing")
        self._write_manifest(model)
        self._collect()
        return model

    def _write_manifest(self, model: StoredModel) -> None:
        path = self._manifest(model.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump(model.to_json(), f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def copy(self, source: str, destination: str, **changes: Any) -> StoredModel:
        """A second name for ``source``'s files (Ollama's /api/copy), with its own settings
        (``changes`` replace fields of the copy, e.g. ``settings``)."""
        src = self.require(source)
        dst = StoredModel.from_json(src.to_json(), self.root)
        dst.name, dst.parent, dst.created = normalize(destination), src.name, time.time()
        for k, v in changes.items():
            setattr(dst, k, v)
        return self.publish(dst)

    def remove(self, name: str) -> StoredModel:
        """Drop the name, then its files unless another name still uses them."""
        model = self.require(name)
        self._manifest(model.name).unlink(missing_ok=True)
        self._collect()
        return model

    def discard_partial(self, name: str) -> None:
        shutil.rmtree(self.root / "partial" / _key(normalize(name)), ignore_errors=True)

    def _collect(self) -> None:
        """Delete the content folders no manifest names."""
        used = {m.content for m in self.list()}
        for folder in (self.root / "content").glob("*"):
            if folder.name not in used:
                shutil.rmtree(folder, ignore_errors=True)

    def holds(self, path: str | Path) -> bool:
        """Whether ``path`` lies inside the library's folder."""
        try:
            Path(path).expanduser().resolve().relative_to(self.root)
        except ValueError:
            return False
        return True
