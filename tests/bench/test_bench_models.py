"""The benchmarks' random-weight models: the Llama shapes carry the real Llama 3 tokenizer,
and `-4bit`/`-8bit` builds (gpt-oss also `-mxfp4`) are quantised as mlx-community ships models."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import mlx.nn as nn
import pytest
from mlx_lm.utils import load
from support.tiny_models import tiny_config

from pippin.bench import models
from pippin.bench.workload import load_workload, words_per_token

# The 8B's configuration at the tests' tiny sizes (the Llama 3 vocabulary kept).
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_TINY = tiny_config("llama", vocab_size=128256, eos_token_id=128009, pad_token_id=128004)
TINY_LLAMA = {
    **models.CONFIGS["llama-3.1-8b"],
    **{k: _TINY[k] for k in (*_SIZES, "num_key_value_heads", "head_dim")},
}


@pytest.fixture
def tiny_llama(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(models.CONFIGS, "tiny-llama", TINY_LLAMA)
    return "tiny-llama"


@pytest.mark.parametrize("bits", [4, 8])
def test_quantised_llama_with_the_real_tokenizer(
    tiny_llama: str, tmp_path: Path, bits: int
) -> None:
    path = models.build_model(f"{tiny_llama}-{bits}bit", tmp_path)
    model, tokenizer = load(str(path))
    quantised = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    # Every projection and the LM head, at group size 64.
    assert len(quantised) == 2 * 7 + 1
    assert {(m.group_size, m.bits, m.mode) for m in quantised} == {(64, bits, "affine")}
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert len(tokenizer._tokenizer.get_vocab()) == 128256
    messages = [{"role": "user", "content": "Hello"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    text = tokenizer.decode(ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello")
    assert text.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids[0] == 128000 and 128009 in ids
    assert {128001, 128009} <= set(tokenizer.eos_token_ids)
    # Built once: a second call reuses the folder.
    assert models.build_model(f"{tiny_llama}-{bits}bit", tmp_path) == path


def test_unknown_quantisation_is_refused() -> None:
    with pytest.raises(ValueError, match="-4bit, -8bit"):
        models.build_model("llama-3.1-8b-3bit")
    with pytest.raises(ValueError, match="gpt-oss's packing"):
        models.build_model("llama-3.1-8b-mxfp4")


def test_real_tokenizer_workload() -> None:
    w = load_workload("real-tokenizer")
    assert (w.tokenizer, w.prompt_tokens.args, w.output_tokens.args) == ("llama3", (512,), (256,))
    assert "llama3 tokens" in w.describe()
    assert load_workload("long-context").prompt_tokens.args == (16384,)
    # Common English words are about a Llama 3 token each (the small BPE's differ).
    assert 0.8 < words_per_token("llama3") <= 1.2


# The mixture-of-experts shapes at tiny sizes (their real vocabularies kept), through the
# same build as the real ones: lazily, quantised, written by `save_model`.
TINY_MOE = {
    "qwen3-30b-a3b": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "torch_dtype": "float32",  # the fast dtype on CPU
    },
    "gpt-oss-20b": {
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "experts_per_token": 2,
        "sliding_window": 8,
        "torch_dtype": "float32",
    },
}


@pytest.fixture(scope="module", params=sorted(TINY_MOE))
def tiny_moe(request: pytest.FixtureRequest) -> Iterator[str]:
    name = f"tiny-{request.param}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(
            models.CONFIGS, name, {**models.CONFIGS[request.param], **TINY_MOE[request.param]}
        )
        yield name


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for the module's builds: each is made once, as `build_model` reuses them."""
    return tmp_path_factory.mktemp("bench-models")


