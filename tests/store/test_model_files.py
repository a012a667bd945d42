"""The files of a created model (`pippin.store.model_files`): blob uploads checked against
their digest, file names kept inside the model's folder, what makes a model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from pippin.store.model_files import (
    BlobWriter,
    ModelFilesError,
    blob_path,
    gather,
    model_format,
    safe_name,
)


def test_blobs_are_kept_only_when_their_digest_matches(tmp_path: Path) -> None:
    data = b"some weights"
    digest = f"sha256:{hashlib.sha256(data).hexdigest()}"
    bad = BlobWriter(blob_path(tmp_path, f"sha256:{'0' * 64}"))
    bad.write(data)
    assert not bad.finish() and not list((tmp_path / "blobs").iterdir())
    good = BlobWriter(blob_path(tmp_path, digest))
    for i in range(0, len(data), 5):
        good.write(data[i : i + 5])
    assert good.finish() and blob_path(tmp_path, digest).read_bytes() == data
    for wrong in ("sha256:xyz", "md5:" + "0" * 64, "0" * 64):
        with pytest.raises(ModelFilesError):
            blob_path(tmp_path, wrong)


def test_file_names_stay_inside() -> None:
    assert safe_name("sub/model.safetensors") == "sub/model.safetensors"
    for bad in ("", "/etc/passwd", "../x", "a/../../x"):
        with pytest.raises(ModelFilesError):
            safe_name(bad)


def test_model_format() -> None:
    assert model_format(["m.gguf"]) == ("gguf", "m.gguf")
    assert model_format(["config.json", "model.safetensors", "tokenizer.json"]) == (
        "safetensors",
        "",
    )
    with pytest.raises(ModelFilesError, match="config.json"):
        model_format(["model.safetensors", "tokenizer.json"])
    with pytest.raises(ModelFilesError, match="more than one"):
        model_format(["a.gguf", "b.gguf"])


def test_gather_links_and_sums(tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(b"abc")
    got = gather(tmp_path / "out", {"sub/w.bin": src}, {})
    assert got[0].name == "sub/w.bin" and got[0].size == 3
    assert got[0].sha256 == hashlib.sha256(b"abc").hexdigest()
    assert (tmp_path / "out" / "sub" / "w.bin").read_bytes() == b"abc"
