"""The prefix cache over HTTP: warm prompts, cache_salt, /v1/cache routes, restart reuse."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import anthropic
import openai
import pytest
from support.server_utils import Server, run_server

SYSTEM = "You are a careful assistant. " * 40  # a long shared system prompt
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _chat(server: Server, question: str, **extra: object) -> tuple[int, int]:
    r = server.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        tools=TOOLS,
        max_tokens=2,
        temperature=0,
        extra_body=extra or None,
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def _serve(model: Path, ssd: Path, *extra: str):
    return run_server(
        str(model),
        "--served-model-name",
        "tiny",
        "--block-size",
        "16",
        "--num-kv-blocks",
        "64",
        "--ssd-cache-dir",
        str(ssd),
        *extra,
    )


def test_warm_prompts_salt_cache_routes_and_restart(
    tiny_models: Callable[..., Path], tmp_path: Path
) -> None:
    model = tiny_models("llama")
    ssd = tmp_path / "ssd"
    warm = tmp_path / "warm.json"
    warm.write_text(
        json.dumps(
            [
                {
                    "messages": [
                        {"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "warm-up"},
                    ],
                    "tools": TOOLS,
                },
                "A plain text prompt to warm up with. " * 5,
            ]
        )
    )
    with _serve(model, ssd, "--warm-prompts", str(warm)) as server:
        # Warm: the first real request already finds the system prompt and tools cached.
        prompt, cached = _chat(server, "What is the weather in Paris?")
        assert prompt > 200 and cached >= 160
        http = server.http()
        stats = http.get("/v1/cache/stats").json()
        assert stats["memory"]["blocks"] > 0 and stats["memory"]["hits"] > 0
        assert stats["ssd"]["enabled"] is True and stats["ssd"]["degraded"] is False

        # cache_salt: another salt shares nothing, the same salt shares.
        assert _chat(server, "What is the weather in Rome?", cache_salt="tenant-a")[1] == 0
        assert _chat(server, "What is the weather in Oslo?", cache_salt="tenant-a")[1] >= 160
        assert _chat(server, "What is the weather in Oslo?", cache_salt="tenant-b")[1] == 0
        with pytest.raises(openai.BadRequestError) as exc:
            _chat(server, "x", cache_salt="")
        assert exc.value.body["param"] == "cache_salt"  # type: ignore[index]
        r = server.client().completions.create(
            model="tiny", prompt="Hello there " * 30, max_tokens=1, extra_body={"cache_salt": "s"}
        )
        assert r.usage is not None

        # Clearing one tier; an unknown tier is refused.
        bad = http.delete("/v1/cache", params={"tier": "disk"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tier"
        cleared = http.delete("/v1/cache", params={"tier": "memory"}).json()
        assert cleared["cleared_blocks"]["memory"] > 0 and "ssd" not in cleared["cleared_blocks"]
        assert http.get("/v1/cache/stats").json()["memory"]["blocks"] == 0
        _chat(server, "What is the weather in Paris?")  # cached again in memory
    # Shutdown wrote the cached blocks to disk; a new server finds them.
    with _serve(model, ssd) as server:
        prompt, cached = _chat(server, "What is the weather in Lima?")
        assert cached >= 160
        stats = server.http().get("/v1/cache/stats").json()
        assert stats["ssd"]["promoted"] > 0 and stats["ssd"]["corrupt"] == 0
        cleared = server.http().delete("/v1/cache").json()["cleared_blocks"]
        assert cleared["ssd"] > 0
        assert server.http().get("/v1/cache/stats").json()["ssd"]["blocks"] == 0


def test_bad_warm_prompts_file_stops_start_up(
    tiny_models: Callable[..., Path], tmp_path: Path
) -> None:
    warm = tmp_path / "warm.json"
    warm.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(RuntimeError, match="JSON list"):
        with _serve(tiny_models("llama"), tmp_path / "ssd", "--warm-prompts", str(warm)):
            pass


def test_a_hybrid_model_s_agent_turns_resume_over_both_apis(
    tiny_models: Callable[..., Path], tmp_path: Path
) -> None:
    """Qwen3-Next's gated-delta layers resume from recurrent-state snapshots: the next
    turn of a conversation (its answer included) reports the reused prefix on both APIs,
    /metrics counts the snapshots, and a restart finds them on disk."""
    model = tiny_models("qwen3_next")
    with _serve(model, tmp_path / "ssd") as server:
        client = server.client()
        messages: list[dict] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is the weather in Paris?"},
        ]
        first = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=24, temperature=0
        )
        assert first.usage is not None and first.usage.prompt_tokens > 200
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content or ""},
            {"role": "user", "content": "And in Rome?"},
        ]
        second = client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=4, temperature=0
        )
        details = second.usage and second.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens
        # The system prompt and tools at least; the rest of the first turn where the
        # template renders it as the model wrote it.
        assert details.cached_tokens >= first.usage.prompt_tokens - 16

        anthropic_client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        m = anthropic_client.messages.create(
            model="tiny",
            system=SYSTEM,
            messages=[{"role": "user", "content": "Is it raining in Oslo?"}],
            max_tokens=2,
        )
        m2 = anthropic_client.messages.create(
            model="tiny",
            system=SYSTEM,
            messages=[{"role": "user", "content": "Is it raining in Oslo?"}],
            max_tokens=2,
        )
        assert m.usage.cache_read_input_tokens is not None
        assert m2.usage.cache_read_input_tokens and m2.usage.cache_read_input_tokens >= 160
        assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == (
            m.usage.input_tokens + m.usage.cache_read_input_tokens
        )
        metrics = server.http().get("/metrics").text
        hits = _series(metrics, "pippin_state_snapshot_hits_total")
        assert hits >= 2 and _series(metrics, "pippin_state_snapshot_bytes") > 0
    # Shutdown wrote blocks and snapshots to disk; a new server resumes from them.
    with _serve(model, tmp_path / "ssd") as server:
        again = server.client().chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, max_tokens=4, temperature=0
        )
        details = again.usage and again.usage.prompt_tokens_details
        assert details is not None and (details.cached_tokens or 0) >= 160
        stats = server.http().get("/v1/cache/stats").json()
        assert stats["ssd"]["snapshots"]["promoted"] > 0


def _series(metrics: str, name: str) -> float:
    """The sum of a Prometheus series' samples in an exposition text."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )
