"""`pippin ls`, `pippin rm` and `pippin ps` (`pippin.cli.models_cmds`): the library's
models listed and deleted, and a running server's loaded models."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import pytest
from support.server_utils import run_server

from pippin.cli.models_cmds import add_models_parsers, ago, human_size
from pippin.store.library import ModelLibrary, StoredFile, StoredModel


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pippin")
    add_models_parsers(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.models_command(args)


def add(library: ModelLibrary, name: str, size: int) -> StoredModel:
    folder = library.partial(name)
    (folder / "model.gguf").write_bytes(b"x" * size)
    files = [StoredFile("model.gguf", size)]
    return library.publish(StoredModel(name, "", "test", files, entry="model.gguf"), folder)


def test_ls_and_rm(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    library = ModelLibrary(tmp_path)
    first = add(library, "first", 1500)
    add(library, "org/second:q4", 10)
    library.copy("first", "alias")
    assert cli("ls", "--models-dir", str(tmp_path)) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "ID", "SIZE", "MODIFIED"]
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["alias:latest", "org/second:q4", "first:latest"]  # newest first
    row = lines[-1].split()
    assert row[1] == first.digest[:12] and " ".join(row[2:4]) == "1.5 KB"
    assert cli("rm", "first", "nope", "--models-dir", str(tmp_path)) == 1
    captured = capsys.readouterr()
    assert "deleted 'first'" in captured.out and "model 'nope' not found" in captured.err
    assert [m.name for m in library.list()] == ["org/second:q4", "alias:latest"]
    assert first.folder.is_dir()  # the alias still uses the files


def test_sizes_and_ages() -> None:
    assert human_size(999) == "999 B" and human_size(1_234_000) == "1.2 MB"
    assert ago(0, now=30) == "Less than a minute ago" and ago(0, now=7200) == "2 hours ago"


def test_ps_asks_a_running_server(
    tiny_models: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    with run_server(str(tiny_models("llama", seed=1)), "--served-model-name", "tiny") as s:
        port = s.url.rsplit(":", 1)[1]
        assert cli("ps", "--port", port) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split() == ["NAME", "ID", "SIZE", "CONTEXT", "UNTIL"]
        assert lines[1].split()[0] == "tiny"
    assert cli("ps", "--port", port) == 1  # the server is gone
    assert "cannot reach" in capsys.readouterr().err
