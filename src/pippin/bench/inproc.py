"""Driving pippin's engine in-process, for the bench scripts, and mlx-lm beside it.

`drive` is the one loop every in-process measurement runs: requests added to an
`EngineCore`, steps until it is idle, each request's tokens (and logprobs) kept, and the
clock read around the part measured (with `untimed_prefill`, decode only: the prompts'
steps run first, outside it). `bare_core` and `decode_rate` run a bare mlx-lm model (no
tokenizer) in the engine; `mlx_lm_decode` and `mlx_lm_batch_rate` are mlx-lm's own decode
of the same prompts, from its first decode step as pippin's; `in_turns` runs engines in
turns, so that a drift of the machine's speed touches them all.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.engine.types import SamplingParams
from pippin.store.loaded import LoadedModel

Request = tuple[str, list[int], SamplingParams]


@dataclass
class Drive:
    """What one `drive` saw: per request, its tokens and their logprobs; over the part
    measured, its steps, tokens and times (perf_counter)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    steps: int = 0
    timed_tokens: int = 0
    start: float = 0.0
    first: float | None = None  # the first token of the part measured
    end: float = 0.0

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def tok_s(self) -> float:
        return self.timed_tokens / self.seconds

    @property
    def first_token_s(self) -> float:
        """From the start to the first token (all of it if none came)."""
        return (self.end if self.first is None else self.first) - self.start

    @property
    def decode_s(self) -> float:
        """From the first token to the last."""
        assert self.first is not None, "no token was generated"
        return self.end - self.first


def drive(
    core: EngineCore,
    requests: Iterable[Request],
    untimed_prefill: bool = False,
    keep: bool = True,
) -> Drive:
    """Add `requests` to `core` and step it until it is idle. Without `keep`, only counts
    (a rate measured at hundreds of rows pays nothing to keep the tokens)."""
    out = Drive()
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
        out.tokens[rid], out.logprobs[rid] = [], []
    if untimed_prefill:
        while any(s.is_prefilling for s in core.scheduler.running) or core.scheduler.waiting:
            _collect(out, core.step(), timed=False, keep=keep)
    out.start = time.perf_counter()
    while core.has_work():
        _collect(out, core.step(), timed=True, keep=keep)
        out.steps += 1
    out.end = time.perf_counter()
    return out


def _collect(out: Drive, outputs: list[Any], timed: bool, keep: bool) -> None:
    for o in outputs:
        for c in o.outputs:
            if keep:
                out.tokens[o.request_id] += c.token_ids
                out.logprobs[o.request_id] += [lp.logprob for lp in c.logprobs or []]
            if timed:
                out.timed_tokens += len(c.token_ids)
                if out.first is None and c.token_ids:
                    out.first = time.perf_counter()


# -- a bare mlx-lm model in the engine -------------------------------------------------


class _Detok:
    text = ""

    def add_token(self, t: int) -> None:
        pass

    def finalize(self) -> None:
        pass


class _Tok:
    """No tokenizer: ids in, ids out (nothing is detokenised)."""

    all_special_ids: list[int] = []

    @property
    def detokenizer(self) -> _Detok:
        return _Detok()


def _tree_copy(x: Any) -> Any:
    import mlx.nn as nn

    if isinstance(x, nn.Module):
        out = copy.copy(x)  # its attributes; the children are replaced just below
        for k, v in x.items():
            out[k] = _tree_copy(v)
        return out
    if isinstance(x, list):
        return [_tree_copy(v) for v in x]
    if isinstance(x, dict):
        return {k: _tree_copy(v) for k, v in x.items()}
    return x  # arrays are shared


# id(model) -> (model, its copy); holding the model keeps its id from being reused.
_ENGINE_MODELS: dict[int, tuple[Any, Any]] = {}


def engine_model(model: Any) -> Any:
    """`model` as pippin's engine may change it: the engine swaps modules in place (fused
    projections, the LM head's norm), and mlx-lm measured on `model` in the same process
    must run its own layers. A copy of the module tree, sharing the weights; one per model."""
    got = _ENGINE_MODELS.get(id(model))
    if got is None:
        got = _ENGINE_MODELS[id(model)] = (model, _tree_copy(model))
    return got[1]


