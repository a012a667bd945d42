"""Claude Code itself (`claude -p`) against pippin's Anthropic API, with a tiny model and
with the real Qwen2.5-Coder GGUF (no thinking mode).

Claude Code sends everything a real agent session does (a 26k-token system prompt,
a dozen tools, adaptive thinking, effort, context management, mid-conversation system
messages, streaming, a max_tokens beyond the model's context, served up to the context's
end); a protocol mismatch shows up as an API error in its result.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from support.npm_tools import CLAUDE_CODE, npm_bin
from support.server_utils import run_server
from support.tiny_models import CHAT_TEMPLATE


def _without_tools(src: Path, dest: Path) -> Path:
    """A copy of a tiny model whose chat template shows no tools (and has no thinking)."""
    shutil.copytree(src, dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    template = CHAT_TEMPLATE[CHAT_TEMPLATE.index("{%- for message in messages -%}") :]
    assert "tools" not in template
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg))
    return dest


@pytest.mark.parametrize("which", ["tiny-qwen3", "tiny-no-tools", "qwen2.5-coder-gguf"])
def test_claude_code_print_mode(
    which: str, tiny_models: Callable[..., Path], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The tiny model's template has tools; the second tiny one's has none (they go into
    the system prompt in the generic format); Qwen2.5-Coder's GGUF (real weights) has
    tools but no thinking mode. None of them can think: Claude Code's `thinking` is
    answered without thinking."""
    claude = npm_bin(CLAUDE_CODE, "claude", "Claude Code")
    if which == "tiny-qwen3":
        model, args = tiny_models("qwen3"), ("--max-model-len", "65536")
    elif which == "tiny-no-tools":  # Claude Code's tools in the generic tool format
        factory = request.getfixturevalue("tmp_path_factory")
        model = _without_tools(tiny_models("qwen3"), factory.mktemp("no-tools") / "model")
        args = ("--max-model-len", "65536")
    else:
        # Claude Code sends no temperature: greedy, the real model takes its likeliest
        # course. At temperature 1 it sometimes went on calling tools with made-up
        # arguments (19 turns, 209 s on an idle machine; past 900 s in CI).
        model = request.getfixturevalue("qwen_gguf")
        args = ("--max-model-len", "32768", "--default-temperature", "0")
    # Real weights read a 26k-token prompt for minutes on a 2-core CPU (over 600 s when
    # busy): with them, Claude Code's own short system prompt and one tool, still with its
    # thinking, effort and streaming, and bounds on its tool turns and answers' lengths.
    # The tiny models get the whole agent prompt.
    real = which == "qwen2.5-coder-gguf"
    short = [
        "--system-prompt",
        "You are a concise assistant.",
        "--tools",
        "Read",
        "--max-turns",
        "2",
    ]
    short = short if real else []
    with run_server(str(model), *args, api_key="sk-cc", startup_timeout=900) as server:
        env = {
            **os.environ,
            "HOME": str(tmp_path),  # a fresh Claude Code config, no login
            "ANTHROPIC_BASE_URL": server.url,
            "ANTHROPIC_API_KEY": "sk-cc",
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        if real:  # greedy, it can repeat itself until the context ends: a bounded answer
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = "256"
        r = subprocess.run(
            [str(claude), "-p", "Say hello", "--output-format", "json", *short],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        answered = server.answered("/v1/messages")
    try:
        result = json.loads(r.stdout)
    except ValueError:
        raise AssertionError((r.returncode, r.stdout[-2000:], r.stderr[-2000:])) from None
    assert result.get("api_error_status") is None, result  # a max_turns result has none
    # A real model that keeps calling tools meets the turn bound: the agent's choice, no
    # API error (the tool calls and results went back and forth).
    if not (real and result["terminal_reason"] == "max_turns"):
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
        assert result["is_error"] is False and result["terminal_reason"] == "completed", result
    # Claude Code's real system prompt (a short one of its own with the real weights).
    assert result["usage"]["input_tokens"] > (100 if real else 10_000)
    # Every request it made was answered: no 4xx/5xx (no retries after refusals; its
    # max_tokens past the context is served, as the hosted API serves it).
    assert answered and all(status == "200" for _, status in answered), answered
