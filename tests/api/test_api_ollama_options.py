"""Ollama's `options` and `keep_alive` as pippin reads them (no server needed)."""

from __future__ import annotations

import pytest

from pippin.api.ollama.protocol import context_option, keep_alive_seconds, sampling_options
from pippin.serving.errors import ApiError


def test_options_map_to_sampling_fields() -> None:
    fields, num_predict = sampling_options(
        {
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 7,
            "repeat_penalty": 1.1,
            "repeat_last_n": -1,
            "presence_penalty": 0.2,
            "frequency_penalty": 0.3,
            "stop": ["\n\n"],
            "num_predict": 12,
            # llama.cpp load options and ones Ollama dropped: accepted, no effect
            "num_gpu": 99,
            "rope_frequency_base": 10000.0,
            "mirostat": 2,
            "typical_p": 1.0,
            # Read by `context_option`.
            "num_ctx": 8192,
        }
    )
    assert fields == {
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 7,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.2,
        "frequency_penalty": 0.3,
        "stop": ["\n\n"],
    }
    assert num_predict == 12
    assert sampling_options({"num_predict": -1}) == ({}, None)
    assert sampling_options({"num_predict": -2}) == ({}, None)
    assert sampling_options({"seed": -1}) == ({}, None)  # Ollama's random seed
    assert sampling_options({"repeat_last_n": 0})[0] == {"repetition_penalty": 1.0}
    assert context_option({"num_ctx": 4096}) == 4096
    assert context_option({"num_ctx": None}) is None and context_option(None) is None


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"top_k": 1.5}, "top_k"),
        ({"stop": "x"}, "stop"),
        ({"num_predict": 0}, "num_predict"),
        ({"num_predict": -3}, "num_predict"),
        ({"typical_p": 0.5}, "typical_p"),
        ({"repeat_penalty": 1.2, "repeat_last_n": 64}, "repeat_last_n"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"num_ctx": 0}, "num_ctx"),
        ({"num_ctx": "big"}, "num_ctx"),
        ({"temprature": 0.5}, "temprature"),  # no Ollama version has it: a typo
    ],
)
def test_bad_options_are_400s_naming_the_option(options: dict, named: str) -> None:
    with pytest.raises(ApiError) as e:
        sampling_options(options)
    assert e.value.status == 400 and named in e.value.message


def test_keep_alive_durations() -> None:
    assert keep_alive_seconds(None) is None
    assert keep_alive_seconds("5m") == 300
    assert keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds("1.5s") == 1.5
    assert keep_alive_seconds("300ms") == 0.3
    assert keep_alive_seconds("300") == 300
    assert keep_alive_seconds(120) == 120
    assert keep_alive_seconds(0) == 0 and keep_alive_seconds("0") == 0
    assert keep_alive_seconds(-1) is None and keep_alive_seconds("-1m") is None  # forever
    for bad in ("soon", "5 m", "m", "", True, "5x"):
        with pytest.raises(ApiError) as e:
            keep_alive_seconds(bad)  # type: ignore[arg-type]
        assert e.value.status == 400
