"""Ollama's `think` on a model with a thinking switch: a tiny random Qwen3 whose template
has Qwen3's `enable_thinking` (a random model never closes its reasoning by itself, so
with thinking on everything it writes is thinking)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.server_utils import Server, run_server
from support.tiny_models import CHAT_TEMPLATE

ollama = pytest.importorskip("ollama")

THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>assistant\\n' -}}",
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking -%}{{- '<think>\\n' -}}"
    "{%- else -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}",
)
HELLO = [{"role": "user", "content": "Hello, how are you today?"}]
OPTS = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def server(
    tiny_models: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    dest = tmp_path_factory.mktemp("tiny-thinking") / "model"
    shutil.copytree(tiny_models("qwen3"), dest)
    cfg_path = dest / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    with run_server(str(dest), "--served-model-name", "tiny", "--max-model-len", "512") as s:
        yield s


def test_think_on_and_off(server: Server) -> None:
    client = ollama.Client(host=server.url, timeout=120)
    assert "thinking" in client.show("tiny").capabilities
    on = client.chat(model="tiny", messages=HELLO, think=True, options=OPTS)
    assert on.message.thinking and not on.message.content
    parts = list(client.chat(model="tiny", messages=HELLO, think=True, options=OPTS, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == on.message.thinking
    off = client.chat(model="tiny", messages=HELLO, think=False, options=OPTS)
    assert off.message.content and not off.message.thinking
    gen = client.generate(model="tiny", prompt="Hello", think=True, options=OPTS)
    assert gen.thinking and not gen.response
