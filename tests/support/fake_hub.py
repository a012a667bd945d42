"""A fake Hugging Face Hub on 127.0.0.1, for pulling models in tests without the internet.

It answers the requests `huggingface_hub` makes, as the Hub answers them:
``GET /api/models/{repo}[/revision/{rev}]`` (with ``?blobs=true``: each file's size, git
blob id and LFS sha256) and ``HEAD``/``GET /{repo}/resolve/{rev}/{path}`` (``X-Repo-Commit``,
``ETag``, ``X-Linked-Etag``/``X-Linked-Size`` for LFS files, ranges answered 206). It never
says ``X-Xet-Hash``, so every file comes over plain HTTP. An unknown repo is a 401 with
``X-Error-Code: RepoNotFound`` (what the Hub tells a client without a token), a missing
file a 404 ``EntryNotFound``, an unknown revision a 404 ``RevisionNotFound``.

Faults on request: a connection dropped after N bytes of a file, GETs of a file that fail
with a status, a wrong sha256 advertised for a file, a file listed but missing, a gated
repo. Every request is logged (`FakeHub.log`).
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

_LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".model", ".pt", ".onnx")
_LFS_ABOVE = 10 * 1024 * 1024  # the Hub keeps larger files in LFS whatever their type
_CHUNK = 1 << 16


@dataclass
class HubFile:
    data: Path | bytes
    size: int
    sha256: str
    git: str  # git blob id
    lfs: bool

    def read(self, start: int, end: int) -> Iterator[bytes]:
        if isinstance(self.data, bytes):
            yield self.data[start:end]
            return
        with open(self.data, "rb") as f:
            f.seek(start)
            left = end - start
            while left > 0 and (chunk := f.read(min(_CHUNK, left))):
                left -= len(chunk)
                yield chunk


@dataclass
class HubRepo:
    repo_id: str
    commit: str
    files: dict[str, HubFile]
    gated: bool = False


@dataclass
class Served:
    """One request the hub answered."""

    method: str
    repo: str | None
    path: str | None  # the file, for /resolve requests
    range: str | None
    status: int
    sent: int = 0  # body bytes written


def _hash_file(data: Path | bytes) -> tuple[int, str, str]:
    """(size, sha256, git blob id)."""
    raw = data if isinstance(data, bytes) else None
    size = len(raw) if raw is not None else Path(data).stat().st_size  # type: ignore[arg-type]
    sha = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode())
    chunks = [raw] if raw is not None else HubFile(data, size, "", "", False).read(0, size)
    for chunk in chunks:
        sha.update(chunk)
        git.update(chunk)
    return size, sha.hexdigest(), git.hexdigest()


@dataclass
class _Faults:
    drops: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # bytes, times left
    fails: dict[tuple[str, str], list[int]] = field(default_factory=dict)  # status, times left
    wrong: set[tuple[str, str]] = field(default_factory=set)
    hidden: set[tuple[str, str]] = field(default_factory=set)
    holds: dict[tuple[str, str], tuple[int, threading.Event]] = field(default_factory=dict)


class FakeHub:
    """Repos built from local files, served at `url` until `close`."""

    def __init__(self) -> None:
        self.repos: dict[str, HubRepo] = {}
        self.log: list[Served] = []
        self.faults = _Faults()
        self.lock = threading.Lock()
        self.busy = 0  # requests being answered
        self.idle = threading.Condition(self.lock)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.clear()  # a held download would keep its thread
        self.server.shutdown()
        self.server.server_close()

    # --- repos and faults ------------------------------------------------------
    def add_repo(
        self, repo_id: str, files: Path | dict[str, Path | bytes], *, readme: bool = True
    ) -> HubRepo:
        """A repo of ``files`` (a folder's files, or path -> file or bytes), with a
        README.md and .gitattributes as the Hub's repos have; a new commit each call."""
        if isinstance(files, Path):
            files = {str(p.relative_to(files)): p for p in sorted(files.rglob("*")) if p.is_file()}
        if readme:
            files = {"README.md": b"# a model\n", ".gitattributes": b"*.gguf filter=lfs\n", **files}
        entries = {}
        for path, data in files.items():
            size, sha256, git = _hash_file(data)
            lfs = path.endswith(_LFS_SUFFIXES) or size > _LFS_ABOVE
            entries[path] = HubFile(data, size, sha256, git, lfs)
        repo = HubRepo(repo_id, secrets.token_hex(20), entries)
        self.repos[repo_id] = repo
        return repo

    def drop_after(self, repo: str, path: str, nbytes: int, times: int = 1) -> None:
        """The next ``times`` GETs of the file close the connection after ``nbytes``."""
        self.faults.drops[(repo, path)] = [nbytes, times]

    def fail(self, repo: str, path: str, status: int, times: int = 1_000_000) -> None:
        """The next ``times`` GETs of the file answer ``status``."""
        self.faults.fails[(repo, path)] = [status, times]

    def hold(self, repo: str, path: str, nbytes: int) -> threading.Event:
        """GETs of the file stop after ``nbytes`` until the returned event is set."""
        release = threading.Event()
        self.faults.holds[(repo, path)] = (nbytes, release)
        return release

    def wrong_sha256(self, repo: str, path: str) -> str:
        """The listing and ETag advertise another sha256 for the file; returns it."""
        self.faults.wrong.add((repo, path))
        return self.advertised(repo, path)

    def hide(self, repo: str, path: str) -> None:
        """The file stays listed, but resolving it is a 404."""
        self.faults.hidden.add((repo, path))

    def gate(self, repo: str) -> None:
        """The repo's files need a token the client does not have (401 GatedRepo)."""
        self.repos[repo].gated = True

    def clear(self) -> None:
        for _, release in self.faults.holds.values():
            release.set()
        self.faults = _Faults()

    def advertised(self, repo: str, path: str) -> str:
        f = self.repos[repo].files[path]
        if (repo, path) in self.faults.wrong:
            return hashlib.sha256(b"not " + f.sha256.encode()).hexdigest()
        return f.sha256

    def settled(self, timeout: float = 120) -> None:
        """Wait until no request is being answered. A request is logged when its answer
        ends, and a client that left mid-file ends it only once a write to the closed
        connection fails, after the client has moved on."""
        with self.idle:
            if not self.idle.wait_for(lambda: self.busy == 0, timeout):
                raise AssertionError(f"{self.busy} request(s) still being answered")

    def gets(self, repo: str, path: str) -> list[Served]:
        """The GETs of a file, in order."""
        with self.lock:
            return [s for s in self.log if s.method == "GET" and (s.repo, s.path) == (repo, path)]

    # --- answers -----------------------------------------------------------------
    def info(self, repo: HubRepo) -> dict[str, Any]:
        siblings = []
        for path, f in repo.files.items():
            entry: dict[str, Any] = {"rfilename": path, "blobId": f.git, "size": f.size}
            if f.lfs:
                sha = self.advertised(repo.repo_id, path)
                entry["lfs"] = {"sha256": sha, "size": f.size, "pointerSize": 134}
            siblings.append(entry)
        return {
            "_id": repo.commit[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "author": repo.repo_id.split("/")[0],
            "sha": repo.commit,
            "lastModified": "2026-01-01T00:00:00.000Z",
            "createdAt": "2026-01-01T00:00:00.000Z",
            "private": False,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "tags": ["gguf"] if any(p.endswith(".gguf") for p in repo.files) else [],
            "siblings": siblings,
            "usedStorage": sum(f.size for f in repo.files.values()),
        }


_MODEL_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as huggingface_hub's client pools

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._answer(head=False)

        def do_HEAD(self) -> None:
            self._answer(head=True)

        def _answer(self, head: bool) -> None:
            served = Served(self.command, None, None, self.headers.get("Range"), 200)
            with hub.lock:
                hub.busy += 1
            try:
                self._route(head, served)
            except (BrokenPipeError, ConnectionResetError):  # the client left mid-file
                self.close_connection = True
            finally:
                with hub.lock:
                    hub.log.append(served)
                    hub.busy -= 1
                    hub.idle.notify_all()

        def _route(self, head: bool, served: Served) -> None:
            path = unquote(urlsplit(self.path).path)
            if m := _MODEL_API.match(path):
                served.repo = m.group(1)
                repo = self._repo(m.group(1), m.group(2), served)
                if repo is not None:
                    self._json(200, hub.info(repo), served)
                return
            if m := _RESOLVE.match(path):
                served.repo, served.path = m.group(1), m.group(3)
                repo = self._repo(m.group(1), m.group(2), served)
                if repo is not None:
                    self._file(repo, m.group(3), head, served)
                return
            self._error(404, "NotFound", "Not found", served)

        def _repo(self, repo_id: str, revision: str | None, served: Served) -> HubRepo | None:
            repo = hub.repos.get(repo_id)
            if repo is None:
                self._error(401, "RepoNotFound", "Repository not found", served)
                return None
            if revision not in (None, "main", repo.commit):
                self._error(404, "RevisionNotFound", "Invalid rev id", served, repo)
                return None
            return repo

        def _file(self, repo: HubRepo, path: str, head: bool, served: Served) -> None:
            key = (repo.repo_id, path)
            f = repo.files.get(path)
            if f is None or key in hub.faults.hidden:
                self._error(404, "EntryNotFound", "Entry not found", served, repo)
                return
            if repo.gated:
                self._error(401, "GatedRepo", "Access to this model is restricted", served, repo)
                return
            drop = hub.faults.drops.get(key)
            dropping = not head and drop is not None and drop[1] > 0
            fail = hub.faults.fails.get(key)
            if not head and not dropping and fail is not None and fail[1] > 0:
                fail[1] -= 1
                self._error(fail[0], None, "Server error", served, repo)
                return
            sha = hub.advertised(*key)
            headers = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
            if f.lfs:
                headers |= {"ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"'}
                headers["X-Linked-Size"] = str(f.size)
            else:
                headers["ETag"] = f'"{f.git}"'
            start, end, status = 0, f.size, 200
            if (rng := self.headers.get("Range")) and (m := _RANGE.match(rng)):
                start = int(m.group(1))
                end = min(int(m.group(2)) + 1, f.size) if m.group(2) else f.size
                if start >= f.size:
                    self._error(416, None, "Range not satisfiable", served, repo)
                    return
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end - 1}/{f.size}"
            served.status = status
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if head:
                return
            limit = end - start
            if dropping:
                assert drop is not None
                drop[1] -= 1
                limit = min(limit, drop[0])
            held = hub.faults.holds.get(key)
            for chunk in f.read(start, start + limit):
                if held is not None and served.sent + len(chunk) > held[0]:
                    self.wfile.flush()
                    held[1].wait()
                    held = None
                self.wfile.write(chunk)
                served.sent += len(chunk)
            if limit < end - start:  # the connection drops mid-file
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True

        def _json(self, status: int, body: dict[str, Any], served: Served) -> None:
            raw = json.dumps(body).encode()
            served.status = status
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)
                served.sent = len(raw)

        def _error(
            self,
            status: int,
            code: str | None,
            message: str,
            served: Served,
            repo: HubRepo | None = None,
        ) -> None:
            raw = json.dumps({"error": message}).encode()
            served.status = status
            self.send_response(status)
            if code is not None:
                self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if repo is not None:
                self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)

    return Handler


@contextmanager
def fake_hub() -> Iterator[FakeHub]:
    hub = FakeHub()
    try:
        yield hub
    finally:
        hub.close()
