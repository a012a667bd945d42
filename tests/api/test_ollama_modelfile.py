"""Ollama's Modelfile as /api/create reads it and /api/show writes it, and Modelfile
parameters as a library model's sampling defaults (no server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pippin.api.ollama.modelfile import parse_modelfile, write_modelfile
from pippin.serving.errors import ApiError
from pippin.serving.library_models import (
    ParameterError,
    merge_parameters,
    normalize_parameters,
    spec_from_stored,
)
from pippin.store.library import StoredModel

TEXT = '''# made by hand
from ./models/tiny
TEMPLATE """{{ messages }}
second line"""
SYSTEM "Be \\"brief\\"."
PARAMETER temperature 0.5
PARAMETER stop "<|im_end|>"
PARAMETER stop </s>

MESSAGE user Hi there
MESSAGE assistant """Ahoy!"""
LICENSE MIT
'''


def test_parse() -> None:
    m = parse_modelfile(TEXT)
    assert m.from_ == "./models/tiny"
    assert m.template == "{{ messages }}\nsecond line"
    assert m.system == 'Be "brief".'
    assert m.parameters == {"temperature": "0.5", "stop": ["<|im_end|>", "</s>"]}
    assert m.messages == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Ahoy!"},
    ]
    assert m.license == ["MIT"]


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("FROM x\nFOO bar\n", "'FOO'"),
        ('FROM x\nSYSTEM """never closed\n', "not closed"),
        ("FROM x\nPARAMETER temperature\n", "PARAMETER"),
        ("MESSAGE robot hello\n", "role"),
        ('SYSTEM "a" b\n', "unexpected text"),
    ],
)
def test_parse_errors_name_the_line(text: str, said: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_modelfile(text)
    assert info.value.status == 400 and said in info.value.message


def test_round_trip() -> None:
    settings = {
        "template": "{{ messages }}\nx",
        "system": "Be brief.",
        "parameters": {"temperature": 0.5, "stop": ["a", "b"], "use_mmap": True},
        "messages": [{"role": "user", "content": "Hi"}],
        "license": ["MIT"],
    }
    m = parse_modelfile(write_modelfile("tiny:latest", settings))
    assert m.from_ == "tiny:latest" and m.template == settings["template"]
    assert normalize_parameters(m.parameters) == settings["parameters"]
    assert m.messages == settings["messages"] and m.license == ["MIT"]


def test_parameters() -> None:
    got = normalize_parameters(
        {"temperature": "0.7", "top_k": 40, "num_ctx": "2048", "stop": "x", "num_gpu": 1}
    )
    assert got == {"temperature": 0.7, "top_k": 40, "num_ctx": 2048, "stop": ["x"], "num_gpu": 1}
    for bad, said in (
        ({"top_k": 1.5}, "integer"),
        ({"mirostat": 1}, "not supported"),
        ({"colour": 1}, "unknown parameter 'colour'"),
        ({"stop": [1]}, "strings"),
    ):
        with pytest.raises(ParameterError, match=said):
            normalize_parameters(bad)
    assert merge_parameters({"stop": ["a"], "top_k": 1}, {"stop": ["b"]}) == {
        "stop": ["a", "b"],
        "top_k": 1,
    }


def test_a_stored_models_spec(tmp_path: Path) -> None:
    stored = StoredModel(
        "tiny:latest",
        "abc",
        "test",
        [],
        settings={
            "template": "{{ messages }}",
            "system": "Be brief.",
            "parameters": {"repeat_penalty": 1.1, "num_predict": 64, "num_ctx": 1024},
            "messages": [{"role": "user", "content": "Hi"}],
        },
        root=tmp_path,
    )
    spec = spec_from_stored(stored)
    assert spec.model == str(tmp_path / "content" / "abc") and spec.names == ["tiny:latest"]
    assert spec.sampling == {"repetition_penalty": 1.1, "max_tokens": 64}
    assert spec.max_model_len == 1024 and spec.chat_template == "{{ messages }}"
    assert spec.system == "Be brief." and spec.messages == [{"role": "user", "content": "Hi"}]
