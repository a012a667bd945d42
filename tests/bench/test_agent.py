"""The `agent` workload: how its sessions are built, what each turn sends, and the per-turn
report. No server: requests go to a stub that answers at once."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from pippin.bench import agent, models, runner
from pippin.bench.cli import add_bench_args, workload_from_args
from pippin.bench.client import RequestResult
from pippin.bench.report import aggregate, later_turns, markdown, turn_rows, turn_table
from pippin.bench.runner import BenchConfig, BenchRun, Target, Window, run_session
from pippin.bench.sessions import make_sessions
from pippin.bench.workload import (
    Length,
    Session,
    Workload,
    load_tokenizer,
    load_workload,
    words_per_token,
)


def tokens(text: str) -> int:
    return len(load_tokenizer("llama3").encode(text, add_special_tokens=False).ids)


@pytest.fixture(scope="module")
def small() -> Workload:
    """The agent workload at a test's size, its lengths in Llama 3's real tokens."""
    w = load_workload("agent")
    return replace(
        w,
        system_tokens=3000,
        turns=4,
        tokenizer="llama3",
        words_per_token=words_per_token("llama3"),
    )


def test_the_builtin_agent_workload() -> None:
    w = load_workload("agent")
    assert (w.prompt_source, w.api, w.turns, w.system_tokens) == ("agent", "chat", 8, 12000)
    assert (w.tool_tokens.args, w.output_tokens.args, w.prompt_tokens.args) == (
        (300,),
        (100,),
        (100,),
    )
    assert w.temperature == 0.0  # greedy
    assert "8 turns" in w.describe() and "tool results 300" in w.describe()
    with pytest.raises(ValueError, match="agent sessions are chat"):
        replace(w, api="completions")


def test_sessions_share_only_the_system_prompt(small: Workload) -> None:
    sessions = make_sessions(small, 3 * small.turns, seed="1|0|0")
    assert len(sessions) == 3 and all(len(s.turns) == small.turns for s in sessions)
    assert len({s.system for s in sessions}) == 1
    assert all(s.tools == sessions[0].tools for s in sessions)
    firsts = [s.turns[0].text for s in sessions]
    assert len(set(firsts)) == 3
    assert len({t.split()[0] for t in firsts}) == 3  # they differ from their first token on
    # Another window (seed) starts cold: another system prompt.
    assert make_sessions(small, small.turns, seed="1|1|0")[0].system != sessions[0].system
    # The same seed gives the same sessions.
    again = make_sessions(small, 3 * small.turns, seed="1|0|0")
    assert [t.text for t in again[2].turns] == [t.text for t in sessions[2].turns]


def test_later_turns_are_tool_results_after_calls(small: Workload) -> None:
    s = make_sessions(small, small.turns, seed=0)[0]
    assert s.turns[0].call is None
    names = {t["function"]["name"] for t in s.tools or []}
    ids = set()
    for turn in s.turns[1:]:
        call = turn.call
        assert call is not None and call["type"] == "function"
        assert call["function"]["name"] in names
        tool = next(t for t in s.tools or [] if t["function"]["name"] == call["function"]["name"])
        args = json.loads(call["function"]["arguments"])  # a JSON string, as OpenAI sends
        assert set(args) == set(tool["function"]["parameters"]["required"])
        ids.add(call["id"])
        assert turn.max_tokens == 100
    assert len(ids) == small.turns - 1


def test_lengths_are_in_real_tokens(small: Workload) -> None:
    s = make_sessions(small, small.turns, seed=0)[0]
    tools = sum(tokens(json.dumps(t)) for t in s.tools or [])
    # The system text plus the tools' JSON, with ~70 tokens for the template's own lines.
    assert abs(tokens(s.system or "") + tools + 70 - 3000) <= 30
    assert abs(tokens(s.turns[0].text) - 100) <= 3
    for turn in s.turns[1:]:
        assert abs(tokens(turn.text) - 300) <= 5
    full = make_sessions(replace(small, system_tokens=12000), 8, seed=0)[0]
    assert len(full.tools or []) == len(agent.tool_definitions())
    assert abs(tokens(full.system or "") + tools + 70 - 12000) <= 120


def test_a_short_system_prompt_keeps_fewer_tools() -> None:
    counted = agent.tools_within(400, tokens)
    assert 1 <= len(counted) < len(agent.tool_definitions())
    assert sum(tokens(json.dumps(t)) for t in counted[:-1]) <= 200
    assert len(agent.tools_within(10, tokens)) == 1  # always one to call


class _Stub:
    """Stands in for `stream_request`: records each body, answers `answer <n>`."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def __call__(
        self, client: Any, url: str, body: dict[str, Any], headers: Any, retries: int
    ) -> RequestResult:
        self.bodies.append(json.loads(json.dumps(body)))  # as sent, not as later changed
        return RequestResult(
            ok=True, start=0.0, ttft=0.1, e2e=0.2, text=f"answer {len(self.bodies)}"
        )


