"""Tiny random-weight models of real architectures, built at test time.

Each model is a folder laid out like a Hugging Face checkpoint (``config.json``,
``model.safetensors`` in float32, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json``), so ``mlx_lm.utils.load`` and ``transformers`` both read it.
The weights are created with mlx-lm's own model classes, so shapes and names always match
the installed mlx-lm, and filled deterministically from a seed with numpy (not MLX's RNG,
whose stream may change between MLX versions).

Each build takes well under a second (the tokenizer, trained once per process, ~0.2 s).
Use :func:`get_tiny_model` (or the ``tiny_models`` fixture in ``conftest.py``) to build each
``(arch, seed, overrides)`` once per process.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import shutil
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

ARCHS: tuple[str, ...] = ("llama", "qwen3", "gemma3", "qwen3_next", "qwen3_moe", "gpt_oss")

SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
TOKENIZER_VOCAB_SIZE = 768

# ChatML as Qwen writes it. Content may also be a list of {"type": "text"} parts, since
# some clients send that shape and a test template should not be the thing that breaks.
CHAT_TEMPLATE = (
    # Tools are shown in a system block and past calls as <tool_call> JSON, as Qwen does.
    "{%- if tools -%}{{- '<|im_start|>system\\n# Tools' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "{{- '<tool_call>' + (call['function'] | tojson) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Standard-library sources the tokenizer is trained on: code plus plenty of English in
# docstrings, so both prose and code prompts tokenize into a sensible number of pieces.
_CORPUS_MODULES: tuple[str, ...] = (
    "textwrap.py",
    "string.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "argparse.py",
    "dataclasses.py",
    "functools.py",
)
_EXTRA_TEXT = (
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.\n"
    "Hello, how are you today? I am a helpful assistant. What is the weather like?\n"
    "Write a short poem about the sea. Once upon a time there was a small model.\n"
)


def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [_EXTRA_TEXT * 20]
    for name in _CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8"))
    return texts


def build_tokenizer(dest: Path) -> None:
    """Train a small byte-level BPE with ChatML special tokens and save it into ``dest``.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template inline).
    Ids 0, 1, 2 are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    # Byte level like GPT-2/Qwen: every string encodes, and mlx-lm picks its
    # BPE streaming detokenizer from the ByteLevel decoder.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.save(str(dest / "tokenizer.json"))

    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))


