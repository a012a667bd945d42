"""Compare grammar engines for constrained decoding: llguidance against xgrammar.

For a few JSON schemas, measures on one tokenizer: the time to compile the schema for
the vocabulary (what a request waits for before its first token) and the time to compute
one token mask (what every constrained decoding step costs), walking the tokens of a
valid instance of the schema. Run it on the machine you care about:

    PYTHONPATH=src python bench/grammar_engines.py --tokenizer PATH_TO_HF_TOKENIZER_DIR

xgrammar is optional here (it is not a pippin dependency: it pulls in torch and triton);
install it into a separate folder and put that on PYTHONPATH to include it:
`pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                "owner": {
                    "type": "object",
                    "properties": {
                        "email": {"type": "string"},
                        "role": {"enum": ["admin", "user", "guest"]},
                    },
                    "required": ["email", "role"],
                    "additionalProperties": False,
                },
                "score": {"anyOf": [{"type": "number"}, {"type": "null"}]},
            },
            "required": ["id", "tags", "owner", "score"],
            "additionalProperties": False,
        },
        {
            "id": "ABC-1234",
            "tags": ["alpha", "beta"],
            "owner": {"email": "a@b.c", "role": "admin"},
            "score": 0.5,
        },
    ),
    "wide": (
        {
            "type": "object",
            "properties": {
                f"field_{i}": {"type": ["string", "integer", "boolean"]} for i in range(40)
            },
            "required": [f"field_{i}" for i in range(40)],
            "additionalProperties": False,
        },
        {f"field_{i}": (i if i % 3 == 0 else (f"v{i}" if i % 3 == 1 else True)) for i in range(40)},
    ),
    "any_object": ({"type": "object"}, {"a": [1, 2, {"b": "c"}], "d": None}),
}


def _dump(x: Any) -> str:
    return json.dumps(x, separators=(", ", ": "))


def bench_llguidance(tok: Any, vocab: int) -> dict[str, tuple[float, float, float, float]]:
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    print(f"llguidance {llguidance.__version__}: tokenizer {time.perf_counter() - t0:.2f} s")
    opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    out = {}
    for name, (schema, inst) in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=opts)
        m = llguidance.LLMatcher(lltok, grammar)
        compile_s = time.perf_counter() - t0
        assert not m.is_error(), m.get_error()
        ids = tok.encode(_dump(inst), add_special_tokens=False)
        mask = allocate_token_bitmask(1, vocab)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            fill_next_token_bitmask(m, mask)
            times.append(time.perf_counter() - t0)
            assert m.consume_token(t), (name, m.get_error())
        out[name] = (compile_s, times[0], statistics.mean(times[1:]), max(times[1:]))
    return out


def bench_xgrammar(tok: Any, vocab: int) -> dict[str, tuple[float, float, float, float]]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    print(f"xgrammar: tokenizer {time.perf_counter() - t0:.2f} s")
    out = {}
    for name, (schema, inst) in SCHEMAS.items():
        # A fresh compiler per schema: no cache hits between them.
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(
            json.dumps(schema), any_whitespace=False, separators=(", ", ": ")
        )
        m = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t0
        ids = tok.encode(_dump(inst), add_special_tokens=False)
        mask = xgr.allocate_token_bitmask(1, vocab)
        times = []
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            times.append(time.perf_counter() - t0)
            assert m.accept_token(t), name
        out[name] = (compile_s, times[0], statistics.mean(times[1:]), max(times[1:]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder")
    ap.add_argument("--vocab", type=int, default=None, help="logits width (default: len(tok))")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab = args.vocab or len(tok)
    print(f"tokenizer {args.tokenizer}: {vocab} ids")
    results = {"llguidance": bench_llguidance(tok, vocab)}
    try:
        results["xgrammar"] = bench_xgrammar(tok, vocab)
    except ImportError:
        print("xgrammar not installed: skipped")
    print("| schema | engine | compile ms | first mask ms | mask us (mean) | mask us (max) |")
    print("|---|---|---|---|---|---|")
    for name in SCHEMAS:
        for engine, res in results.items():
            c, first, mean, worst = res[name]
            print(
                f"| {name} | {engine} | {c * 1e3:.1f} | {first * 1e3:.1f} | {mean * 1e6:.0f} "
                f"| {worst * 1e6:.0f} |"
            )


if __name__ == "__main__":
    main()
