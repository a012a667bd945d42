"""Speculative decoding over HTTP: `--speculative-config` on a real `pippin serve`, its
counters on /metrics (vLLM's `spec_decode_*` names), every KV block free when idle."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import openai
from support.server_utils import run_server
from support.tiny_models import with_swapped_tokens
from test_metrics import scrape, wait_idle

from pippin.bench.scrape import total

KEY = "sk-spec-test"


@contextmanager
def _spec_server(model: str, spec: dict[str, Any]) -> Iterator[tuple[Any, openai.OpenAI]]:
    """A server of `model` as "tiny" with `--speculative-config spec`, and its client."""
    args = ("--served-model-name", "tiny", "--max-model-len", "512")
    with run_server(model, *args, "--speculative-config", json.dumps(spec), api_key=KEY) as srv:
        yield srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY)


def test_speculation_counted_and_blocks_freed(tiny_models: Callable[..., Path]) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    rng = random.Random(0)
    prompt = [rng.randrange(3, 700) for _ in range(12)] * 4
    with _spec_server(str(tiny_models("llama")), spec) as (server, client):
        before = scrape(server)
        assert total(before, "pippin_spec_decode_num_draft_tokens_total") == 0
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=80,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.usage is not None and out.usage.completion_tokens == 80
        after = wait_idle(server)
        drafted = total(after, "pippin_spec_decode_num_draft_tokens_total") or 0
        kept = total(after, "pippin_spec_decode_num_accepted_tokens_total") or 0
        drafts = total(after, "pippin_spec_decode_num_drafts_total") or 0
        assert drafts > 0 and 0 < kept <= drafted <= 3 * drafts
        by_pos = [
            total(after, "pippin_spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(3)
        ]
        assert sum(p or 0 for p in by_pos) == kept
        assert total(after, "pippin_kv_blocks", tier="device", state="used") == 0


def test_bad_speculative_config_is_refused(tiny_models: Callable[..., Path]) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pippin.cli", "serve", str(tiny_models("llama")),
         "--speculative-config", '{"method": "eagle3"}'],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert "method 'eagle3' is not supported" in proc.stderr


def _plain_greedy(model: Path, prompt: list[int], n: int) -> str:
    """The target's greedy text without speculation, from an engine in this process."""
    from support.engine_runs import engine_config, loaded_model, run_to_end

    from pippin.engine.core import EngineCore
    from pippin.engine.types import SamplingParams

    core = EngineCore(loaded_model(model), engine_config(max_model_len=512))
    core.add_request("r", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return run_to_end(core)["r"]["text"][0]


def test_draft_model_over_http(tiny_models: Callable[..., Path]) -> None:
    """A server speculating with a draft model (the target's weights with another RoPE
    base): greedy completions are the target's own tokens, streamed or not; sampled ones
    run; acceptance is counted; every block of both models is free when idle."""
    target = tiny_models("llama")
    draft = tiny_models("llama", rope_theta=500.0)
    spec = {"model": str(draft), "num_speculative_tokens": 3}
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 700) for _ in range(n)] for n in (9, 30, 57)]
    with _spec_server(str(target), spec) as (server, client):
        for prompt in prompts:
            out = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=40,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert out.usage is not None and out.usage.completion_tokens == 40
            assert out.choices[0].text == _plain_greedy(target, prompt, 40)
            stream = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=40,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            assert "".join(c.choices[0].text for c in stream) == out.choices[0].text
        sampled = client.completions.create(
            model="tiny", prompt=prompts[0], max_tokens=30, temperature=0.8, n=3
        )
        assert len(sampled.choices) == 3
        after = wait_idle(server)
        drafted = total(after, "pippin_spec_decode_num_draft_tokens_total") or 0
        kept = total(after, "pippin_spec_decode_num_accepted_tokens_total") or 0
        assert 0 < kept < drafted
        assert total(after, "pippin_kv_blocks", tier="device", state="used") == 0
        assert total(after, "pippin_spec_draft_kv_blocks", state="used") == 0
        assert (total(after, "pippin_spec_draft_kv_blocks", state="free") or 0) > 0


def test_bad_draft_models_are_refused(tiny_models: Callable[..., Path], tmp_path: Path) -> None:
    def serve(spec: dict) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pippin.cli", "serve", str(tiny_models("llama")),
             "--speculative-config", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip

    missing = serve({"model": str(tmp_path / "nowhere")})
    assert missing.returncode != 0
    assert "draft model" in missing.stderr and "no such file or folder" in missing.stderr
    too_many = serve({"model": str(tmp_path), "num_speculative_tokens": 40})
    assert too_many.returncode == 2 and "num_speculative_tokens must be <= 32" in too_many.stderr
    # Another vocabulary: two of the tokenizer's ids swapped.
    other = with_swapped_tokens(tiny_models("llama", num_hidden_layers=1), tmp_path / "o")
    mismatch = serve({"model": str(other)})
    assert mismatch.returncode != 0
    assert "does not share the target's vocabulary" in mismatch.stderr, mismatch.stderr[-2000:]