def _token_ids(tokenizer_dir: Path) -> tuple[int, dict[str, int]]:
    """Vocab size and special-token ids, read back from the saved tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    return tok.get_vocab_size(with_added_tokens=True), ids


def tiny_config(
    arch: str, *, vocab_size: int, eos_token_id: int, pad_token_id: int, **overrides: Any
) -> dict[str, Any]:
    """The Hugging Face style ``config.json`` of a tiny model of ``arch``.

    Keys are the ones the real checkpoints use, so both mlx-lm's ``ModelArgs`` and
    transformers' config classes read them. ``overrides`` replace keys; ``layer_types`` is
    derived again from the (overridden) layer count and pattern unless given.
    """
    config = _base_config(arch, vocab_size, eos_token_id, pad_token_id)
    config.update(overrides)
    if "layer_types" not in overrides:
        n = config["num_hidden_layers"]
        if arch == "gemma3":
            p = config["sliding_window_pattern"]
            config["layer_types"] = [
                "full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(n)
            ]
        elif arch == "qwen3_next":
            p = config["full_attention_interval"]
            config["layer_types"] = [
                "full_attention" if (i + 1) % p == 0 else "linear_attention" for i in range(n)
            ]
        elif arch == "gpt_oss":
            # Sliding first, then alternating, as in the real model.
            config["layer_types"] = [
                "full_attention" if i % 2 else "sliding_attention" for i in range(n)
            ]
    return config


def _base_config(arch: str, vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict:
    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "bos_token_id": None,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "torch_dtype": "float32",
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if arch == "llama":
        return {
            **common,
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            # Untied here, tied in qwen3 and gemma3, so both lm_head paths are exercised.
            "tie_word_embeddings": False,
        }
    if arch == "qwen3":
        return {
            **common,
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_act": "silu",
            "rope_theta": 1000000.0,
            "attention_bias": False,
            "tie_word_embeddings": True,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    if arch == "gemma3":
        return {
            **common,
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "num_hidden_layers": 4,
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": 16,
            "rope_theta": 1000000.0,
            "rope_local_base_freq": 10000.0,
            # A window shorter than a chat prompt, so ordinary tests cross it.
            "sliding_window": 8,
            # Sliding, full, sliding, full.
            "sliding_window_pattern": 2,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "tie_word_embeddings": True,
        }
    if arch == "qwen3_next":
        return {
            **common,
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "num_hidden_layers": 4,
            "hidden_act": "silu",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "attention_bias": False,
            # Three gated-delta (recurrent) layers, then one full-attention layer, as in
            # the real model.
            "full_attention_interval": 4,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            # 32 is the smallest head size mlx-lm's Metal gated-delta kernel takes, so the
            # kernel runs on Apple GPUs rather than the ops fallback.
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "linear_conv_kernel_dim": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "tie_word_embeddings": False,
        }
    if arch == "qwen3_moe":
        # Qwen3-30B-A3B's structure: every layer a routed MoE (no shared expert), q/k norms.
        return {
            **common,
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_act": "silu",
            "rope_theta": 1000000.0,
            "attention_bias": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 2,
            "router_aux_loss_coef": 0.001,
            "tie_word_embeddings": False,
        }
    if arch == "gpt_oss":
        # gpt-oss-20b's structure: biased projections, attention sinks, sliding-window and
        # full layers alternating, SwiGLU experts with a clamp, a YaRN RoPE.
        return {
            **common,
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "num_hidden_layers": 4,
            "intermediate_size": 32,
            "hidden_act": "silu",
            "rms_norm_eps": 1e-5,
            "attention_bias": True,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "experts_per_token": 2,
            # A window shorter than a chat prompt, so ordinary tests cross it.
            "sliding_window": 8,
            "rope_theta": 150000.0,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
                # gpt-oss-20b says false; mlx-lm 0.32's YaRN always rounds the correction
                # range (true), so only true agrees with transformers.
                "truncate": True,
            },
            "initial_context_length": 4096,
            "swiglu_limit": 7.0,
            "router_aux_loss_coef": 0.9,
            "output_router_logits": False,
            "tie_word_embeddings": False,
        }
    raise ValueError(f"unknown tiny arch {arch!r}; expected one of {ARCHS}")


# Random weights of a "trained-looking" scale. With plain fan-in init, a tiny model's
# residual stream is dominated by the input token's embedding, so greedy decoding maps each
# token to a fixed successor and soon repeats one token forever (always, with tied
# embeddings, where a token's own embedding wins the argmax). Small embeddings, layer
# outputs of gain 3 and sharper attention (q/k norm scale 2.5) make the next token depend
# on the context; the logit scale is then restored with the final norm (tied) or lm_head.
_EMBED_STD = 0.1
_OUT_GAIN = 3.0
_QK_NORM_SCALE = 2.5
_LOGIT_STD = 3.0
_OUT_PROJS = ("o_proj.weight", "down_proj.weight", "out_proj.weight")
_GEMMA_OUT_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")


def _init_weights(model: Any, config: dict, seed: int) -> dict[str, np.ndarray]:
    """Deterministic random weights for every parameter of ``model`` (MLX names)."""
    rng = np.random.default_rng(seed)
    hidden = config["hidden_size"]
    tied = bool(config.get("tie_word_embeddings"))
    # Norms whose scale is stored as w with the model computing (1 + w).
    one_plus = config["model_type"] == "gemma3_text"
    out: dict[str, np.ndarray] = {}
    for name, param in sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0]):
        shape = tuple(param.shape)
        if name.endswith("A_log"):
            # Decay rates as in the reference init: log of U(1, 16).
            w = np.log(rng.uniform(1.0, 16.0, size=shape))
        elif name.endswith("dt_bias"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1 and "norm" in name:
            # Jittered, so a converter that drops or double-applies a norm changes logits.
            scale = 1.0
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                scale = _QK_NORM_SCALE
            elif one_plus and name.endswith(_GEMMA_OUT_NORMS):
                # Gemma normalises each sublayer's output, so its output gain lives here.
                scale = _OUT_GAIN
            elif name == "model.norm.weight" and tied:
                scale = _LOGIT_STD / (_EMBED_STD * np.sqrt(hidden))
            w = scale * (1.0 + 0.1 * rng.standard_normal(shape)) - (1.0 if one_plus else 0.0)
        elif name.endswith("sinks"):
            # gpt-oss's per-head sink logits: of the scale of the scores, so they matter.
            w = rng.standard_normal(shape)
        elif len(shape) == 1 or name.endswith(".bias"):
            w = 0.1 * rng.standard_normal(shape)  # biases (stacked per expert too)
        elif "embed_tokens" in name:
            w = _EMBED_STD * rng.standard_normal(shape)
        elif name.startswith("lm_head"):
            w = rng.standard_normal(shape) * (_LOGIT_STD / np.sqrt(hidden))
        elif "conv1d" in name:
            # MLX Conv1d weight is (out, kernel, in/groups); fan-in is the kernel width.
            w = rng.standard_normal(shape) / np.sqrt(shape[1])
        elif name.endswith(".weight"):
            # Linear and stacked expert weights, (..., out, in): unit-variance outputs for
            # unit-variance inputs.
            gain = _OUT_GAIN if name.endswith(_OUT_PROJS) else 1.0
            w = gain * rng.standard_normal(shape) / np.sqrt(shape[-1])
        else:
            raise ValueError(f"no init rule for parameter {name} {shape}")
        out[name] = w.astype(np.float32)
    return out


def _to_hf_layout(arch: str, weights: dict[str, np.ndarray], config: dict) -> dict:
    """Turn MLX-named weights into the checkpoint layout of the Hugging Face model.

    For llama, qwen3 and gemma3 the two are the same. For qwen3_next and qwen3_moe, mlx-lm's
    ``sanitize`` converts a checkpoint on load (experts stacked; for qwen3_next also conv1d
    axes moved and ``1 + w`` norms), so the file holds the inverse, exactly as a real
    checkpoint does. gpt_oss is stored as mlx-lm holds it (gate and up experts apart), as
    mlx-community's conversions are: its ``sanitize`` reads the original MXFP4 blocks, not
    transformers' bf16 layout (`gpt_oss_hf_state` makes that one for the reference).
    """
    if arch not in ("qwen3_next", "qwen3_moe") or not any(".switch_mlp." in k for k in weights):
        # mlx-lm's qwen3_next sanitize converts only checkpoints with MoE layers; a dense
        # variant (num_experts=0) therefore has to be stored in MLX layout, which
        # transformers would misread.
        return weights
    out: dict[str, np.ndarray] = {}
    hf_one_plus = (
        ".input_layernorm.weight",
        ".post_attention_layernorm.weight",
        "model.norm.weight",
        ".q_norm.weight",
        ".k_norm.weight",
    )
    next_ = arch == "qwen3_next"
    for name, w in weights.items():
        if ".switch_mlp." in name:
            prefix, proj = name.split(".switch_mlp.")
            proj_name = proj.split(".")[0]
            for e in range(config["num_experts"]):
                out[f"{prefix}.experts.{e}.{proj_name}.weight"] = np.ascontiguousarray(w[e])
        elif next_ and name.endswith("conv1d.weight"):
            out[name] = np.ascontiguousarray(np.moveaxis(w, 2, 1))  # (C, K, 1) -> (C, 1, K)
        elif next_ and any(name.endswith(s) for s in hf_one_plus):
            out[name] = w - 1.0
        else:
            out[name] = w
    return out


def gpt_oss_hf_state(weights: dict[str, Any]) -> dict[str, Any]:
    """A tiny gpt_oss checkpoint's arrays (mlx-lm's layout, numpy) as transformers'
    `GptOssForCausalLM` names and lays them out: gate and up experts interleaved in one
    [experts, in, 2 * out] `gate_up_proj`, `down_proj` [experts, in, out]."""
    out: dict[str, Any] = {}
    for name, w in weights.items():
        if ".experts.gate_proj." in name or ".experts.up_proj." in name:
            continue
        if name.endswith(".experts.down_proj.weight"):
            out[name.replace(".weight", "")] = np.ascontiguousarray(np.swapaxes(w, 1, 2))
        elif name.endswith(".experts.down_proj.bias"):
            out[name.replace("down_proj.bias", "down_proj_bias")] = w
        else:
            out[name] = w
    for name, gate in weights.items():
        if not name.endswith(".experts.gate_proj.weight"):
            continue
        prefix = name[: -len("gate_proj.weight")]
        up = weights[prefix + "up_proj.weight"]
        both = np.stack([gate, up], axis=2)  # [E, out, 2, in]: gate, up alternating
        both = both.reshape(gate.shape[0], -1, gate.shape[2])
        out[prefix + "gate_up_proj"] = np.ascontiguousarray(np.swapaxes(both, 1, 2))
        bias = np.stack([weights[prefix + "gate_proj.bias"], weights[prefix + "up_proj.bias"]], 2)
        out[prefix + "gate_up_proj_bias"] = bias.reshape(gate.shape[0], -1)
    return out


def build_tiny_model(arch: str, dest: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Build a tiny random model of ``arch`` in ``dest`` and return ``dest``.

    ``overrides`` replace keys of the config (for example ``num_hidden_layers=3`` or
    ``sliding_window=16``); the weights follow whatever shapes the overridden config gives.
    """
    from mlx_lm.utils import _get_classes

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    ensure_tokenizer(dest)
    vocab_size, ids = _token_ids(dest)
    config = tiny_config(
        arch,
        vocab_size=vocab_size,
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        **overrides,
    )

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    weights = _init_weights(model, config, seed)
    if config.get("tie_word_embeddings"):
        # Tied checkpoints carry no lm_head (mlx-lm's gemma3 builds one and drops it in
        # sanitize when the file has none; the other classes never build it).
        weights.pop("lm_head.weight", None)
    weights = _to_hf_layout(arch, weights, config)
    return write_checkpoint(dest, weights, config, ids, "pt")