def test_quantised_moe_with_its_real_tokenizer(tiny_moe: str, moe_root: Path) -> None:
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    path = models.build_model(f"{tiny_moe}-4bit", moe_root)
    model, tokenizer = load(str(path))
    experts = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    layers = models.CONFIGS[tiny_moe]["num_hidden_layers"]
    assert len(experts) == 3 * layers  # gate, up and down experts of every layer
    assert {(m.group_size, m.bits, m.mode) for m in experts} == {(64, 4, "affine")}
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(model.lm_head, nn.QuantizedLinear) and model.lm_head.bits == 4
    messages = [{"role": "user", "content": "Hello there"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if "qwen3" in tiny_moe:
        # Qwen3's own ids: <|im_start|> 151644, "user" 872, "\n" 198, "Hello" 9707.
        assert ids[:4] == [151644, 872, 198, 9707]
        assert len(tokenizer._tokenizer.get_vocab()) == 151643 + 26
        assert set(tokenizer.eos_token_ids) == {151645, 151643}
    else:
        routers = {m.bits for _, m in model.named_modules() if _.endswith("mlp.router")}
        assert routers == {8}  # gpt-oss's own quantisation exception
        # <|start|> 200006, "user" 1428, <|message|> 200008, "Hello" 13225.
        assert ids[:4] == [200006, 1428, 200008, 13225]
        assert ids[-2:] == [200006, 173781]  # <|start|>assistant
        assert len(tokenizer._tokenizer.get_vocab()) == 201088
        assert set(tokenizer.eos_token_ids) == {200002, 199999, 200012}
    assert tokenizer.decode(ids).count("Hello there") == 1


def test_lazy_build_writes_the_eager_model(tiny_moe: str, moe_root: Path) -> None:
    """Writing the model as it is computed gives the weights an evaluated model has."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    path = models.build_model(tiny_moe, moe_root)
    saved = mx.load(str(path / "model.safetensors"))
    eager = dict(tree_flatten(models.random_model(dict(models.CONFIGS[tiny_moe])).parameters()))
    assert saved.keys() == eager.keys()
    assert all(mx.array_equal(saved[k], eager[k]).item() for k in eager)


def test_quantised_moe_serves_as_mlx_lm_decodes(tiny_moe: str, moe_root: Path) -> None:
    """pippin's engine on the built 4-bit model: mlx-lm's greedy tokens, alone and batched."""
    _serves_as_mlx_lm_decodes(models.build_model(f"{tiny_moe}-4bit", moe_root))


def test_gpt_oss_in_mxfp4_as_mlx_community_ships_it(
    moe_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gpt-oss-20b-mxfp4`: the experts MXFP4, everything else 8-bit affine (the router
    too), as `gpt-oss-20b-MXFP4-Q8`; it loads, and pippin's engine decodes as mlx-lm."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    name = "tiny-gpt-oss-20b"
    monkeypatch.setitem(
        models.CONFIGS, name, {**models.CONFIGS["gpt-oss-20b"], **TINY_MOE["gpt-oss-20b"]}
    )
    path = models.build_model(f"{name}-mxfp4", moe_root)
    model, _ = load(str(path))
    experts = [m for _, m in model.named_modules() if isinstance(m, QuantizedSwitchLinear)]
    assert len(experts) == 3 * 4
    assert {(m.group_size, m.bits, m.mode) for m in experts} == {(32, 4, "mxfp4")}
    rest = [
        m
        for _, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    ]
    assert len(rest) == 4 * 5 + 2  # q, k, v, o and the router of each layer; embedding, head
    assert {(m.group_size, m.bits, m.mode) for m in rest} == {(64, 8, "affine")}
    _serves_as_mlx_lm_decodes(path)


def _serves_as_mlx_lm_decodes(path: Path) -> None:
    """pippin's engine on the model at `path`: mlx-lm's greedy tokens, alone and batched."""
    from support.engine_runs import (
        GEN,
        agrees,
        engine_config,
        loaded_model,
        mlx_lm_reference,
        random_prompts,
        run_to_end,
    )

    from pippin.engine.core import EngineCore
    from pippin.engine.types import SamplingParams

    loaded = loaded_model(path)
    prompts = random_prompts(5000, 4, seed=2)
    refs = [mlx_lm_reference(loaded.model, p, GEN) for p in prompts]
    core = EngineCore(loaded, engine_config())
    greedy = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, greedy)
    res = run_to_end(core)
    for i, (ref, gaps) in enumerate(refs):
        assert agrees(res[str(i)]["ids"][0], ref, gaps), (i, res[str(i)]["ids"][0], ref)
