"""LoRA adapters per row: greedy tokens through the engine equal mlx-lm's with the same
adapter (fused, or as LoRA layers on a quantised model), alone and in batches that mix
the base model and several adapters, chunked prefill, the compiled decode step and
speculative decoding; the prefix cache never shares blocks across adapters."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.nn as nn
import pytest
from mlx_lm.utils import load
from support.engine_runs import loaded_model, random_prompts, run_to_end
from support.lora_adapters import random_lora, reference, with_adapter, write_mlx, write_peft

from pippin.engine.config import EngineConfig, SpeculativeConfig
from pippin.engine.core import EngineCore
from pippin.engine.types import EngineError, SamplingParams
from pippin.kernels.config import KernelConfig
from pippin.store.loaded import LoadedModel

GEN = 16
TIE = 2e-3  # a greedy mismatch counts only where the reference's top two are this close


def agrees(got: list[int], ref: list[int], gaps: list[float]) -> bool:
    for g, r, gap in zip(got, ref, gaps):
        if g != r:
            return gap < TIE  # rounding decided; later tokens may differ
    return len(got) == len(ref)


def config(**kw: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        num_blocks=300, block_size=4, max_model_len=512, max_num_batched_tokens=64
    )
    base.update(kw)
    return EngineConfig(**base)


def quantised(loaded: LoadedModel) -> LoadedModel:
    nn.quantize(loaded.model, group_size=32, bits=4)
    return loaded


def greedy(core: EngineCore, prompts: list[list[int]], loras: list[str | None]) -> dict:
    for i, (p, name) in enumerate(zip(prompts, loras)):
        params = SamplingParams(
            max_tokens=GEN, temperature=0.0, ignore_eos=True, logprobs=True, lora=name
        )
        core.add_request(str(i), p, params)
    lps: dict[str, list[float]] = {}
    results: dict[str, Any] = {}
    while core.has_work():
        for out in core.step():
            r = results.setdefault(out.request_id, {"ids": [], "cached": 0})
            r["cached"] = out.cached_tokens
            for c in out.outputs:
                r["ids"] += c.token_ids
                lps.setdefault(out.request_id, []).extend(lp.logprob for lp in c.logprobs or [])
    for rid, lp in lps.items():
        results[rid]["lps"] = lp
    return results


@pytest.fixture(scope="module")
def adapters(tiny_models: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Per arch: two adapters (rank 4 on every projection, mlx-lm format; rank 8 on
    three, PEFT format), each also in mlx-lm format for the reference."""
    made: dict[str, dict[str, Path]] = {}

    def get(arch: str) -> dict[str, Path]:
        if arch not in made:
            path = tiny_models(arch)
            model, _ = load(str(path))
            root = tmp_path_factory.mktemp(f"lora-{arch}")
            a = random_lora(model, rank=4, seed=1)
            b = random_lora(
                model,
                rank=8,
                seed=2,
                keys=("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"),
            )
            n = len(model.layers)
            made[arch] = {
                "model": path,
                "a": write_mlx(root / "a", a, scale=2.0, num_layers=n),
                "b": write_peft(root / "b", b, alpha=16.0),  # scale 16 / 8 = 2
                "b_mlx": write_mlx(root / "b_mlx", b, scale=2.0, num_layers=n),
            }
        return made[arch]

    return get


def refs(
    model_dir: Path, adapter: Path | None, prompts: list[list[int]], quant: bool = False
) -> list[tuple]:
    model, _ = load(str(model_dir))
    if quant:
        nn.quantize(model, group_size=32, bits=4)
    if adapter is not None:
        # A quantised model fused would be quantised again: compare with the LoRA layers.
        with_adapter(model, adapter, fuse=not quant)
    return [reference(model, p, GEN) for p in prompts]


def check(got: dict, rid: str, ref: tuple, logprobs: bool = True) -> None:
    tokens, lps, gaps = ref
    assert agrees(got[rid]["ids"], tokens, gaps), (rid, got[rid]["ids"], tokens)
    if logprobs and got[rid]["ids"] == tokens:
        assert max(abs(a - b) for a, b in zip(got[rid]["lps"], lps)) < 2e-3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_one_adapter_equals_mlx_lm_fused(adapters: Any, arch: str) -> None:
    ad = adapters(arch)
    prompts = random_prompts(500, 3, seed=5)
    core = EngineCore(loaded_model(ad["model"]), config())
    core.add_lora("a", str(ad["a"]))
    got = greedy(core, prompts, ["a"] * 3)
    want = refs(ad["model"], ad["a"], prompts)
    base = refs(ad["model"], None, prompts)
    for i in range(3):
        check(got, str(i), want[i])
    assert any(w[0] != b[0] for w, b in zip(want, base)), "the adapter changes nothing"