def write_checkpoint(
    dest: Path, weights: dict[str, np.ndarray], config: dict, ids: dict[str, int], fmt: str
) -> Path:
    """A model folder: the weights (`fmt`: "pt" for Hugging Face names, "mlx" for mlx-lm's),
    config.json and a generation_config.json with the tiny tokenizer's end and pad ids."""
    mx.save_safetensors(
        str(dest / "model.safetensors"),
        {k: mx.array(v) for k, v in sorted(weights.items())},
        metadata={"format": fmt},
    )
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    generation_config = {
        "eos_token_id": ids[EOS_TOKEN],
        "pad_token_id": ids[PAD_TOKEN],
        "bos_token_id": None,
    }
    (dest / "generation_config.json").write_text(json.dumps(generation_config, indent=2))
    return dest


# --- memoisation -------------------------------------------------------------------------

_lock = threading.RLock()
_tokenizer_dir: Path | None = None
_cache: TinyModelCache | None = None


def ensure_tokenizer(dest: Path) -> None:
    """Copy the process-wide trained tokenizer into ``dest``, training it on first use."""
    global _tokenizer_dir
    with _lock:
        if _tokenizer_dir is None or not (_tokenizer_dir / "tokenizer.json").exists():
            tdir = Path(tempfile.mkdtemp(prefix="pippin-tiny-tokenizer-"))
            atexit.register(shutil.rmtree, tdir, True)
            build_tokenizer(tdir)
            _tokenizer_dir = tdir
        src = _tokenizer_dir
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, dest / name)


