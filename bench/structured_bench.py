"""Per-token cost of constrained decoding, in-process, against unconstrained decoding.

Runs the engine on one model with the same batch three ways: every row free, every row
under a JSON grammar, and half and half (the free rows then should not slow down).
Generation length is fixed (`ignore_eos`, a grammar that never has to end: JSON objects
one per line), so tokens/s compare like for like. Decode only: prefill is done first.

    PYTHONPATH=src python bench/structured_bench.py --batch 1 32 --gen 64

`--model` takes anything `pippin serve` takes (default: SmolLM2-135M-Instruct, the
default model), or `random:NAME` (`pippin.bench.models`: `random:tiny-llama3` is a 5.2M
random Llama with Llama 3's real tokenizer).
"""

from __future__ import annotations

import argparse

from pippin.bench.inproc import drive
from pippin.bench.models import resolve_model
from pippin.engine.config import EngineConfig
from pippin.engine.constraint import Constraint
from pippin.engine.core import EngineCore
from pippin.engine.types import SamplingParams
from pippin.store.loaded import LoadedModel
from pippin.store.loader import load_model
from pippin.structured.compiler import GrammarCompiler
from pippin.structured.spec import JSON_OPTIONS, GrammarSpec

ITEM = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "note": {"anyOf": [{"type": "string", "maxLength": 24}, {"type": "null"}]},
    },
    "required": ["name", "age", "tags", "note"],
    "additionalProperties": False,
    "x-guidance": JSON_OPTIONS,
}


def grammar() -> GrammarSpec:
    import json

    from llguidance import LLMatcher

    lark = f'start: (item "\\n")+\nitem: %json {json.dumps(ITEM)}'
    return GrammarSpec(LLMatcher.grammar_from_lark(lark), "bench", "JSON lines")


def decode_rate(
    loaded: LoadedModel, constraint: Constraint, batch: int, n_constrained: int, gen: int
) -> float:
    core = EngineCore(
        loaded, EngineConfig(num_blocks=4096, max_model_len=2048, max_num_batched_tokens=8192)
    )
    prompt = loaded.tokenizer.encode("Write JSON lines about people:")
    requests = []
    for i in range(batch):
        p = SamplingParams(
            max_tokens=gen,
            temperature=1.0,
            seed=i,
            ignore_eos=True,
            constraint=constraint if i < n_constrained else None,
        )
        requests.append((str(i), prompt + [i % 50 + 100], p))
    return drive(core, requests, untimed_prefill=True, keep=False).tok_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a model, or random:NAME")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(resolve_model(args.model) if args.model else None)
    vocab = int(loaded.config.get("vocab_size") or len(loaded.tokenizer._tokenizer))
    compiler = GrammarCompiler(loaded.tokenizer, vocab, loaded.eos_token_ids)
    matcher = compiler.build(grammar())
    constraint = Constraint(matcher, "JSON lines", compiler.n_vocab)
    print(f"model {loaded.name}, vocab {vocab}, gen {args.gen}, best of {args.repeat}")
    print("| batch | free tok/s | constrained tok/s | overhead | half/half tok/s | overhead |")
    print("|---|---|---|---|---|---|")
    for b in args.batch:
        rates: dict[str, list[float]] = {"free": [], "all": [], "half": []}
        for _ in range(args.repeat):  # interleaved, so drift on a shared machine evens out
            rates["free"].append(decode_rate(loaded, constraint, b, 0, args.gen))
            rates["all"].append(decode_rate(loaded, constraint, b, b, args.gen))
            rates["half"].append(decode_rate(loaded, constraint, b, b // 2, args.gen))
        best: dict[str, float] = {k: max(v) for k, v in rates.items()}
        free = best["free"]
        print(
            f"| {b} | {free:.0f} | {best['all']:.0f} | {free / best['all'] - 1:+.1%} "
            f"| {best['half']:.0f} | {free / best['half'] - 1:+.1%} |"
        )


if __name__ == "__main__":
    main()