@pytest.mark.parametrize("compile_", ["0", "1"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_mixed_batch_base_and_two_adapters(adapters: Any, arch: str, compile_: str) -> None:
    """Base rows, an mlx-lm adapter and a PEFT adapter of another rank and other targets,
    prompts of different lengths, chunked prefill (16 tokens a step), all at once; with
    the decode step compiled or op by op."""
    ad = adapters(arch)
    prompts = random_prompts(500, 6, seed=9)
    loras = [None, "a", "b", "a", None, "b"]
    cfg = config(max_num_batched_tokens=16, kernels=KernelConfig(compile=compile_))
    core = EngineCore(loaded_model(ad["model"]), cfg)
    core.add_lora("a", str(ad["a"]))
    core.add_lora("b", str(ad["b"]))
    calls = {"lora": 0}
    if compile_ == "1":
        graph = core.runner.graph
        assert graph is not None
        traced = graph._fn_lora

        def counted(*args: Any) -> Any:
            calls["lora"] += 1
            return traced(*args)

        graph._fn_lora = counted  # type: ignore[method-assign]
    got = greedy(core, prompts, loras)
    if compile_ == "1":
        assert calls["lora"] > 0  # decode steps with adapter rows ran compiled
    ref_dirs = {None: None, "a": ad["a"], "b": ad["b_mlx"]}
    for i, name in enumerate(loras):
        check(got, str(i), refs(ad["model"], ref_dirs[name], [prompts[i]])[0])


def test_quantised_model(adapters: Any) -> None:
    ad = adapters("llama")
    prompts = random_prompts(500, 3, seed=11)
    core = EngineCore(quantised(loaded_model(ad["model"])), config())
    core.add_lora("a", str(ad["a"]))
    core.add_lora("b", str(ad["b"]))
    loras = ["a", None, "b"]
    got = greedy(core, prompts, loras)
    ref_dirs = {None: None, "a": ad["a"], "b": ad["b_mlx"]}
    for i, name in enumerate(loras):
        check(got, str(i), refs(ad["model"], ref_dirs[name], [prompts[i]], quant=True)[0])


def test_speculative_decoding_with_adapters(adapters: Any) -> None:
    """Prompt lookup proposes without the adapter; verification runs with it: exact."""
    ad = adapters("llama")
    rep = [7, 8, 9, 10, 11, 12] * 4
    prompts = [rep, rep[:-3], random_prompts(500, 1, seed=3)[0]]
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    core = EngineCore(loaded_model(ad["model"]), config(speculative=spec))
    core.add_lora("a", str(ad["a"]))
    loras = ["a", None, "a"]
    got = greedy(core, prompts, loras)
    for i, name in enumerate(loras):
        check(got, str(i), refs(ad["model"], ad["a"] if name else None, [prompts[i]])[0], False)


def test_prefix_cache_is_per_adapter(adapters: Any) -> None:
    ad = adapters("llama")
    prompt = random_prompts(500, 1, seed=2)[0] * 2  # several full blocks
    core = EngineCore(loaded_model(ad["model"]), config())
    core.add_lora("a", str(ad["a"]))
    core.add_lora("b", str(ad["b"]))

    def cached(name: str | None, rid: str) -> int:
        params = SamplingParams(max_tokens=2, temperature=0.0, lora=name)
        core.add_request(rid, prompt, params)
        return run_to_end(core)[rid]["cached"]

    assert cached(None, "base") == 0
    assert cached("a", "a1") == 0  # the base model's blocks are not the adapter's
    assert cached("b", "b1") == 0
    assert cached("a", "a2") > 0  # the same adapter again hits
    assert cached(None, "base2") > 0


def test_add_and_remove(adapters: Any) -> None:
    ad = adapters("llama")
    core = EngineCore(loaded_model(ad["model"]), config())
    with pytest.raises(EngineError, match="not loaded"):
        core.add_request("x", [5, 6, 7], SamplingParams(lora="a"))
    info = core.add_lora("a", str(ad["a"]))
    assert info == {"slot": 1, "rank": 4, "modules": 14}
    assert core.add_lora("a", str(ad["a"]))["slot"] == 1  # the same again: a no-op
    with pytest.raises(EngineError, match="another adapter"):
        core.add_lora("a", str(ad["b"]))
    core.add_request("r", [5, 6, 7], SamplingParams(max_tokens=3, lora="a"))
    with pytest.raises(EngineError, match="in use"):
        core.remove_lora("a")
    run_to_end(core)
    core.remove_lora("a")
    with pytest.raises(EngineError, match="not loaded"):
        core.remove_lora("a")
    # Slots are reused; a later adapter of another rank restacks every layer.
    assert core.add_lora("b", str(ad["b"]))["slot"] == 1
    assert core.add_lora("a", str(ad["a"]))["slot"] == 2


def test_refuses_adapters_the_model_cannot_take(adapters: Any, tiny_models: Any) -> None:
    ad = adapters("llama")
    other = adapters("qwen3")  # same module names, other shapes? same tiny dims: check names
    core = EngineCore(loaded_model(ad["model"]), config())
    bad = Path(str(other["a"]) + "-wide")
    import json
    import shutil

    import mlx.core as mx

    shutil.copytree(other["a"], bad, dirs_exist_ok=True)
    t = mx.load(str(bad / "adapters.safetensors"))
    key = "model.layers.0.self_attn.q_proj.lora_a"
    t[key] = mx.zeros((t[key].shape[0] + 1, t[key].shape[1]))
    mx.save_safetensors(str(bad / "adapters.safetensors"), t)
    with pytest.raises(EngineError, match="does not match"):
        core.add_lora("bad", str(bad))
    t2 = {k.replace("layers.0", "layers.9"): v for k, v in t.items()}
    mx.save_safetensors(str(bad / "adapters.safetensors"), t2)
    with pytest.raises(EngineError, match="has no module"):
        core.add_lora("bad", str(bad))
    cfg = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "fine_tune_type": "dora"}))
    with pytest.raises(EngineError, match="dora"):
        core.add_lora("bad", str(bad))
    assert core.runner.lora is None or not core.runner.lora.by_name
