"""Claude Code itself (`claude -p`) against pippin's Anthropic API, with tiny models (real
weights doing a task with Claude Code: tests/e2e/test_agent_matrix.py).

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


@pytest.mark.parametrize("which", ["tiny-qwen3", "tiny-no-tools"])
def test_claude_code_print_mode(
    which: str, tiny_models: Callable[..., Path], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The tiny model's template has tools; the second tiny one's has none (they go into
    the system prompt in the generic format). Neither can think: Claude Code's `thinking`
    is answered without thinking. (Claude Code against real weights, Qwen2.5-Coder's GGUF,
    doing a task with a tool: tests/e2e/test_agent_matrix.py.)"""
    claude = npm_bin(CLAUDE_CODE, "claude", "Claude Code")
    model = tiny_models("qwen3")
    if which == "tiny-no-tools":  # Claude Code's tools in the generic tool format
        factory = request.getfixturevalue("tmp_path_factory")
        model = _without_tools(model, factory.mktemp("no-tools") / "model")
    # The tiny models get the whole agent prompt (26k tokens).
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
    try:
        result = json.loads(r.stdout)
    except ValueError:
        raise AssertionError((r.returncode, r.stdout[-2000:], r.stderr[-2000:])) from None
    assert result.get("api_error_status") is None, result
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert result["is_error"] is False and result["terminal_reason"] == "completed", result
    assert result["usage"]["input_tokens"] > 10_000  # Claude Code's real system prompt
    # Every request it made was answered: no 4xx/5xx (no retries after refusals; its
    # max_tokens past the context is served, as the hosted API serves it).
    assert answered and all(status == "200" for _, status in answered), answered
