"""Speculative decoding on an editing workload: single-stream decode tokens/s without it,
with prompt lookup (ngram) and, with `--draft`, with a draft model, through `EngineCore`,
on the default model (SmolLM2) or `--model`.

`--draft MODEL` loads a draft as `pippin serve` takes it (`--draft target`: the target's
own weights again, the upper bound of acceptance); `--draft-layers N` keeps only its first
N layers (a layer-skip draft of the target: the only draft sharing SmolLM2's vocabulary
this machine has).

The prompt asks the model to rewrite a piece of Python with one name changed, so most of
the answer repeats the prompt. Both engines get the prompt once first (the prefix cache
then serves it, so prefill is not timed); decode is timed from the first token to the
last, greedy, and the two outputs must be identical. Run by hand, never as a test:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python bench/spec_bench.py --gen 256 --repeat 3 --draft target
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import textwrap

from pippin.bench.inproc import drive
from pippin.bench.workload import editing_message
from pippin.engine.config import EngineConfig, SpeculativeConfig
from pippin.engine.core import EngineCore
from pippin.engine.draft_model import DraftModel
from pippin.engine.speculative import Speculator
from pippin.engine.types import SamplingParams
from pippin.store import loader


def editing_prompt(tokenizer, target_tokens: int) -> list[int]:
    """A chat prompt asking for code rewritten with a name changed, its code cut to about
    `target_tokens` tokens in all: `pippin bench --workload editing`'s request, always on
    the same code (`textwrap.TextWrapper`, as the numbers in docs/benchmarks.md were)."""
    source = inspect.getsource(textwrap)
    lines = source.splitlines()
    code: list[str] = []
    for line in lines[lines.index("class TextWrapper:") :]:
        code.append(line)
        if len(tokenizer.encode("\n".join(code))) >= target_tokens - 80:
            break
    body = "\n".join(code)
    msg = editing_message(body, "TextWrapper", "LineWrapper", "class")
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=True
    )


def decode(core: EngineCore, rid: str, prompt: list[int], gen: int) -> tuple[list[int], float]:
    """The tokens and the seconds from the first token to the last."""
    run = drive(core, [(rid, prompt, SamplingParams(max_tokens=gen, temperature=0.0))])
    return run.tokens[rid], run.decode_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", help="a model as `pippin serve` takes it (default: SmolLM2)")
    ap.add_argument("--prompt", type=int, default=1500, help="prompt tokens, about")
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup-max", type=int, default=4)
    ap.add_argument("--lookup-min", type=int, default=2)
    ap.add_argument("--draft", help="a draft model, or `target` for the target's weights")
    ap.add_argument("--draft-layers", type=int, help="keep the draft's first N layers only")
    ap.add_argument("--draft-k", type=int, help="num_speculative_tokens of the draft (--k)")
    ap.add_argument("--skip-ngram", action="store_true")
    args = ap.parse_args()
    loaded = loader.load_model(args.model)
    prompt = editing_prompt(loaded.tokenizer, args.prompt)
    spec = SpeculativeConfig(
        num_speculative_tokens=args.k,
        prompt_lookup_max=args.lookup_max,
        prompt_lookup_min=args.lookup_min,
    )
    base = dict(num_blocks=1024, max_num_batched_tokens=2048, max_model_len=8192)
    cores = {"off": EngineCore(loaded, EngineConfig(**base))}
    if not args.skip_ngram:
        cores["ngram"] = EngineCore(loaded, EngineConfig(**base, speculative=spec))
    if args.draft:
        cores["draft"] = draft_core(loaded, base, args)
    for name, core in cores.items():  # the prompt into the prefix caches (the draft's too)
        decode(core, f"warm-{name}", prompt, 8)
    steps0 = {name: core.steps for name, core in cores.items()}
    times: dict[str, list[float]] = {n: [] for n in cores}
    outputs: dict[str, list[int]] = {}
    for r in range(args.repeat):
        for name, core in cores.items():
            ids, secs = decode(core, f"{name}-{r}", prompt, args.gen)
            outputs.setdefault(name, ids)
            assert ids == outputs[name], "greedy output changed between runs"
            times[name].append(secs)
    n = len(outputs["off"])
    print(f"prompt {len(prompt)} tokens, {n} generated")
    for name in cores:
        if name == "off":
            continue
        s = cores[name].stats()
        print(
            f"{name}: identical to off: {outputs[name] == outputs['off']}; proposals "
            f"{s['spec_decode_num_drafts']}, proposed tokens "
            f"{s['spec_decode_num_draft_tokens']}, kept {s['spec_decode_num_accepted_tokens']}"
        )
    for name, ts in times.items():
        med = statistics.median(ts)
        steps = (cores[name].steps - steps0[name]) / args.repeat
        print(
            f"{name:6s} decode {(n - 1) / med:7.1f} tok/s (median of {len(ts)}: {med:.2f} s), "
            f"{steps:.0f} steps, {med / steps * 1000:.0f} ms a step"
        )
    for name in cores:
        if name != "off":
            ratio = statistics.median(times["off"]) / statistics.median(times[name])
            print(f"{name} speed-up {ratio:.2f}x")
    print("output:", loaded.tokenizer.decode(outputs["off"])[:400].replace("\n", "\\n"))


def draft_core(loaded, base: dict, args: argparse.Namespace) -> EngineCore:
    """An engine speculating with `--draft` (its first `--draft-layers` layers)."""
    source = loaded.source if args.draft == "target" else args.draft
    spec = SpeculativeConfig(
        method="draft_model", model=source, num_speculative_tokens=args.draft_k or args.k
    )
    core = EngineCore(loaded, EngineConfig(**base))
    draft = loader.materialize(loader.load_model(source))
    if args.draft_layers:
        inner = draft.model.model
        inner.layers = inner.layers[: args.draft_layers]
    dm = DraftModel(
        spec,
        loaded,
        block_size=core.config.block_size,
        budget=core.config.max_num_batched_tokens,
        draft=draft,
    )
    dm.allocate(core.num_blocks)
    core.spec = Speculator(spec, dm)
    return core


if __name__ == "__main__":
    main()
