"""Pulling models from the Hugging Face Hub (`pippin.store.hub_pull`), against a fake hub
on the loopback address (`support.fake_hub`) that answers as the Hub does: names and
tags, a model folder and a GGUF file picked by its tag, then loaded; a dropped connection
resumed within a pull and across pulls (a failed or cancelled one), a wrong checksum, 404s,
a gated repo, a full disk. A model is listed only once whole."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.fake_hub import FakeHub, fake_hub
from support.waiting import wait_for

from pippin.store import hub_pull
from pippin.store.hub_files import (
    FOLDER_PATTERNS,
    HubRef,
    PullError,
    RemoteFile,
    choose_files,
    parse_name,
)
from pippin.store.hub_pull import PullEvent, plan_pull, pull
from pippin.store.library import ModelLibrary
from pippin.store.loaded import ModelLoadError
from pippin.store.loader import default_model_path, load_model

GGUF = "SmolLM2-135M-Instruct-Q4_1.gguf"


@pytest.fixture(scope="module")
def smol() -> Path:
    try:
        return default_model_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hub(tiny_models: Callable[..., Path], smol: Path) -> Iterator[FakeHub]:
    with fake_hub() as h:
        folder = {p.name: p for p in tiny_models("llama").iterdir() if p.is_file()}
        junk: dict[str, Path | bytes] = {
            "pytorch_model.bin": b"torch",
            "onnx/model.onnx": b"onnx",
            "original/params.json": b"{}",
            "images/logo.png": b"png",
        }
        h.add_repo("org/tiny-mlx", {**folder, **junk})
        h.add_repo(
            "org/smol-GGUF", {GGUF: smol, "SmolLM2-Q8_0.gguf": b"GGUF8", "mmproj-f16.gguf": b"p"}
        )
        yield h


@pytest.fixture(autouse=True)
def no_faults(hub: FakeHub) -> Iterator[None]:
    yield
    hub.clear()


@pytest.fixture
def library(tmp_path: Path) -> ModelLibrary:
    return ModelLibrary(tmp_path / "models")


def _pull(hub: FakeHub, library: ModelLibrary, name: str, **kw: object) -> list[PullEvent]:
    events: list[PullEvent] = []
    pull(name, library, events.append, endpoint=hub.url, **kw)  # type: ignore[arg-type]
    return events


def _fails(hub: FakeHub, library: ModelLibrary, name: str, kind: str) -> str:
    with pytest.raises(PullError) as e:
        _pull(hub, library, name)
    assert e.value.kind == kind, e.value
    assert "\n" not in e.value.message
    assert library.list() == []  # a failed pull lists nothing
    return e.value.message


def _partial_files(library: ModelLibrary, name: str) -> set[str]:
    folder = library.partial(name)
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


# --- names and files ---------------------------------------------------------------


def test_names() -> None:
    assert parse_name("hf.co/bartowski/Llama-3.2-1B-GGUF:Q4_K_M") == HubRef(
        "bartowski/Llama-3.2-1B-GGUF", "Q4_K_M", "hf.co/bartowski/Llama-3.2-1B-GGUF:Q4_K_M"
    )
    assert parse_name("huggingface.co/org/repo") == HubRef(
        "org/repo", None, "huggingface.co/org/repo:latest"
    )
    assert parse_name("HF.co/org/repo:latest").tag is None
    assert parse_name("org/repo") == HubRef("org/repo", None, "org/repo:latest")
    assert parse_name(" org/repo:q8_0 ").tag == "q8_0"
    for bad in ("llama3.2", "hf.co/llama3", "org/../x", "org//x", "a/b/c", "org/re po", ""):
        with pytest.raises(PullError) as e:
            parse_name(bad)
        assert e.value.kind == "bad_name"


def _files(*paths: str) -> list[RemoteFile]:
    return [RemoteFile(p, 10, "0" * 64 if p.endswith(".gguf") else None, None) for p in paths]


def _choose(name: str, *paths: str) -> tuple[list[str], str, str]:
    files, entry, fmt = choose_files(parse_name(name), _files(*paths))
    return [f.path for f in files], entry, fmt


def test_choosing_files() -> None:
    ggufs = ("m-Q4_K_M.gguf", "m-Q8_0.gguf", "m.UD-Q4_K_XL.gguf", "mmproj-m-f16.gguf")
    assert _choose("hf.co/o/r", *ggufs) == (["m-Q4_K_M.gguf"], "m-Q4_K_M.gguf", "gguf")
    assert _choose("o/r:q8_0", *ggufs)[1] == "m-Q8_0.gguf"
    assert _choose("o/r:ud-q4_k_xl", *ggufs)[1] == "m.UD-Q4_K_XL.gguf"
    assert _choose("o/r", "only-F16.gguf")[1] == "only-F16.gguf"  # the one GGUF, any tag
    for name, paths, said in [
        ("o/r:Q4_K", ggufs, "its tags: Q4_K_M, Q4_K_XL, Q8_0"),  # no prefix matches
        ("o/r", ("a-Q8_0.gguf", "a-F16.gguf"), "no GGUF file tagged 'Q4_K_M'"),
        ("o/r:Q4_0", ("a-Q4_0.gguf", "sub/b-Q4_0.gguf"), "matches several files"),
        ("o/r:Q4_0", ("Q4_0/a-Q4_0-00001-of-00002.gguf",), "split into 2 GGUF files"),
        ("o/r:Q4_0", ("config.json", "model.safetensors"), "no GGUF files, so no tag"),
        ("o/r", ("README.md", "pytorch_model.bin"), "neither GGUF files nor a safetensors"),
    ]:
        with pytest.raises(PullError, match=said):
            _choose(name, *paths)
    # A model folder: what mlx-lm loads, at the top level; a tag then means a GGUF file.
    mixed = ("config.json", "model.safetensors", "tokenizer.json", "README.md", "x.bin")
    extra = ("onnx/model.onnx", "original/params.json", "consolidated.safetensors", "m-Q4_0.gguf")
    assert _choose("o/r", *mixed, *extra) == (
        ["config.json", "model.safetensors", "tokenizer.json"],
        "",
        "safetensors",
    )
    assert _choose("o/r:q4_0", *mixed, *extra)[1] == "m-Q4_0.gguf"


def test_folder_files_are_mlx_lms() -> None:
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    assert list(FOLDER_PATTERNS) == DEFAULT_ALLOW_PATTERNS


# --- pulls -------------------------------------------------------------------------


def test_pull_model_folder(hub: FakeHub, library: ModelLibrary) -> None:
    events = _pull(hub, library, "org/tiny-mlx")
    stored = library.require("org/tiny-mlx")
    assert [m.name for m in library.list()] == ["org/tiny-mlx:latest"]
    repo = hub.repos["org/tiny-mlx"]
    assert stored.source == f"org/tiny-mlx@{repo.commit}" and stored.format == "safetensors"
    want = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"}
    names = {f.name for f in stored.files}
    assert want <= names and not names & {"README.md", ".gitattributes", "pytorch_model.bin"}
    assert not any("/" in n for n in names)
    assert {p.name for p in stored.folder.iterdir()} == names  # nothing of the pull's own
    for f in stored.files:
        assert f.sha256 == repo.files[f.name].sha256 and f.size == repo.files[f.name].size
    # Ollama's order: the manifest, each file (its last event complete), then the checks.
    statuses = [e.status for e in events]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    last = {e.digest: e for e in events if e.digest}
    assert {e.file for e in last.values()} == names
    assert all(
        e.completed == e.total and e.status == f"pulling {e.digest[7:19]}" for e in last.values()
    )  # type: ignore[index]
    assert not [p for p in (library.root / "partial").iterdir() if p.is_dir()]  # moved
    loaded = load_model(str(stored.path))
    assert loaded.tokenizer.encode("hello") and loaded.config["model_type"] == "llama"


def test_pull_gguf_by_tag(hub: FakeHub, library: ModelLibrary, smol: Path) -> None:
    _pull(hub, library, "hf.co/org/smol-GGUF:q4_1")  # tags are case-insensitive
    stored = library.require("hf.co/org/smol-GGUF:q4_1")
    assert stored.format == "gguf" and stored.entry == GGUF
    assert [f.name for f in stored.files] == [GGUF]
    assert stored.path.stat().st_size == smol.stat().st_size
    assert load_model(str(stored.path)).tokenizer.encode("hello")
    # No tag and no Q4_K_M among several: the tags are listed.
    message = _fails(
        hub, ModelLibrary(library.root.with_name("other")), "hf.co/org/smol-GGUF", "not_found"
    )
    assert "its tags: Q4_1, Q8_0" in message


def test_dropped_connection_resumes_within_the_pull(hub: FakeHub, library: ModelLibrary) -> None:
    size = hub.repos["org/smol-GGUF"].files[GGUF].size
    hub.drop_after("org/smol-GGUF", GGUF, 30_000_000)
    before = len(hub.gets("org/smol-GGUF", GGUF))
    _pull(hub, library, "hf.co/org/smol-GGUF:Q4_1")
    first, second = hub.gets("org/smol-GGUF", GGUF)[before:]
    assert first.range is None and first.sent == 30_000_000
    # huggingface_hub keeps what it wrote (whole 10 MiB chunks) and asks for the rest.
    assert second.range is not None and second.status == 206
    start = int(second.range.removeprefix("bytes=").rstrip("-"))
    assert 0 < start <= 30_000_000 and second.sent == size - start
    assert library.get("hf.co/org/smol-GGUF:Q4_1") is not None


def _resumed(hub: FakeHub, library: ModelLibrary, name: str, before: int) -> None:
    """The pull after an interrupted one fetched only the rest of the file."""
    size = hub.repos["org/smol-GGUF"].files[GGUF].size
    _pull(hub, library, name)
    again = hub.gets("org/smol-GGUF", GGUF)[before:]
    assert len(again) == 1 and again[0].range is not None, again
    start = int(again[0].range.removeprefix("bytes=").rstrip("-"))
    assert start > 0 and again[0].sent == size - start
    assert library.require(name).path.stat().st_size == size


def test_failed_pull_resumes_next_time(hub: FakeHub, library: ModelLibrary) -> None:
    name = "hf.co/org/smol-GGUF:Q4_1"
    hub.drop_after("org/smol-GGUF", GGUF, 30_000_000)
    hub.fail("org/smol-GGUF", GGUF, 503)  # the retry after the drop fails
    message = _fails(hub, library, name, "network")
    assert message == f"Hugging Face answered HTTP 503 for org/smol-GGUF/{GGUF}"
    assert any(n.endswith(".incomplete") for n in _partial_files(library, name))
    hub.clear()
    hub.settled()
    _resumed(hub, library, name, len(hub.gets("org/smol-GGUF", GGUF)))


def test_cancelled_pull_resumes_next_time(hub: FakeHub, library: ModelLibrary) -> None:
    name = "hf.co/org/smol-GGUF:Q4_1"
    cancel = threading.Event()

    def progress(e: PullEvent) -> None:
        if e.completed:  # the first chunk is written: stop here
            cancel.set()

    with pytest.raises(PullError, match="cancelled"):
        pull(name, library, progress, endpoint=hub.url, cancel=cancel)
    assert library.list() == []
    hub.settled()  # the cancelled GET is logged once the hub's next write to it fails
    _resumed(hub, library, name, len(hub.gets("org/smol-GGUF", GGUF)))


def test_checksum_mismatch(hub: FakeHub, library: ModelLibrary) -> None:
    wrong = hub.wrong_sha256("org/tiny-mlx", "model.safetensors")
    right = hub.repos["org/tiny-mlx"].files["model.safetensors"].sha256
    message = _fails(hub, library, "org/tiny-mlx", "checksum")
    assert message.startswith("model.safetensors: sha256 mismatch")
    assert f"expected {wrong}, got {right}" in message
    assert "model.safetensors" not in _partial_files(library, "org/tiny-mlx")  # deleted
    gets = len(hub.gets("org/tiny-mlx", "tokenizer.json"))
    hub.clear()
    _pull(hub, library, "org/tiny-mlx")
    assert library.require("org/tiny-mlx").files
    assert len(hub.gets("org/tiny-mlx", "tokenizer.json")) == gets  # kept, not fetched again


def test_not_found_and_refused(hub: FakeHub, library: ModelLibrary) -> None:
    said = _fails(hub, library, "hf.co/nobody/nothing", "not_found")
    assert said.startswith("repository nobody/nothing not found on Hugging Face")
    with pytest.raises(PullError, match="revision 'v9' not found in org/tiny-mlx"):
        _pull(hub, library, "org/tiny-mlx", revision="v9")
    hub.hide("org/tiny-mlx", "tokenizer.json")
    said = _fails(hub, library, "org/tiny-mlx", "not_found")
    assert said == "file tokenizer.json not found in org/tiny-mlx"
    hub.clear()
    hub.add_repo("org/gated", {"m-Q4_K_M.gguf": b"GGUF"})
    hub.gate("org/gated")
    assert "org/gated is gated" in _fails(hub, library, "org/gated", "auth")


def test_disk_full(hub: FakeHub, library: ModelLibrary, monkeypatch: pytest.MonkeyPatch) -> None:
    usage = shutil.disk_usage(library.root.parent)
    monkeypatch.setattr(hub_pull.shutil, "disk_usage", lambda _: usage._replace(free=1_000_000))
    before = len(hub.log)
    said = _fails(hub, library, "hf.co/org/smol-GGUF:Q4_1", "disk")
    assert said == (
        "not enough disk space to pull hf.co/org/smol-GGUF:Q4_1: 98.4 MB to download, "
        "1.0 MB free in the models folder"
    )
    assert all(s.path is None for s in hub.log[before:])  # only the listing was asked for


def test_pull_again_replaces_and_links(hub: FakeHub, library: ModelLibrary) -> None:
    name = "hf.co/org/smol-GGUF:Q4_1"
    _pull(hub, library, name)
    old = library.require(name)
    before = len(hub.gets("org/smol-GGUF", GGUF))
    events = _pull(hub, library, name)
    new = library.require(name)
    assert len(hub.gets("org/smol-GGUF", GGUF)) == before  # linked from the old copy
    assert new.content != old.content and not old.folder.exists()
    assert [m.name for m in library.list()] == [name]
    assert new.path.stat().st_size == old.size
    done = [e for e in events if e.digest]
    assert done and all(e.completed == e.total for e in done)
    # Another name with the same file shares it too.
    _pull(hub, library, "org/smol-GGUF:Q4_1")
    assert len(hub.gets("org/smol-GGUF", GGUF)) == before
    assert plan_pull(name, library, endpoint=hub.url).needed == 0


def test_pulls_of_one_name_take_turns(hub: FakeHub, library: ModelLibrary) -> None:
    """A second pull of a name waits for the first, then links what it fetched."""
    release = hub.hold("org/tiny-mlx", "model.safetensors", 0)
    before = len(hub.gets("org/tiny-mlx", "model.safetensors"))
    first = threading.Thread(target=_pull, args=(hub, library, "org/tiny-mlx"))
    first.start()
    try:
        work = library.partial("org/tiny-mlx") / ".pippin-pull"
        wait_for(lambda: any(work.glob("*.incomplete")), "the first pull downloading")
        events: list[PullEvent] = []
        second = threading.Thread(
            target=pull, args=("org/tiny-mlx", library, events.append), kwargs={"endpoint": hub.url}
        )
        second.start()
        wait_for(lambda: any(e.status.startswith("waiting for") for e in events), "a wait")
    finally:
        release.set()
        first.join()
    second.join()
    assert events[-1].status == "success"
    assert len(hub.gets("org/tiny-mlx", "model.safetensors")) == before + 1
    assert [m.name for m in library.list()] == ["org/tiny-mlx:latest"]
