"""Claude Code itself (`claude -p`) against pippin's Anthropic API, with a tiny model.

Claude Code sends everything a real agent session does (a 26k-token system prompt,
a dozen tools, adaptive thinking, effort, context management, mid-conversation system
messages, streaming); a protocol mismatch shows up as an API error in its result.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from npm_tools import npm_bin
from server_utils import run_server

CLAUDE_CODE = "@anthropic-ai/claude-code@2.1.332"


def test_claude_code_print_mode(tiny_models: Callable[..., Path], tmp_path: Path) -> None:
    claude = npm_bin(CLAUDE_CODE, "claude", "Claude Code")
    model = tiny_models("qwen3")
    with run_server(str(model), "--max-model-len", "65536", api_key="sk-cc") as server:
        env = {
            **os.environ,
            "HOME": str(tmp_path),  # a fresh Claude Code config, no login
            "ANTHROPIC_BASE_URL": server.url,
            "ANTHROPIC_API_KEY": "sk-cc",
            "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        }
        r = subprocess.run(
            [str(claude), "-p", "Say hello", "--output-format", "json"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        answered = server.answered("/v1/messages")
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    result = json.loads(r.stdout)
    assert result["is_error"] is False and result["terminal_reason"] == "completed", result
    assert result["usage"]["input_tokens"] > 10_000  # Claude Code's real system prompt
    # Every request it made was answered: no 4xx/5xx (no retries after refusals).
    assert answered and all(status == "200" for _, status in answered), answered