def _key(arch: str, seed: int, overrides: dict[str, Any]) -> str:
    blob = json.dumps([arch, seed, overrides], sort_keys=True, default=str)
    return f"{arch}-s{seed}-{hashlib.sha256(blob.encode()).hexdigest()[:10]}"


class TinyModelCache:
    """Builds each ``(arch, seed, overrides)`` once under ``root`` and returns its folder.

    ``build(arch, dest, seed=..., **overrides)`` makes one (other builders, such as
    ``tiny_hybrids``, memoise through this too)."""

    def __init__(self, root: Path, build: Callable[..., Path] | None = None) -> None:
        self.root = Path(root)
        self._build = build or build_tiny_model
        self._built: dict[str, Path] = {}

    def __call__(self, arch: str, *, seed: int = 0, **overrides: Any) -> Path:
        key = _key(arch, seed, overrides)
        # One lock for all builds: they take a fraction of a second, and MLX work from
        # several threads at once gains nothing.
        with _lock:
            if key not in self._built:
                dest = self.root / key
                self._built[key] = self._build(arch, dest, seed=seed, **overrides)
            return self._built[key]


def set_cache_root(root: Path) -> TinyModelCache:
    """Memoise :func:`get_tiny_model` builds under ``root`` (conftest uses pytest's tmp)."""
    global _cache
    with _lock:
        if _cache is None or _cache.root != Path(root):
            _cache = TinyModelCache(root)
        return _cache


def cache_root() -> Path:
    """Where memoised builds go: :func:`set_cache_root`'s folder, else a temporary one
    removed at exit."""
    with _lock:
        if _cache is None:
            root = Path(tempfile.mkdtemp(prefix="pippin-tiny-models-"))
            atexit.register(shutil.rmtree, root, True)
            set_cache_root(root)
        assert _cache is not None
        return _cache.root


def get_tiny_model(arch: str, *, seed: int = 0, **overrides: Any) -> Path:
    """Memoised :func:`build_tiny_model`: the folder of a tiny ``arch`` model, built once.

    Without :func:`set_cache_root`, models go to a temporary folder removed at exit.
    Treat the folder as read-only: other tests share it.
    """
    with _lock:
        cache_root()
        cache = _cache
        assert cache is not None
    return cache(arch, seed=seed, **overrides)


def with_swapped_tokens(src: Path, dest: Path, a: int = 100, b: int = 101) -> Path:
    """A copy of the model folder `src` in `dest` whose tokenizer has ids `a` and `b`
    swapped: the same size, another vocabulary (a draft model that must be refused)."""
    shutil.copytree(src, dest)
    path = dest / "tokenizer.json"
    tok = json.loads(path.read_text())
    vocab = tok["model"]["vocab"]
    ta, tb = (t for t, i in vocab.items() if i in (a, b))
    vocab[ta], vocab[tb] = vocab[tb], vocab[ta]
    path.write_text(json.dumps(tok))
    return dest