def bare_core(model: Any, prompts: list[list[int]], gen: int) -> EngineCore:
    """An engine on an mlx-lm model whose pool holds every sequence whole, so the batch
    never shrinks by preemption."""
    loaded = LoadedModel(model=engine_model(model), tokenizer=_Tok(), config={}, source="", name="")
    blocks = sum((len(p) + gen) // 16 + 2 for p in prompts) + 64
    return EngineCore(
        loaded,
        EngineConfig(
            num_blocks=max(blocks, 4096),
            max_model_len=max(4096, max(len(p) for p in prompts) + gen + 16),
            max_num_batched_tokens=8192,
            max_num_seqs=max(256, len(prompts)),
        ),
    )


def sampled(prompts: list[list[int]], gen: int, prefix: str = "") -> list[Request]:
    """`prompts` as requests for `gen` sampled tokens each, run to length."""
    params = SamplingParams(max_tokens=gen, temperature=1.0, ignore_eos=True)
    return [(f"{prefix}{i}", p, params) for i, p in enumerate(prompts)]


def decode_rate(
    model: Any, prompts: list[list[int]], gen: int, with_prefill: bool = False
) -> float:
    """Output tokens/s of pippin's engine decoding `prompts` together: timed from the first
    decode step, or (`with_prefill`) from the moment they are all added.

    The same engine first decodes prompts of the same lengths (reversed, so that none is a
    cached prefix) untimed: its compiled decode step traces each new shape once, as a
    served engine does before its first requests, and the timed part then takes only shapes
    already traced (mlx-lm's uncompiled step has none to trace)."""
    core = bare_core(model, prompts, gen)
    warm = [p[::-1] for p in prompts]
    drive(core, sampled(warm, gen, prefix="warm-"), untimed_prefill=True, keep=False)
    return drive(core, sampled(prompts, gen), untimed_prefill=not with_prefill, keep=False).tok_s


# -- mlx-lm's own decode ---------------------------------------------------------------


def mlx_lm_decode(model: Any, prompt: list[int], gen: int) -> float:
    """Decode tokens/s of mlx-lm's `generate_step` on `prompt`, from its first decode step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    steps = generate_step(mx.array(prompt), model, max_tokens=gen)
    next(steps)
    t0 = time.perf_counter()
    n = sum(1 for _ in steps)
    return n / (time.perf_counter() - t0)


def mlx_lm_batch_rate(model: Any, prompts: list[list[int]], gen: int) -> float:
    """Output tokens/s of mlx-lm's `BatchGenerator` decoding `prompts`, from its first
    decode tokens (prefill done)."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_sampler

    gen_ = BatchGenerator(
        model,
        max_tokens=gen,
        completion_batch_size=len(prompts),
        prefill_batch_size=len(prompts),
        sampler=make_sampler(temp=1.0),
    )
    gen_.insert(prompts, [gen] * len(prompts))
    n = 0
    t0 = None
    while True:
        r = gen_.next_generated() if hasattr(gen_, "next_generated") else gen_.next()
        if not r:
            break
        if t0 is None:  # first decode tokens: prefill done
            t0 = time.perf_counter()
            continue
        n += len(r)
    assert t0 is not None
    return n / (time.perf_counter() - t0)


def in_turns(
    runs: dict[str, Callable[[int], float]], gen: int, repeat: int, label: str = ""
) -> dict[str, float]:
    """Each run's median tokens/s over `repeat` runs of `gen` tokens, the runs taking turns
    (after one short warm-up each: kernels, traces); every result printed as it comes."""
    for fn in runs.values():
        fn(16)
    got: dict[str, list[float]] = {e: [] for e in runs}
    for _ in range(repeat):
        for e, fn in runs.items():
            got[e].append(fn(gen))
            print(
                f"{label}{e:12s} {got[e][-1]:7.1f} tok/s ({1e3 / got[e][-1]:.2f} ms/token)",
                flush=True,
            )
    mids = {e: sorted(ts)[len(ts) // 2] for e, ts in got.items()}
    for e, mid in mids.items():
        print(f"{label}{e:12s} median {mid:7.1f} tok/s over {repeat} runs", flush=True)
    return mids
