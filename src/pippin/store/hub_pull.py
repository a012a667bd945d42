"""Pull a model from the Hugging Face Hub into the library: `pippin pull` and Ollama's
/api/pull share it, and hear of its progress through plain events (`PullEvent`).

`plan_pull` lists the repo (sizes, LFS checksums, commit), picks the files
(`hub_files.choose_files`) and checks the free disk space; `run_pull` downloads them into
the name's partial folder, verifies them and publishes the model. A pull never makes a
model listed until every file is checked: an interrupted pull leaves its partial folder,
and the next pull of that name resumes each file where it stopped (HTTP ranges).

Files go over plain HTTP through `huggingface_hub` (its HEAD, redirects, token and
retries), whether the Hub keeps them in Xet or not: huggingface_hub deletes an
interrupted download, so the partial file is kept here. LFS files are checked against the
sha256 the Hub lists, the others against their git blob id. A file another library model
already holds (same sha256) is hard-linked, not downloaded again.
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, cast
from urllib.parse import urlparse

from pippin.store.hub_files import HubRef, PullError, RemoteFile, choose_files, parse_name
from pippin.store.library import ModelLibrary, StoredFile, StoredModel
from pippin.store.pull_folder import PullFolder, size_of


@dataclass(frozen=True)
class PullEvent:
    """One step of a pull: a status alone, or a file's progress (Ollama's fields)."""

    status: str
    digest: str | None = None  # sha256:<hex> of the file
    total: int | None = None
    completed: int | None = None
    file: str | None = None  # its path in the repo (for a terminal's label)

    def wire(self) -> dict[str, Any]:
        """Ollama's progress object."""
        out: dict[str, Any] = {"status": self.status}
        for key in ("digest", "total", "completed"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


Progress = Callable[[PullEvent], None]


def _ignore(_: PullEvent) -> None:
    pass


@dataclass(frozen=True)
class PullPlan:
    ref: HubRef
    commit: str
    files: list[RemoteFile]
    entry: str  # the GGUF file's path, or "" for a model folder
    format: str  # "gguf" or "safetensors"
    endpoint: str | None  # None: huggingface_hub's (HF_ENDPOINT)
    needed: int  # bytes still to download


def plan_pull(
    name: str, library: ModelLibrary, *, revision: str | None = None, endpoint: str | None = None
) -> PullPlan:
    """What pulling ``name`` fetches; `PullError` if the repo, revision or tag is not
    there, or the disk has no room for what remains to download."""
    from huggingface_hub import HfApi

    ref = parse_name(name)
    try:
        info = HfApi(endpoint=endpoint).model_info(ref.repo, revision=revision, files_metadata=True)
    except Exception as e:
        _raise_as_pull_error(e, ref, None, revision)
    if not info.sha or info.siblings is None:
        raise PullError("network", f"Hugging Face's answer for {ref.repo} lists no commit")
    listed = []
    for s in info.siblings:
        if s.rfilename.startswith("/") or ".." in s.rfilename.split("/"):
            continue  # a path that would leave the model's folder
        size = s.size if s.size is not None else (s.lfs.size if s.lfs else None)
        if size is None:
            raise PullError("network", f"Hugging Face lists no size for {ref.repo}/{s.rfilename}")
        listed.append(RemoteFile(s.rfilename, size, s.lfs.sha256 if s.lfs else None, s.blob_id))
    files, entry, fmt = choose_files(ref, listed)
    part = PullFolder(library.partial(ref.name))
    known = _known_files(library)
    needed = sum(f.size - part.in_hand(f) for f in files if f.sha256 not in known)
    free = shutil.disk_usage(library.root).free
    if needed > free:
        raise PullError(
            "disk",
            f"not enough disk space to pull {ref.name}: {_size(needed)} to download, "
            f"{_size(free)} free in the models folder",
        )
    return PullPlan(ref, info.sha, files, entry, fmt, endpoint, needed)


def run_pull(
    plan: PullPlan,
    library: ModelLibrary,
    progress: Progress = _ignore,
    cancel: threading.Event | None = None,
) -> StoredModel:
    """Download, verify and publish ``plan``'s model; events go to ``progress`` (on this
    thread). ``cancel`` set: stops at the next chunk with `PullError` (cancelled), the
    partial folder kept for the next pull."""
    current = None  # the file being fetched, for error messages
    try:
        with _locked(library, plan.ref.name, progress, cancel):
            part = PullFolder(library.partial(plan.ref.name))
            part.tidy(plan.files)
            _link_known(library, plan.files, part)
            for f in sorted(plan.files, key=lambda f: f.sha256 is not None):  # small ones first
                current = f.path
                _fetch(plan, f, part, progress, cancel)
            current = None
            progress(PullEvent("verifying sha256 digest"))
            for f in plan.files:
                part.verify(f)
            _check(cancel)
            progress(PullEvent("writing manifest"))
            stored = _publish(plan, library, part)
        progress(PullEvent("success"))
        return stored
    except Exception as e:
        _raise_as_pull_error(e, plan.ref, current, plan.commit)


def pull(
    name: str,
    library: ModelLibrary,
    progress: Progress = _ignore,
    *,
    revision: str | None = None,
    endpoint: str | None = None,
    cancel: threading.Event | None = None,
) -> StoredModel:
    """`plan_pull` and `run_pull`, with a ``pulling manifest`` event first."""
    progress(PullEvent("pulling manifest"))
    plan = plan_pull(name, library, revision=revision, endpoint=endpoint)
    return run_pull(plan, library, progress, cancel)


@contextmanager
def _locked(
    library: ModelLibrary, name: str, progress: Progress, cancel: threading.Event | None
) -> Iterator[None]:
    """One pull of a name at a time, across processes (the server and `pippin pull`); a
    second waits, then finds the files the first published and links them."""
    from filelock import FileLock, Timeout

    folder = library.partial(name)
    lock = FileLock(str(folder.with_name(folder.name + ".lock")))
    waiting = False
    while True:
        try:
            lock.acquire(timeout=0.5)
            break
        except Timeout:
            _check(cancel)
            if not waiting:
                progress(PullEvent(f"waiting for another pull of {name}"))
                waiting = True
    try:
        yield
    finally:
        lock.release()


def _check(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise PullError("cancelled", "the pull was cancelled")


# --- fetching ----------------------------------------------------------------------


def _known_files(library: ModelLibrary) -> dict[str, Path]:
    """sha256 -> a file of a library model that has it."""
    known = {}
    for model in library.list():
        for f in model.files:
            path = model.folder / f.name
            if f.sha256 and path.is_file() and size_of(path) == f.size:
                known[f.sha256] = path
    return known


def _link_known(library: ModelLibrary, files: list[RemoteFile], part: PullFolder) -> None:
    known = _known_files(library)
    for f in files:
        source = known.get(f.sha256 or "")
        if source is None or part.done(f):
            continue
        part.path(f).parent.mkdir(parents=True, exist_ok=True)
        part.path(f).unlink(missing_ok=True)
        try:
            os.link(source, part.path(f))
        except OSError:
            continue  # no hard links here: downloaded instead
        part.mark(f, f.sha256)  # verified when that model was pulled or created


def _file_event(f: RemoteFile, sha256: str, completed: int) -> PullEvent:
    return PullEvent(f"pulling {sha256[:12]}", f"sha256:{sha256}", f.size, completed, f.path)


class _Meter:
    """What huggingface_hub's download reports its bytes to (a tqdm's place)."""

    def __init__(self, on_bytes: Callable[[int], None]) -> None:
        self.on_bytes = on_bytes

    def update(self, n: int) -> None:
        self.on_bytes(n)

    def __enter__(self) -> _Meter:
        return self

    def __exit__(self, *_: object) -> None:
        return None


def _fetch(
    plan: PullPlan,
    f: RemoteFile,
    part: PullFolder,
    progress: Progress,
    cancel: threading.Event | None,
) -> None:
    """Download ``f`` unless it is here; a regular file (small) is verified at once, so
    its event carries its sha256 as the LFS files' do."""
    _check(cancel)
    if f.sha256 is None:
        if not part.done(f):
            _download(plan, f, part, lambda n: _check(cancel))
        progress(_file_event(f, part.verify(f), f.size))
        return
    completed = part.in_hand(f)
    progress(_file_event(f, f.sha256, completed))
    if part.done(f):
        return

    def on_bytes(n: int) -> None:
        nonlocal completed
        _check(cancel)
        completed += n
        assert f.sha256 is not None
        progress(_file_event(f, f.sha256, completed))

    _download(plan, f, part, on_bytes)
    if completed != f.size:
        progress(_file_event(f, f.sha256, f.size))


def _download(
    plan: PullPlan, f: RemoteFile, part: PullFolder, on_bytes: Callable[[int], None]
) -> None:
    """Fetch ``f`` into its unfinished file from where that stops, then put it in place."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(plan.ref.repo, f.path, revision=plan.commit, endpoint=plan.endpoint)
    meta = get_hf_file_metadata(url, endpoint=plan.endpoint, retry_on_errors=True)
    headers = build_hf_headers()
    if urlparse(meta.location).netloc != urlparse(url).netloc:
        headers.pop("authorization", None)  # a CDN's signed URL: the token stays on the Hub
    tmp = part.incomplete(f)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "ab") as out:
        if out.tell() > f.size:  # not this file's start after all
            out.truncate(0)
            out.seek(0)
        http_get(
            meta.location,
            out,
            resume_size=out.tell(),
            headers=headers,
            expected_size=f.size,
            displayed_filename=f.path,
            tqdm_class=cast(Any, lambda **_: _Meter(on_bytes)),
        )
    part.path(f).parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, part.path(f))
    part.mark(f)


def _publish(plan: PullPlan, library: ModelLibrary, part: PullFolder) -> StoredModel:
    files = [StoredFile(f.path, f.size, part.verify(f)) for f in plan.files]
    part.finish(plan.files)
    model = StoredModel(
        name=plan.ref.name,
        content="",
        source=f"{plan.ref.repo}@{plan.commit}",
        files=files,
        entry=plan.entry,
        format=plan.format,
    )
    return library.publish(model, part.folder)


# --- errors ------------------------------------------------------------------------


def _raise_as_pull_error(
    e: Exception, ref: HubRef, path: str | None, revision: str | None
) -> NoReturn:
    """Raise ``e`` as a one-line `PullError`; one that is no pull failure unchanged."""
    error = _hub_error(e, ref, path, revision)
    if error is e:
        raise e
    raise error from e


def _hub_error(e: Exception, ref: HubRef, path: str | None, revision: str | None) -> Exception:
    import httpx2
    from huggingface_hub import errors as hf

    what = f"{ref.repo}/{path}" if path else ref.repo
    if isinstance(e, PullError):
        return e
    if isinstance(e, hf.GatedRepoError):
        return PullError(
            "auth",
            f"{ref.repo} is gated: accept its conditions on huggingface.co and give pippin "
            "a token (HF_TOKEN)",
        )
    if isinstance(e, hf.RepositoryNotFoundError):
        return PullError(
            "not_found",
            f"repository {ref.repo} not found on Hugging Face (a private one needs a token: "
            "HF_TOKEN)",
        )
    if isinstance(e, hf.RevisionNotFoundError):
        return PullError("not_found", f"revision '{revision}' not found in {ref.repo}")
    if isinstance(e, hf.RemoteEntryNotFoundError | hf.EntryNotFoundError):
        return PullError("not_found", f"file {path} not found in {ref.repo}")
    if isinstance(e, hf.HfHubHTTPError):
        status = e.response.status_code if e.response is not None else None
        if status in (401, 403):
            return PullError(
                "auth",
                f"Hugging Face refused {what} (HTTP {status}): a token with access is "
                "needed (HF_TOKEN)",
            )
        return PullError("network", f"Hugging Face answered HTTP {status} for {what}")
    if isinstance(e, hf.OfflineModeIsEnabled):
        return PullError("network", "HF_HUB_OFFLINE is set: pulling needs the Hub")
    if isinstance(e, httpx2.HTTPError | hf.FileMetadataError):
        return PullError("network", f"cannot download {what} from Hugging Face: {_line(e)}")
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return PullError("disk", f"the disk is full: {what} could not be written")
    if isinstance(e, OSError) and "Consistency check failed" in str(e):
        return PullError("network", f"{what}: the download ended short of the file's size")
    return e


def _line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _size(n: int) -> str:
    if n < 1000:
        return f"{n} B"
    value, units = n / 1000, ["KB", "MB", "GB", "TB"]
    while value >= 1000 and len(units) > 1:
        value, units = value / 1000, units[1:]
    return f"{value:.1f} {units[0]}"
