"""The Codex CLI (`codex exec`) against pippin's Responses API, with a tiny model.

Codex sends what a real session does (a developer prompt of thousands of tokens, a dozen
function tools and a tool namespace, `store: false`, encrypted-reasoning `include`,
client metadata, streaming); a protocol mismatch makes it fail or retry.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from support.npm_tools import CODEX, npm_bin
from support.server_utils import run_server

CONFIG = """web_search = "disabled"
model = "tiny"
model_provider = "pippin"

[model_providers.pippin]
name = "pippin"
base_url = "{url}/v1"
env_key = "PIPPIN_KEY"
wire_api = "responses"
"""


def test_codex_exec(tiny_models: Callable[..., Path], tmp_path: Path) -> None:
    codex = npm_bin(CODEX, "codex", "the Codex CLI")
    model = tiny_models("qwen3")
    home = tmp_path / "codex-home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    args = ("--served-model-name", "tiny", "--max-model-len", "65536")
    with run_server(str(model), *args, api_key="sk-codex") as server:
        (home / "config.toml").write_text(CONFIG.format(url=server.url))
        env = {
            **os.environ,
            "CODEX_HOME": str(home),
            "HOME": str(tmp_path),
            "PIPPIN_KEY": "sk-codex",
        }
        r = subprocess.run(
            [str(codex), "exec", "--skip-git-repo-check", "Say hello"],
            cwd=work,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=900,
        )
        answered = server.answered("/v1/responses")
    assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "tokens used" in r.stdout + r.stderr
    # Every request it made was answered: no 4xx/5xx, so no retries.
    assert answered and all(status == "200" for _, status in answered), answered
