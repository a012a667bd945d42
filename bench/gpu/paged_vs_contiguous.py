"""Decode throughput in-process: pippin's paged engine against mlx-lm's BatchGenerator.

Answers whether gathering paged KV into dense tensors each step costs too much
against mlx-lm's contiguous batch cache. Random-weight Qwen3-shaped model.

    python bench/gpu/paged_vs_contiguous.py --batch 1 8 32 --prompt 128 --gen 64
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.generate import BatchGenerator
from mlx_lm.models import qwen3
from mlx_lm.sample_utils import make_sampler

from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.engine.types import SamplingParams
from pippin.store.loaded import LoadedModel


class _Detok:
    def __init__(self) -> None:
        self.text = ""

    def add_token(self, t: int) -> None:
        pass

    def finalize(self) -> None:
        pass


class _Tok:
    all_special_ids: list[int] = []

    @property
    def detokenizer(self) -> _Detok:
        return _Detok()


def build(hidden: int, layers: int, vocab: int, dtype: mx.Dtype) -> qwen3.Model:
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=hidden * 3,
        num_attention_heads=hidden // 64 or 1,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        num_key_value_heads=max(hidden // 128, 1),
        max_position_embeddings=4096,
        rope_theta=1e6,
        head_dim=64,
        tie_word_embeddings=True,
    )
    model = qwen3.Model(args)
    model.update(
        tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(dtype), model.parameters())
    )
    mx.eval(model.parameters())
    return model


def _tree_copy(x: Any) -> Any:
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
_ENGINE_MODELS: dict[int, tuple[nn.Module, nn.Module]] = {}


def engine_model(model: nn.Module) -> nn.Module:
    """`model` as pippin's engine may change it: the engine swaps modules in place (fused
    projections, the LM head's norm), and mlx-lm measured on `model` in the same process
    must run its own layers. A copy of the module tree, sharing the weights; one per model."""
    got = _ENGINE_MODELS.get(id(model))
    if got is None:
        got = _ENGINE_MODELS[id(model)] = (model, _tree_copy(model))
    return got[1]


def make_core(model, prompts: list[list[int]], gen: int) -> EngineCore:
    """An engine whose pool holds every sequence whole, so the batch never shrinks by
    preemption."""
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


def run_pippin(model, prompts: list[list[int]], gen: int, with_prefill: bool = False) -> float:
    """Output tokens/s of decoding `prompts` together: timed from the first decode step,
    or (`with_prefill`) from the moment they are all added."""
    core = make_core(model, prompts, gen)
    for i, p in enumerate(prompts):
        core.add_request(
            str(i), p, SamplingParams(max_tokens=gen, temperature=1.0, ignore_eos=True)
        )
    while not with_prefill and (
        any(s.is_prefilling for s in core.scheduler.running) or core.scheduler.waiting
    ):
        core.step()
    t0 = time.perf_counter()
    n = 0
    while core.has_work():
        for o in core.step():
            n += sum(len(c.token_ids) for c in o.outputs)
    return n / (time.perf_counter() - t0)


def run_mlx_lm(model, prompts: list[list[int]], gen: int) -> float:
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
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    model = build(a.hidden, a.layers, a.vocab, getattr(mx, a.dtype))
    random.seed(0)
    print(
        f"device={mx.default_device()} hidden={a.hidden} layers={a.layers} "
        f"prompt={a.prompt} gen={a.gen}"
    )
    print("batch | mlx-lm BatchGenerator tok/s | pippin engine tok/s | ratio")
    for b in a.batch:
        prompts = [[random.randrange(a.vocab) for _ in range(a.prompt)] for _ in range(b)]
        run_pippin(model, prompts[:1], 4)  # warm-up
        ref = run_mlx_lm(model, prompts, a.gen)
        ours = run_pippin(model, prompts, a.gen)
        print(f"{b} | {ref:.0f} | {ours:.0f} | {ours / ref:.2f}")


if __name__ == "__main__":
    main()
