"""Speculative decoding over HTTP: `--speculative-config` on a real `pippin serve`, its
counters on /metrics (vLLM's `spec_decode_*` names), every KV block free when idle."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import openai
from server_utils import run_server
from test_metrics import scrape, wait_idle

from pippin.bench.scrape import total

KEY = "sk-spec-test"


def test_speculation_counted_and_blocks_freed(tiny_models: Callable[..., Path]) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    rng = random.Random(0)
    prompt = [rng.randrange(3, 700) for _ in range(12)] * 4
    with run_server(
        str(tiny_models("llama")),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
        "--speculative-config",
        json.dumps(spec),
        api_key=KEY,
    ) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
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
