"""The files a created model is made of (Ollama's /api/create and /api/blobs): uploaded
blobs, a model's files gathered into a library folder, their format, and MLX quantisation.

Blobs lie in ``<library>/blobs/sha256-<hex>``, written under a temporary name and renamed
once their digest is checked. Files are gathered by hard link where the file system
allows (no second copy of the weights), else copied.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

from pippin.store.library import StoredFile

_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
_CHUNK = 1 << 20
# The safetensors folder's files a model needs besides weights (mlx-lm's loader reads them).
_WEIGHTS = (".safetensors",)
# Ollama's quantization types -> MLX affine bits (group size 64).
QUANT_BITS = {"q4_k_m": 4, "q4_k_s": 4, "q4_0": 4, "q4_1": 4, "q8_0": 8}
GROUP_SIZE = 64


class ModelFilesError(ValueError):
    """A bad digest, file set or source; the message is one line for the client."""


def blob_hex(digest: str) -> str:
    """The hex of ``sha256:<hex>`` (or ``sha256-<hex>``); `ModelFilesError` otherwise."""
    m = _DIGEST.match(digest)
    if m is None:
        raise ModelFilesError(f"invalid digest {digest!r}: expected sha256:<64 hex digits>")
    return m.group(1)


def blob_path(root: Path, digest: str) -> Path:
    return root / "blobs" / f"sha256-{blob_hex(digest)}"


class BlobWriter:
    """One upload: chunks written to a temporary file and hashed; `finish` keeps it under
    its digest if the bytes match, else deletes it."""

    def __init__(self, path: Path) -> None:
        self.path = path  # `blob_path`
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".upload-")
        self.tmp = Path(tmp)
        self.file = os.fdopen(fd, "wb")
        self.hash = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.file.write(chunk)
        self.hash.update(chunk)

    def finish(self) -> bool:
        """True when the upload matched its digest (and is now stored)."""
        self.file.close()
        if f"sha256-{self.hash.hexdigest()}" != self.path.name:
            self.tmp.unlink(missing_ok=True)
            return False
        os.replace(self.tmp, self.path)
        return True

    def abort(self) -> None:
        self.file.close()
        self.tmp.unlink(missing_ok=True)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def safe_name(name: str) -> str:
    """A file name of a create's ``files``, checked to stay inside the model's folder."""
    parts = Path(name).parts
    if not name or Path(name).is_absolute() or any(p in ("..", "") for p in parts):
        raise ModelFilesError(f"invalid file name {name!r} in 'files'")
    return Path(*parts).as_posix()


def source_files(path: Path) -> dict[str, Path]:
    """A model's files by name inside its folder: the GGUF file itself, or every regular
    file of a folder (not hidden ones, not the Hub's cache folders)."""
    if path.is_file():
        return {path.name: path}
    out = {}
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path)
        if f.is_file() and not any(p.startswith(".") for p in rel.parts):
            out[rel.as_posix()] = f
    return out


def gather(folder: Path, files: dict[str, Path], digests: dict[str, str]) -> list[StoredFile]:
    """``files`` (name -> source) linked or copied into ``folder``; their sha256 from
    ``digests`` when known, else computed."""
    out = []
    for name, src in files.items():
        dst = folder / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
        digest = digests.get(name) or sha256_file(dst)
        out.append(StoredFile(name, dst.stat().st_size, digest))
    return out


def listing(folder: Path) -> list[StoredFile]:
    """Every file of a finished folder (after quantisation wrote it), with checksums."""
    return [
        StoredFile(name, f.stat().st_size, sha256_file(f))
        for name, f in source_files(folder).items()
    ]


def model_format(names: Iterable[str]) -> tuple[str, str]:
    """(format, entry) of a model's file set: one GGUF file, or a safetensors folder with
    config.json, weights and a tokenizer; `ModelFilesError` saying what is missing."""
    names = list(names)
    ggufs = [n for n in names if n.endswith(".gguf")]
    if ggufs:
        if len(ggufs) > 1:
            raise ModelFilesError("more than one GGUF file: give one model file")
        return "gguf", ggufs[0]
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    if not any(n.endswith(_WEIGHTS) for n in names):
        missing.append("weights (*.safetensors)")
    if not any(n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json") for n in names):
        missing.append("a tokenizer (tokenizer.json or tokenizer.model)")
    if missing:
        raise ModelFilesError(
            "not a model: expected a GGUF file or a safetensors folder; missing "
            + ", ".join(missing)
        )
    return "safetensors", ""


_CONVERT = (
    "import sys\n"
    "from mlx_lm.convert import convert\n"
    "convert(sys.argv[1], sys.argv[2], quantize=True, q_bits=int(sys.argv[3]),"
    " q_group_size=int(sys.argv[4]), q_mode='affine')\n"
)


def quantize(source: Path, target: Path, bits: int) -> None:
    """``source`` (a safetensors folder) quantised by mlx-lm into ``target`` (which must
    not exist), in a process of its own: its memory goes back when it ends, and the
    server's MLX threads are left alone."""
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(source), str(target), str(bits), str(GROUP_SIZE)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise ModelFilesError(f"quantizing failed: {tail[-1] if tail else proc.returncode}")
