"""The model library (`pippin.store.library`): names, publishing from a partial folder,
copies that share their files, removal that keeps shared files, partial folders never
listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from pippin.store.library import LibraryError, ModelLibrary, StoredFile, StoredModel, normalize


def finished(library: ModelLibrary, name: str, text: str = "weights") -> Path:
    """A partial folder with one file, as a pull or create leaves it when done."""
    folder = library.partial(name)
    (folder / "model.safetensors").write_text(text)
    return folder


def publish(library: ModelLibrary, name: str, **kw: object) -> StoredModel:
    folder = finished(library, name)
    files = [StoredFile("model.safetensors", len("weights"))]
    return library.publish(StoredModel(name, "", "test", files, **kw), folder)  # type: ignore[arg-type]


def test_names() -> None:
    assert normalize("smollm2") == "smollm2:latest"
    assert normalize("org/repo:Q4_K_M") == "org/repo:Q4_K_M"
    assert normalize("hf.co/org/repo") == "hf.co/org/repo:latest"
    for bad in ("", "../x", "a/../b", "/abs", "a//b", "a/", "a b", ":tag", "x:y:z"):
        with pytest.raises(LibraryError):
            normalize(bad)


def test_publish_lists_the_model(tmp_path: Path) -> None:
    library = ModelLibrary(tmp_path)
    model = publish(library, "tiny", settings={"system": "hi"})
    assert [m.name for m in library.list()] == ["tiny:latest"]
    got = library.get("tiny")
    assert got is not None and got.settings == {"system": "hi"} and got.content == model.content
    assert (got.path / "model.safetensors").read_text() == "weights"
    assert got.size == len("weights") and len(got.digest) == 64
    assert library.get("tiny:other") is None and library.get("../x") is None
    with pytest.raises(LibraryError, match="not found"):
        library.require("other")


def test_partial_folders_are_never_listed(tmp_path: Path) -> None:
    library = ModelLibrary(tmp_path)
    finished(library, "half")
    assert library.list() == [] and library.get("half") is None
    assert library.partial("half") == library.partial("half:latest")  # kept, to resume
    library.discard_partial("half")
    assert not (tmp_path / "partial").exists() or not any((tmp_path / "partial").iterdir())


def test_copy_shares_the_files_with_its_own_settings(tmp_path: Path) -> None:
    library = ModelLibrary(tmp_path)
    source = publish(library, "tiny", settings={"system": "a"})
    copy = library.copy("tiny", "alias:v1", settings={"system": "b"})
    assert copy.content == source.content and copy.digest == source.digest
    assert copy.parent == "tiny:latest"
    assert library.require("alias:v1").settings == {"system": "b"}
    assert library.require("tiny").settings == {"system": "a"}
    assert len(list((tmp_path / "content").iterdir())) == 1


def test_remove_keeps_shared_content(tmp_path: Path) -> None:
    library = ModelLibrary(tmp_path)
    source = publish(library, "tiny")
    library.copy("tiny", "alias")
    library.remove("tiny")
    assert [m.name for m in library.list()] == ["alias:latest"]
    assert source.folder.is_dir()  # the copy still uses it
    library.remove("alias")
    assert library.list() == [] and not source.folder.exists()
    with pytest.raises(LibraryError):
        library.remove("alias")


def test_holds(tmp_path: Path) -> None:
    library = ModelLibrary(tmp_path / "lib")
    assert library.holds(tmp_path / "lib" / "content" / "x")
    assert not library.holds(tmp_path / "elsewhere")
