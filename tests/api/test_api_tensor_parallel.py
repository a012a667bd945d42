"""`pippin serve --tensor-parallel 2` on the CPU: two ranks over MLX's ring backend on
localhost, driven over HTTP with the openai SDK.

Two ranks must give the greedy tokens one device gives (mlx-lm's own generation, which
the engine tests hold one pippin rank to), alone and batched; a rank killed in the middle
of a request must end it with an error and turn /health to 503, never hang; and the
group must come back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from mlx_lm.utils import load
from support.engine_runs import TIE, mlx_lm_reference
from support.server_utils import Server, run_server

GEN = 16
PROMPTS = [
    [5, 17, 42, 99, 7],
    [300, 12, 64],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [250, 251, 252, 253],
]


def _references(path: Path) -> list[list[int]]:
    model, _ = load(str(path))
    out = []
    for prompt in PROMPTS:
        tokens, gaps = mlx_lm_reference(model, prompt, GEN)
        # Where the top two logprobs are within float rounding, any order of sums may
        # pick either: such a prompt would test nothing.
        assert min(gaps) > TIE, f"prompt {prompt} has a near tie; choose another"
        out.append(tokens)
    return out


def _text(path: Path, tokens: list[int]) -> str:
    _, tokenizer = load(str(path))
    return tokenizer.decode(tokens)


# The compiled decode step (the default on CUDA) runs its all-sums inside the compiled
# graph: the same tokens too.
@pytest.fixture(scope="module", params=["llama", "qwen3", "llama-compiled"])
def tp_server(
    request: pytest.FixtureRequest, tiny_models: Callable[..., Path]
) -> Iterator[tuple[Server, Path]]:
    arch, _, compiled = request.param.partition("-")
    model = tiny_models(arch)
    args = ("--tensor-parallel", "2", "--num-kv-blocks", "128", "--max-model-len", "512")
    with pytest.MonkeyPatch.context() as mp:
        if compiled:
            mp.setenv("PIPPIN_COMPILE", "1")  # read by the server's processes at start
        with run_server(str(model), *args) as server:
            yield server, model


def _complete(client: openai.OpenAI, prompt: list[int]) -> str:
    r = client.completions.create(
        model="default",
        prompt=prompt,
        max_tokens=GEN,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return r.choices[0].text


def test_two_ranks_match_one_device_alone(tp_server: tuple[Server, Path]) -> None:
    server, model = tp_server
    refs = _references(model)
    client = server.client()
    for prompt, ref in zip(PROMPTS, refs):
        assert _complete(client, prompt) == _text(model, ref)
    # The same prompt again is served from rank 0's prefix cache: still the same tokens.
    assert _complete(client, PROMPTS[2]) == _text(model, refs[2])


def test_two_ranks_match_one_device_batched(tp_server: tuple[Server, Path]) -> None:
    server, model = tp_server
    refs = _references(model)
    client = server.async_client()

    async def run() -> list[str]:
        async def one(prompt: list[int]) -> str:
            r = await client.completions.create(
                model="default",
                prompt=prompt,
                max_tokens=GEN,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return r.choices[0].text

        return await asyncio.gather(*(one(p) for p in PROMPTS * 2))

    texts = asyncio.run(run())
    assert texts == [_text(model, r) for r in refs * 2]


def _environ(server: Server) -> str:
    with open(f"/proc/{server.proc.pid}/environ", "rb") as f:
        return f.read().replace(b"\0", b"\n").decode(errors="replace")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return out


def _worker_pid(server: Server) -> int:
    """Rank 1: a grandchild of the server (its engine process is rank 0)."""
    for child in _children(server.proc.pid):
        for grandchild in _children(child):
            with open(f"/proc/{grandchild}/cmdline", "rb") as f:
                if b"pippin.engine.tp.worker" in f.read():
                    return grandchild
    raise AssertionError("no rank 1 process found")


def test_a_killed_rank_ends_requests_with_an_error_not_a_hang(
    tp_server: tuple[Server, Path],
) -> None:
    server, model = tp_server
    if "qwen3" in model.name or "PIPPIN_COMPILE=1" in _environ(server):
        pytest.skip("the lost-rank path does not depend on the model: run once")
    client = server.client(max_retries=0, timeout=60)
    stream = client.completions.create(
        model="default",
        prompt=[5, 6, 7],
        max_tokens=480,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    next(chunks)  # generating
    os.kill(_worker_pid(server), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="tensor parallel: rank 1 is gone"):
        for _ in chunks:
            pass
    assert time.monotonic() - t0 < 30
    assert httpx.get(f"{server.url}/health", timeout=5).status_code == 503
    with pytest.raises(openai.APIStatusError) as e:
        _complete(client, [1, 2, 3])
    assert e.value.status_code == 503
    # The group is started again with every rank, and serves.
    deadline = time.monotonic() + 180
    while httpx.get(f"{server.url}/health", timeout=5).status_code != 200:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.5)
    assert _complete(server.client(), PROMPTS[0])
