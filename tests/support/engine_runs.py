"""Engine runs the engine, runner and kernel tests share: tiny models loaded as the
engine takes them, greedy references from mlx-lm, and a core run to the end."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.engine.inproc_client import InprocClient
from pippin.engine.types import SamplingParams
from pippin.runner.model_runner import ModelRunner, UnsupportedModelError
from pippin.store.loaded import LoadedModel

GEN = 24
# A greedy mismatch is accepted only where the reference's top two logprobs
# are this close, i.e. where float rounding decides.
TIE = 2e-3


def loaded_model(path: Path) -> LoadedModel:
    model, tokenizer = load(str(path))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config={},
        source=str(path),
        name=path.name,
        eos_token_ids=set(tokenizer.eos_token_ids),
    )


def mlx_lm_reference(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and, at each step, the gap between the top two logprobs."""
    tokens, gaps = [], []
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, -1))
    for tok, lp in steps:
        top2 = mx.sort(lp)[-2:].tolist()
        tokens.append(int(tok))
        gaps.append(top2[1] - top2[0])
    return tokens, gaps


def agrees(got: list[int], ref: list[int], gaps: list[float]) -> bool:
    for i, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            return gaps[i] < TIE  # diverged where rounding decides: later tokens may differ
    return len(got) == len(ref)


def run_to_end(core: EngineCore, recover: bool = False) -> dict[str, dict]:
    """Every request's outputs; `recover`: a step that raises is recovered from, as the
    engine's thread does."""
    results: dict[str, dict] = {}
    while core.has_work():
        try:
            outs = core.step()
        except Exception as e:
            if not recover:
                raise
            outs = core.recover(e)
        for out in outs:
            r = results.setdefault(out.request_id, {"ids": {}, "text": {}, "finish": {}})
            r["cached"] = out.cached_tokens
            for c in out.outputs:
                r["ids"].setdefault(c.index, []).extend(c.token_ids)
                r["text"][c.index] = r["text"].get(c.index, "") + c.text
                r["finish"][c.index] = (c.finish_reason, c.stop_reason)
    return results


def random_prompts(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Avoid the special ids 0-2 so no prompt contains an end-of-turn token.
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(3, 60))] for _ in range(count)]


def beside_speculation(max_tokens: int = 30) -> list[SamplingParams]:
    """Requests that run beside speculating ones: a seeded one (never speculates), one with
    penalties, bias, min_tokens and logprobs (applied per verified position), and one with
    stop tokens."""
    return [
        SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=3),
        SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            repetition_penalty=1.3,
            logit_bias={50: 3.0},
            min_tokens=20,
            logprobs=True,
            top_logprobs=2,
        ),
        SamplingParams(max_tokens=max_tokens + 15, temperature=0.0, stop_token_ids=[77, 78, 79]),
    ]


def engine_config(**kw) -> EngineConfig:
    base = dict(num_blocks=400, block_size=4, max_model_len=512, max_num_batched_tokens=48)
    base.update(kw)
    return EngineConfig(**base)


OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"


def faulty_forward(
    monkeypatch: pytest.MonkeyPatch, fail: Callable[[int, list[str]], str | None]
) -> None:
    """Make `ModelRunner.forward` raise `fail(call, request ids)`'s message where it gives
    one, after building its graph and with the KV pools overwritten: as a step that failed
    half way leaves them."""
    real = ModelRunner.forward
    calls = {"n": 0}

    def forward(self: ModelRunner, items: list) -> mx.array | None:
        out = real(self, items)
        calls["n"] += 1
        message = fail(calls["n"], [it.seq.request_id for it in items])
        if message is not None:
            for pool in self.pools.values():
                pool.parts = [mx.full(p.shape, 3.0, p.dtype) for p in pool.parts]
            raise RuntimeError(message)
        return out

    monkeypatch.setattr(ModelRunner, "forward", forward)


def serve_inproc(loaded: LoadedModel, prompts: list[list[int]], later: list[list[int]]) -> tuple:
    """`prompts` at once, then `later` one after another, through an InprocClient: per
    request (tokens, finish reason, error), and the engine's stats and core."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    async def collect(engine: InprocClient, prompt: list[int], rid: str) -> tuple:
        tokens: list[int] = []
        reason, error = None, None
        async for out in engine.generate(prompt, params, rid):
            for o in out.outputs:
                tokens += o.token_ids
                reason = o.finish_reason or reason
            error = out.error or error
        return tokens, reason, error

    async def main() -> tuple:
        engine = InprocClient(loaded, engine_config())
        await engine.start()
        first = await asyncio.gather(*(collect(engine, p, f"r{i}") for i, p in enumerate(prompts)))
        after = [await collect(engine, p, f"l{i}") for i, p in enumerate(later)]
        stats, core = engine.stats(), engine.engine.core
        await engine.stop()
        return first, after, stats, core

    return asyncio.run(main())


def greedy_logprobs(
    loaded: LoadedModel,
    prompts: list[list[int]],
    gens: list[int] | None = None,
    num_blocks: int = 300,
    top: int = 0,
    **config: object,
) -> dict[str, list]:
    """Greedy (token, logprob) pairs per request; `gens`: max_tokens each (default 12).
    With `top`, (token, logprob, that many alternatives as (token, logprob)) triples."""
    core = EngineCore(
        loaded,
        EngineConfig(num_blocks=num_blocks, block_size=4, max_model_len=512, **config),  # type: ignore[arg-type]
    )
    for i, p in enumerate(prompts):
        n = gens[i] if gens else 12
        params = SamplingParams(
            max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=top
        )
        core.add_request(str(i), p, params)
    out: dict[str, list] = {}
    while core.has_work():
        for o in core.step():
            for c in o.outputs:
                out.setdefault(o.request_id, []).extend(
                    (lp.token_id, lp.logprob, lp.top) if top else (lp.token_id, lp.logprob)
                    for lp in c.logprobs or []
                )
    return out


def greedy_or_skip(loaded: LoadedModel, *args: Any, **config: Any) -> dict:
    """`greedy_logprobs`, skipping the test where the engine refuses the configuration:
    MLX's CUDA quantised matmul lacks the tiny float32 models' shapes for quantised KV."""
    try:
        return greedy_logprobs(loaded, *args, **config)
    except UnsupportedModelError as e:
        pytest.skip(str(e))


def core_or_skip(loaded: LoadedModel, config: EngineConfig) -> EngineCore:
    """An engine, skipping the test where it refuses the configuration: MLX's CUDA
    quantised matmul lacks the tiny float32 models' shapes for quantised KV."""
    try:
        return EngineCore(loaded, config)
    except UnsupportedModelError as e:
        pytest.skip(str(e))
