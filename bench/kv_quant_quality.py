"""Quantised KV against full-precision KV on a real model: greedy agreement, logprob
error and memory per token.

Runs the engine itself (paged pools, quantised attention) on chat prompts, greedy, with
logprobs. For each prompt and each ``--kv-bits`` setting it reports:

- agreement: generated tokens before the first one that differs from full-precision KV,
  as a share of all generated tokens; and the share of positions with the same token;
- logprob error: |logprob(full) - logprob(quantised)| of the chosen token, at the
  positions before the first difference (where both saw the same context);
- KV bytes per token and tokens per GiB of pool.

Run by hand:  .venv/bin/python bench/kv_quant_quality.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

from pippin.bench.inproc import drive
from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.engine.types import SamplingParams
from pippin.runner.paged_cache import bytes_per_block
from pippin.store.loader import load_model

PROMPTS = [
    "Explain how a hash table works, with an example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of inflation? Answer in a few paragraphs.",
    "List the planets of the solar system and one fact about each.",
    "How do I reverse a linked list? Show code and explain the steps.",
    "Describe the water cycle for a ten-year-old.",
    "Summarise the plot of Romeo and Juliet.",
    "What is the difference between TCP and UDP?",
]


def run(core: EngineCore, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    """All prompts as one batch; greedy tokens and their logprobs per prompt."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=True)
    run = drive(core, [(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return [(run.tokens[k], run.logprobs[k]) for k in run.tokens]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--group-size", type=int, default=64)
    args = p.parse_args()
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    prompts = [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
        for q in PROMPTS
    ]

    def core(bits: int | None) -> EngineCore:
        cfg = EngineConfig(num_blocks=512, kv_bits=bits, kv_group_size=args.group_size)
        return EngineCore(loaded, cfg)

    full_core = core(None)
    full = run(full_core, prompts, args.tokens)
    base = bytes_per_block(full_core.runner.kv_specs, full_core.bm.block_size)
    bs = full_core.bm.block_size
    print(
        f"model {loaded.name}, KV dtype {full_core.runner.kv_specs[0].dtype}, "
        f"{len(prompts)} prompts x {args.tokens} greedy tokens, group size {args.group_size}"
    )
    print(
        "| KV | bytes/token | tokens per GiB | × tokens | prefix agreement | same token | "
        "logprob err mean | logprob err max |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(
        f"| {full_core.runner.kv_specs[0].dtype} | {base // bs:,} | {2**30 * bs // base:,} | "
        "1.00 | 100% | 100% | 0 | 0 |"
    )
    for bits in (8, 4):
        qc = core(bits)
        quant = run(qc, prompts, args.tokens)
        per = bytes_per_block(qc.runner.kv_specs, bs)
        prefix = same = total = 0
        errs: list[float] = []
        for (fi, fl), (qi, ql) in zip(full, quant):
            k = next((j for j, (a, b) in enumerate(zip(fi, qi)) if a != b), len(fi))
            prefix += k
            same += sum(a == b for a, b in zip(fi, qi))
            total += len(fi)
            errs += [abs(a - b) for a, b in zip(fl[:k], ql[:k])]
        print(
            f"| {bits}-bit | {per // bs:,} | {2**30 * bs // per:,} | {base / per:.2f} | "
            f"{100 * prefix / total:.1f}% | {100 * same / total:.1f}% | "
            f"{statistics.mean(errs):.4f} | {max(errs):.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