def test_each_turn_sends_the_conversation_so_far(
    small: Workload, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = _Stub()
    monkeypatch.setattr(runner, "stream_request", stub)
    session = make_sessions(small, small.turns, seed=0)[0]
    got: list[RequestResult] = []
    asyncio.run(
        run_session(httpx.AsyncClient(), Target("t", "http://x"), small, session, got.append)
    )
    assert [r.turn for r in got] == list(range(small.turns))
    first = stub.bodies[0]
    assert first["tools"] == session.tools and first["temperature"] == 0.0
    assert first["max_tokens"] == 100 and first["ignore_eos"] is True
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert first["messages"][0]["content"] == session.system
    for i, (before, body) in enumerate(zip(stub.bodies, stub.bodies[1:], strict=False), 1):
        msgs = body["messages"]
        # Everything sent before, then the answer (with the call it made) and the result.
        assert msgs[: len(before["messages"])] == before["messages"]
        assistant, tool = msgs[len(before["messages"]) :]
        call = session.turns[i].call
        assert assistant == {"role": "assistant", "content": f"answer {i}", "tool_calls": [call]}
        assert tool == {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": session.turns[i].text,
        }
        assert len(msgs) == 2 + 2 * i


def test_a_session_a_client_at_each_level(small: Workload) -> None:
    cfg = BenchConfig(targets=[], workload=small, levels=[4.0])
    assert cfg.requests_at(4) == 4 * small.turns
    assert len(make_sessions(small, cfg.requests_at(4), seed=0)) == 4


def _result(turn: int, ttft: float, cached: int | None = None, ok: bool = True) -> RequestResult:
    return RequestResult(
        ok=ok,
        start=0.0,
        ttft=ttft,
        e2e=ttft + 1,
        prompt_tokens=1000 + 400 * turn,
        cached_tokens=cached,
        turn=turn,
        usage_tokens=10,
    )


def test_the_report_per_turn(small: Workload) -> None:
    cached = [_result(0, 2.0, 0), _result(0, 4.0, 0), _result(1, 0.2, 990), _result(1, 0.4, 990)]
    cached += [_result(2, 0.3, 1390), _result(2, 0.5, 1390)]
    cold = [_result(0, 3.0), _result(1, 3.2), _result(2, 3.6), _result(2, 0.0, ok=False)]
    targets = [Target("fast", "http://a"), Target("cold", "http://b")]
    cfg = BenchConfig(targets=targets, workload=replace(small, turns=3), levels=[2.0])
    machine = {"packages": {}, "gpus": [], "cpu": "x", "cores": 2, "memory_gib": 1, "os": "y"}
    run = BenchRun(
        cfg,
        {**machine, "python": "3"},
        [],
        [Window("fast", 2.0, 0, 10.0, cached), Window("cold", 2.0, 0, 10.0, cold)],
        "",
    )
    rows = turn_rows(run)
    assert [(r["server"], r["turn"]) for r in rows] == [
        ("fast", 1),
        ("fast", 2),
        ("fast", 3),
        ("cold", 1),
        ("cold", 2),
        ("cold", 3),
    ]
    fast1, fast2 = rows[0], rows[1]
    assert fast1["ttft_p50"] == pytest.approx(3.0) and fast1["ttft_max"] == 4.0
    assert fast2["ttft_x_turn1"] == pytest.approx(0.3 / 3.0)
    assert fast2["cached_tokens_mean"] == 990 and fast2["prompt_tokens_mean"] == 1400
    assert rows[3]["cached_tokens_mean"] is None  # the server did not say
    assert rows[5]["failed"] == 1 and rows[5]["requests"] == 2
    assert later_turns(cached) == {
        "later_ttft_x": pytest.approx(0.35 / 3.0),
        "later_ttft_max_x": pytest.approx(0.5 / 3.0),
    }
    summary = aggregate(run)
    assert summary[1]["later_ttft_x"] == pytest.approx(3.4 / 3.0)
    text = turn_table(rows, "concurrency")
    assert "| 2 | fast | 2 | 2/2 | 1,400 | 990 | 300.0 ms | 400.0 ms | 0.100 |" in text
    assert "Per turn:" in markdown(run, summary, "pippin bench --workload agent")


def test_the_command_line(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    args = p.parse_args(
        "--workload agent --sessions 2,3 --turns 5 --system-tokens 4000 --tool-tokens 200 "
        "--answer-tokens 32".split()
    )
    assert args.concurrency == [2, 3]
    w = workload_from_args(args)
    assert (w.turns, w.system_tokens, w.tool_tokens, w.output_tokens) == (
        5,
        4000,
        Length.parse(200),
        Length.parse(32),
    )
    with pytest.raises(SystemExit):
        p.parse_args(["--sessions", "2", "--request-rate", "1"])


def test_the_qwen35_shapes() -> None:
    nine = models.CONFIGS["qwen3.5-9b"]
    assert nine["model_type"] == "qwen3_5" and nine["text_config"]["vocab_size"] == 248320
    tiny = models.CONFIGS["tiny-qwen3.5"]["text_config"]
    # The same layer pattern: every fourth layer full attention, the real head sizes.
    for key in ("full_attention_interval", "head_dim", "linear_key_head_dim", "rope_parameters"):
        assert tiny[key] == nine["text_config"][key]


def test_the_tools_template_extends_each_prompt(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    # Qwen3.5's layout: pieces up to 248,043, then the special tokens.
    eos = models.qwen35_tokenizer(tmp_path, 248320)
    assert eos == [248046, 248044]
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]) == eos
    assert tok.decode([200000]) == "zz200000" and tok.decode([1000]) == "atus"
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 248045
    s = Session([], system="Be brief.", tools=agent.tool_definitions()[:2])
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "read_file", "arguments": {"path": "a"}},
    }
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": s.system},
        {"role": "user", "content": "Go."},
    ]
    one = tok.apply_chat_template(msgs, tools=s.tools, tokenize=False, add_generation_prompt=True)
    assert one.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert '\n<tools>\n{"type": "function"' in one and one.endswith(
        "Go.<|im_end|>\n<|im_start|>assistant\n"
    )
    msgs += [
        {"role": "assistant", "content": "Reading.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "x = 1"},
    ]
    two = tok.apply_chat_template(msgs, tools=s.tools, tokenize=False, add_generation_prompt=True)
    assert two.startswith(one)
    assert two[len(one) :] == (
        'Reading.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nx = 1\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
