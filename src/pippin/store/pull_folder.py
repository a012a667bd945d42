"""The partial folder of a pull (`pippin.store.hub_pull`): finished files at their paths,
unfinished ones (resumed from where they stop) and a record of what each finished file
was fetched as, and whether it was verified, in ``.pippin-pull/``. The record survives an
interrupted pull, so the next one neither fetches nor hashes a finished file again."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from pippin.store.hub_files import PullError, RemoteFile

_CHUNK = 1 << 20


class PullFolder:
    """One name's partial folder (`ModelLibrary.partial`) as a pull fills it."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.work = folder / ".pippin-pull"
        try:
            self.state: dict[str, dict[str, str | None]] = json.loads(
                (self.work / "state.json").read_text()
            )
        except (OSError, ValueError):
            self.state = {}

    @staticmethod
    def expect(f: RemoteFile) -> str:
        """What identifies the content the Hub lists for ``f``."""
        return f.sha256 or f.blob_id or f"size-{f.size}"

    def path(self, f: RemoteFile) -> Path:
        return self.folder / f.path

    def incomplete(self, f: RemoteFile) -> Path:
        key = hashlib.sha256(f.path.encode()).hexdigest()[:16]
        return self.work / f"{key}-{self.expect(f)[:16]}.incomplete"

    def done(self, f: RemoteFile) -> bool:
        """Whether ``f`` is here whole, fetched as the content the Hub lists now."""
        record = self.state.get(f.path) or {}
        path = self.path(f)
        same = record.get("expect") == self.expect(f)
        return same and path.is_file() and size_of(path) == f.size

    def in_hand(self, f: RemoteFile) -> int:
        """Bytes of ``f`` already here."""
        if self.done(f):
            return f.size
        tmp = self.incomplete(f)
        return min(size_of(tmp), f.size) if tmp.is_file() else 0

    def sha256(self, f: RemoteFile) -> str | None:
        return (self.state.get(f.path) or {}).get("sha256") if self.done(f) else None

    def mark(self, f: RemoteFile, sha256: str | None = None) -> None:
        self.state[f.path] = {"expect": self.expect(f), "sha256": sha256}
        self.work.mkdir(parents=True, exist_ok=True)
        tmp = self.work / "state.json.tmp"
        tmp.write_text(json.dumps(self.state))
        os.replace(tmp, self.work / "state.json")

    def tidy(self, files: list[RemoteFile]) -> None:
        """Drop what another revision left: finished files fetched as other content and
        unfinished ones of files not wanted now."""
        for f in files:
            if self.path(f).exists() and not self.done(f):
                self.path(f).unlink()
        keep = {self.incomplete(f).name for f in files}
        for tmp in self.work.glob("*.incomplete"):
            if tmp.name not in keep:
                tmp.unlink()

    def verify(self, f: RemoteFile) -> str:
        """The file's sha256, checked against the Hub's listing once; a mismatch deletes
        the file and raises `PullError` (checksum)."""
        known = self.sha256(f)
        if known is not None:
            return known
        sha256, git = _hashes(self.path(f), f.size)
        wrong = None
        if f.sha256 is not None and sha256 != f.sha256:
            wrong = ("sha256", f.sha256, sha256)
        elif f.sha256 is None and f.blob_id is not None and git != f.blob_id:
            wrong = ("git blob id", f.blob_id, git)
        if wrong is not None:
            self.path(f).unlink()
            self.state.pop(f.path, None)
            raise PullError(
                "checksum",
                f"{f.path}: {wrong[0]} mismatch (expected {wrong[1]}, got {wrong[2]}); the "
                "file was deleted: pull again to fetch it anew",
            )
        self.mark(f, sha256)
        return sha256

    def finish(self, files: list[RemoteFile]) -> None:
        """Leave only the model's files in the folder."""
        shutil.rmtree(self.work, ignore_errors=True)
        shutil.rmtree(self.folder / ".cache", ignore_errors=True)
        wanted = {self.path(f) for f in files}
        for path in sorted(self.folder.rglob("*"), reverse=True):  # files before folders
            if path.is_file() and path not in wanted:
                path.unlink()
            elif path.is_dir() and not any(path.iterdir()):
                path.rmdir()


def size_of(path: Path) -> int:
    return path.stat().st_size


def _hashes(path: Path, size: int) -> tuple[str, str]:
    """(sha256, git blob id) of the file, in one read."""
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode())
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha256.update(chunk)
            git.update(chunk)
    return sha256.hexdigest(), git.hexdigest()
