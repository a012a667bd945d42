"""GGUF files: an HF-style config and tokenizer rebuilt from the metadata, tensors renamed to
mlx-lm's parameter names, and the model built from mlx-lm's own classes.

Tensor types that `mx.load` reads (F32, F16, Q4_0, Q4_1, Q8_0) stay MLX-quantised, straight from
the file. A file with any other type (the K-quants, Q5_0, BF16, ...) cannot be read by `mx.load`
at all, so it is dequantised once with the `gguf` package and kept as an MLX folder in the cache:
as float16 on the CPU (where float32 BLAS matmuls are the fast path), and on GPUs and Macs
re-quantised to MLX's affine format (Q4_K/Q5_K and lower to 4 bits, Q6_K and Q8_0 to 8 bits,
group size 64), so memory stays near the file's size (`requantise`, `PIPPIN_GGUF_REQUANT`).
Either way the cache folder holds config.json and the tokenizer, so a second load skips the slow
metadata and tokenizer conversion.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import mmap
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Container
from pathlib import Path
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import _get_classes, infer_quant_config, load_config, load_tokenizer
from mlx_lm.utils import load_model as mlx_load_model

from pippin import envs

from .loaded import ModelLoadError

logger = logging.getLogger(__name__)

# Bump when the cache layout or the conversion changes, so old entries are not reused.
_CACHE_VERSION = 5

# Per llama.cpp architecture: the mlx-lm model type, and whether llama.cpp's converter permuted
# q/k for its interleaved ("normal") RoPE, which mlx-lm then has to run as traditional RoPE.
_ARCHS: dict[str, tuple[str, bool]] = {
    "llama": ("llama", True),
    "qwen2": ("qwen2", False),
    "qwen3": ("qwen3", False),
    "gemma3": ("gemma3_text", False),
}

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Gemma norms around the MLP: ffn_norm is the pre-MLP norm there.
_GEMMA_BLOCK_NAMES = {**_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm"}
_TENSOR = re.compile(r"^(?:blk\.(\d+)\.)?(\w+)\.(weight|bias|scales|biases)$")
# llama.cpp's end-of-generation tokens besides eos, matched by text.
_END_OF_TURN = (
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
)
# ggml types mx.load reads: F32, F16, Q4_0, Q4_1, Q8_0. It reads BF16 too, but as float16.
_MLX_NATIVE = {0, 1, 2, 3, 8}
_F32, _BF16 = 0, 30
_SHARD_BYTES = 2 << 30
# llama.cpp stores llama3-style RoPE scaling as a tensor of per-frequency factors, not metadata.
_SKIPPED = {"rope_freqs.weight"}
# Re-quantisation: ggml type -> MLX affine bits. Q2_K..Q5_K (and the legacy 4/5-bit types)
# -> 4 bits, Q6_K and Q8_0 -> 8 bits; float types stay float.
_REQUANT_BITS = {2: 4, 3: 4, 6: 4, 7: 4, 10: 4, 11: 4, 12: 4, 13: 4, 14: 8, 8: 8}
REQUANT_GROUP_SIZE = 64


def requantise() -> bool:
    """Whether K-quant tensors are re-quantised (MLX affine) rather than dequantised:
    `PIPPIN_GGUF_REQUANT` 1 or 0, else (auto) everywhere but the CPU."""
    choice = envs.PIPPIN_GGUF_REQUANT
    if choice in ("0", "1"):
        return choice == "1"
    return mx.default_device() != mx.cpu


def cache_root() -> Path:
    if env := envs.PIPPIN_CACHE_DIR:
        return Path(env)
    base = envs.XDG_CACHE_HOME or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pippin"


def load_gguf(
    path: Path, *, trust_remote_code: bool = False, weights: bool = True
) -> tuple[nn.Module, TokenizerWrapper, dict[str, Any], Path]:
    """(model, tokenizer, config, cache folder); the weights are not evaluated yet.

    weights False, for a process that never runs the model (the API process of an engine
    process): a file MLX reads natively (read whole, not lazily) is not read; the model is
    then a skeleton whose parameters are never computed."""
    requant = requantise()
    folder = cache_folder(path, requant)
    key = folder.name.rsplit("-v", 1)[0]
    tensors: dict[str, mx.array] | None = None
    if not (folder / "config.json").exists():
        tensors = _convert(path, folder, requant)
        for stale in folder.parent.glob(f"{key}-v*"):
            version = stale.name[len(key) + 2 :].split("-")[0].split(".")[0]
            if version != str(_CACHE_VERSION):  # converted by an older pippin
                shutil.rmtree(stale, ignore_errors=True)
    if any(folder.glob("model*.safetensors")):
        model, config = mlx_load_model(folder, lazy=True)
    else:
        config = load_config(folder)
        if weights and tensors is None:
            tensors = _native_weights(path, config)
        model = _instantiate(config, tensors if weights else None)
    tokenizer = load_tokenizer(
        folder,
        {"trust_remote_code": trust_remote_code},
        eos_token_ids=config.get("eos_token_id"),
    )
    return model, tokenizer, config, folder


def cache_folder(path: Path, requant: bool = False) -> Path:
    """Where the conversion of this GGUF file is kept (re-quantised or dequantised)."""
    suffix = f"-q{REQUANT_GROUP_SIZE}" if requant else ""
    return cache_root() / "gguf" / f"{_file_key(path)}-v{_CACHE_VERSION}{suffix}"


def _file_key(path: Path) -> str:
    # Content-based without reading gigabytes: size, the whole header region and samples.
    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    chunk = 1 << 16
    with open(path, "rb") as f:
        h.update(f.read(4 << 20))
        for i in range(33):
            f.seek(max(0, (size - chunk) * i // 32))
            h.update(f.read(chunk))
    return h.hexdigest()[:24]


def _convert(path: Path, folder: Path, requant: bool = False) -> dict[str, mx.array] | None:
    """Write the cache folder; return the weights when they came straight from `mx.load`."""
    from gguf.quants import dequantize

    meta, tensors = read_header(path)
    arch = meta.get("general.architecture")
    names = {t.name for t in tensors}
    config = gguf_config(meta, names)
    types = {t.ggml_type for t in tensors}
    weights: dict[str, mx.array] | None = None
    if types <= _MLX_NATIVE:
        try:
            weights = mx.load(str(path))
        except (RuntimeError, ValueError):
            weights = None
    # The dtype a GPU computes in: the file's own, where half means float16 (that of the
    # quantisation scales) except for BF16 files and Gemma, whose activations overflow float16.
    if types <= {_F32}:
        config["torch_dtype"] = "float32"
    elif arch == "gemma3" or _BF16 in types:
        config["torch_dtype"] = "bfloat16"
    else:
        config["torch_dtype"] = "float16"
    if "rope_freqs.weight" in names:
        rope = next(t for t in tensors if t.name == "rope_freqs.weight")
        factors = dequantize(_tensor_bytes(path, rope), rope.ggml_type).reshape(rope.shape)
        config["rope_scaling"] = _llama3_scaling(factors, config)

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        tokenizer = _write_tokenizer(path, tmp)
        _add_end_of_turn_ids(config, tokenizer)
        if weights is None:
            how = "re-quantising" if requant else "dequantising"
            logger.info("%s GGUF weights once into the pippin cache", how)
            quant = _save_dequantised(path, tensors, arch, _BF16 in types, tmp, requant)
            if quant:
                config["quantization"] = {"group_size": REQUANT_GROUP_SIZE, "bits": 4, **quant}
        with open(tmp / "config.json", "w") as f:
            json.dump(config, f, indent=2)
        _write_generation_config(meta, config, tmp)
        try:
            os.replace(tmp, folder)
        except OSError:
            # Another process filled the same entry first; theirs is as good as ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return None if weights is None else _rename(weights, arch)


class TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # numpy order (slowest dimension first)
    ggml_type: int
    start: int  # byte offset in the file
    nbytes: int


# GGUF metadata value types -> numpy dtypes; 8 is a string, 9 an array.
_SCALARS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}


def read_header(
    path: Path, keep_strings: Container[str] = ()
) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Metadata and tensor table of a GGUF file (v2/v3).

    gguf.GGUFReader would do, but it turns every vocabulary string into numpy objects (8 s for
    a 150k vocabulary); this skips big string arrays unless named in `keep_strings`, leaving
    their length.
    """
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            return _parse_header(blob, keep_strings)
    except (ValueError, struct.error, UnicodeDecodeError, OSError) as e:
        raise ModelLoadError(f"{path.name} is not a readable GGUF file: {e}") from e


def _parse_header(
    blob: mmap.mmap, keep_strings: Container[str]
) -> tuple[dict[str, Any], list[TensorInfo]]:
    if blob[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    pos = 24

    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", blob, pos)
        return blob[pos + 8 : pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

    def value(kind: int, pos: int, key: str) -> tuple[Any, int]:
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind])
            v = np.frombuffer(blob[pos : pos + dtype.itemsize], dtype)[0]
            # Shortest repr, so a float32 1e-05 does not become 9.999999747378752e-06.
            return (float(str(v)) if kind == 6 else v.item()), pos + dtype.itemsize
        if kind == 8:
            return string(pos)
        if kind != 9:
            raise ValueError(f"unknown metadata type {kind}")
        item, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if item in _SCALARS:
            end = pos + count * np.dtype(_SCALARS[item]).itemsize
            return np.frombuffer(blob[pos:end], _SCALARS[item]).tolist(), end
        if item == 8 and count > 64 and key not in keep_strings:
            for _ in range(count):
                pos += 8 + struct.unpack_from("<Q", blob, pos)[0]
            return count, pos
        values = []
        for _ in range(count):
            v, pos = value(item, pos, key)
            values.append(v)
        return values, pos

    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", blob, pos)
        meta[key], pos = value(kind, pos + 4, key)
    raw = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", blob, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
        kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
        pos += 16 + 8 * n_dims
        raw.append((name, tuple(reversed(dims)), kind, offset))
    align = meta.get("general.alignment", 32)
    data_start = -(-pos // align) * align
    tensors = []
    for name, shape, kind, offset in raw:
        block, size = _block_shape(kind)
        nbytes = math.prod(shape) // block * size
        tensors.append(TensorInfo(name, shape, kind, data_start + offset, nbytes))
    return meta, tensors


def _tensor_bytes(path: Path, t: TensorInfo) -> np.ndarray:
    """A tensor's raw blocks as rows of bytes, the layout gguf.quants.dequantize takes."""
    blob = np.memmap(path, mode="r", dtype=np.uint8)
    block, size = _block_shape(t.ggml_type)
    rows = blob[t.start : t.start + t.nbytes].view(np.ndarray)
    return rows.reshape(*t.shape[:-1], t.shape[-1] // block * size)


def _block_shape(ggml_type: int) -> tuple[int, int]:
    """(values per block, bytes per block); ValueError for a type gguf does not know."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]


def gguf_config(meta: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The HF-style config.json that mlx-lm's model class for this file expects."""
    arch = meta.get("general.architecture")
    if arch not in _ARCHS:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(_ARCHS)})"
        )
    model_type, traditional_rope = _ARCHS[arch]

    def key(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    hidden = key("embedding_length")
    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise ModelLoadError("GGUF with a different kv head count per layer is not supported")
        kv_heads = kv_heads[0]
    head_dim = key("attention.key_length", hidden // heads)
    tokens = meta.get("tokenizer.ggml.tokens", 0)
    vocab = key("vocab_size") or (tokens if isinstance(tokens, int) else len(tokens))
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "vocab_size": vocab,
        "max_position_embeddings": key("context_length"),
        # llama.cpp writes output.weight only when it is not the embedding matrix.
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "rope_traditional": traditional_rope,
        "gguf_architecture": arch,
    }
    if (theta := key("rope.freq_base")) is not None:
        config["rope_theta"] = theta
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch == "gemma3":
        layers = config["num_hidden_layers"]
        pattern = key("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # per-layer "is sliding" flags: period = first global + 1
            pattern = pattern.index(False) + 1 if False in pattern else layers + 1
        config.update(
            sliding_window=key("attention.sliding_window", 512),
            sliding_window_pattern=pattern,
            # Not in the metadata; llama.cpp hard-codes it for gemma3 too.
            rope_local_base_freq=10000.0,
            # Gemma3 27B (62 layers) scales queries by hidden/heads, the others by head_dim.
            query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
        )
    if scaling := _rope_scaling(meta, arch):
        config["rope_scaling"] = scaling
    config.update(_token_ids(meta))
    return config


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    scaling: dict[str, Any] = {"type": kind, "rope_type": kind, "factor": factor}
    if original := meta.get(f"{arch}.rope.scaling.original_context_length"):
        scaling["original_max_position_embeddings"] = original
    return scaling


def _llama3_scaling(factors: np.ndarray, config: dict[str, Any]) -> dict[str, Any]:
    """Recover Llama 3.x rope_scaling from llama.cpp's rope_freqs tensor, checking it fits."""
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    dims = config["head_dim"]
    freqs = config.get("rope_theta", 10000.0) ** (-np.arange(0, dims, 2) / dims)
    wavelen = 2 * math.pi / freqs
    orig, low, high = 8192, 1.0, 4.0
    smooth = (orig / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < orig / high,
        1.0,
        np.where(
            wavelen > orig / low,
            scaling["factor"],
            1 / ((1 - smooth) / scaling["factor"] + smooth),
        ),
    )
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-3):
        raise ModelLoadError("GGUF rope_freqs do not match Llama 3 RoPE scaling")
    return scaling


def _token_ids(meta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # End-of-turn / end-of-message tokens end generation just like eos (Llama 3's <|eot_id|>).
    eos = [
        meta[f"tokenizer.ggml.{k}_token_id"]
        for k in ("eos", "eot", "eom")
        if meta.get(f"tokenizer.ggml.{k}_token_id") is not None
    ]
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else list(dict.fromkeys(eos))
    for name, k in (("bos_token_id", "bos"), ("pad_token_id", "padding")):
        if (value := meta.get(f"tokenizer.ggml.{k}_token_id")) is not None:
            out[name] = value
    return out


def _write_generation_config(meta: dict[str, Any], config: dict[str, Any], folder: Path) -> None:
    # Recent llama.cpp converters copy generation_config.json into general.sampling.*.
    names = {
        "temp": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "min_p": "min_p",
        "penalty_repeat": "repetition_penalty",
    }
    gen = {
        hf: meta[f"general.sampling.{k}"]
        for k, hf in names.items()
        if meta.get(f"general.sampling.{k}") is not None
    }
    if "eos_token_id" in config:
        gen["eos_token_id"] = config["eos_token_id"]
    with open(folder / "generation_config.json", "w") as f:
        json.dump(gen, f, indent=2)


def _add_end_of_turn_ids(config: dict[str, Any], tokenizer: Any) -> None:
    """Stop also on the end-of-turn tokens a vocabulary has, as llama.cpp does.

    A GGUF names one eos; chat models end turns with another (Gemma's <end_of_turn>, Qwen's
    <|im_end|> vs <|endoftext|>), which their generation_config.json lists beside it.
    """
    eos = config.get("eos_token_id")
    ids = [eos] if isinstance(eos, int) else list(eos or [])
    # The whole vocabulary: releases before 5.24 add a BPE vocabulary's control tokens as
    # plain tokens, and these markers are never ordinary text.
    vocab = tokenizer.get_vocab()
    ids += [vocab[t] for t in _END_OF_TURN if t in vocab]
    ids = list(dict.fromkeys(ids))
    if ids:
        config["eos_token_id"] = ids[0] if len(ids) == 1 else ids


def _write_tokenizer(path: Path, folder: Path) -> Any:
    # transformers' own GGUF vocabulary conversion, fed from our reader: its file reader
    # (and so AutoTokenizer's gguf_file route) needs torch, which pippin does not.
    from transformers import PreTrainedTokenizerFast

    try:  # newer transformers
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    except ImportError:  # older releases (5.17 on the GPU image) keep both in ggml.py
        from transformers.integrations.ggml import (  # type: ignore[no-redef]
            GGUF_TOKENIZER_MAPPING,
            convert_gguf_tokenizer,
        )
    meta, _ = read_header(path, ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    groups = {
        group: {
            name: meta[f"tokenizer.{key}"]
            for key, name in renames.items()
            if f"tokenizer.{key}" in meta
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tok_dict, tok_config = groups["tokenizer"], groups["tokenizer_config"]
    if "tokens" not in tok_dict:
        raise ModelLoadError(f"{path.name} has no tokenizer vocabulary")
    if tok_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS for sentencepiece vocabularies that do not say otherwise.
        tok_config.setdefault("add_bos_token", True)
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        tok_config[f"{name}_token"] = tok_dict["tokens"][token_id] if token_id is not None else None
    arch = meta["general.architecture"]
    try:
        backend, extra = convert_gguf_tokenizer(arch, tok_dict)
    except (KeyError, TypeError):
        # Releases before 5.24 pick the converter by architecture alone, keyed by model_type
        # ("gemma3_text"), whose sentencepiece converter fails on a BPE vocabulary.
        bpe = tok_dict.get("tokenizer_type") == "gpt2"
        backend, extra = convert_gguf_tokenizer("gpt2" if bpe else f"{arch}_text", tok_dict)
    # Older releases also return special tokens; the header's win, as in newer releases.
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **{**extra, **tok_config})
    tokenizer.save_pretrained(str(folder))
    return tokenizer


def _mlx_name(gguf_name: str, arch: str) -> str | None:
    if gguf_name in _SKIPPED:
        return None
    m = _TENSOR.match(gguf_name)
    if m is None:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, suffix = m.groups()
    if layer is None:
        base = _TOP_NAMES.get(part)
    else:
        mapped = (_GEMMA_BLOCK_NAMES if arch == "gemma3" else _BLOCK_NAMES).get(part)
        base = f"model.layers.{layer}.{mapped}" if mapped else None
    if base is None:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no counterpart in mlx-lm's {arch}")
    return f"{base}.{suffix}"


def _is_shifted_norm(gguf_name: str, arch: str) -> bool:
    # llama.cpp stores Gemma's RMSNorm weight as 1 + w; mlx-lm's Gemma adds the 1 itself.
    return arch == "gemma3" and gguf_name.endswith("norm.weight")


def _rename(weights: dict[str, mx.array], arch: str) -> dict[str, mx.array]:
    out = {}
    for name, w in weights.items():
        new = _mlx_name(name, arch)
        if new is None:
            continue
        out[new] = w.astype(mx.float32) - 1 if _is_shifted_norm(name, arch) else w
    return out


def _native_weights(path: Path, config: dict[str, Any]) -> dict[str, mx.array]:
    return _rename(mx.load(str(path)), config["gguf_architecture"])


def _save_dequantised(
    path: Path,
    tensors: list[TensorInfo],
    arch: str,
    bf16: bool,
    folder: Path,
    requant: bool = False,
) -> dict[str, dict[str, int]]:
    """Dequantise tensor by tensor into safetensors shards, so memory stays near one shard;
    with ``requant``, quantised matrices are re-quantised to MLX's affine format. Returns
    the per-layer quantisation (mlx-lm's config["quantization"] entries)."""
    from gguf.quants import dequantize

    quant: dict[str, dict[str, int]] = {}
    shard: dict[str, mx.array] = {}
    size = count = 0
    for i, t in enumerate(tensors):
        name = _mlx_name(t.name, arch)
        if name is not None:
            try:
                a = dequantize(_tensor_bytes(path, t), t.ggml_type).reshape(t.shape)
            except NotImplementedError as e:
                raise ModelLoadError(f"cannot dequantise GGUF tensor {t.name}: {e}") from e
            if _is_shifted_norm(t.name, arch):
                a = a.astype(np.float32) - 1
            # float16 holds what quantised blocks decode to (their scales are float16); a BF16
            # file stays bfloat16, whose range float16 lacks.
            if bf16:
                w = mx.array(a.astype(np.float32)).astype(mx.bfloat16)
            else:
                w = mx.array(a.astype(np.float16))
            bits = _REQUANT_BITS.get(t.ggml_type) if requant else None
            if bits and name.endswith(".weight") and _requantisable(w):
                layer = name.removesuffix(".weight")
                q, scales, biases = mx.quantize(w, group_size=REQUANT_GROUP_SIZE, bits=bits)
                shard |= {name: q, f"{layer}.scales": scales, f"{layer}.biases": biases}
                quant[layer] = {"group_size": REQUANT_GROUP_SIZE, "bits": bits}
                size += q.nbytes + scales.nbytes + biases.nbytes
            else:
                shard[name] = w
                size += w.nbytes
        if shard and (size >= _SHARD_BYTES or i == len(tensors) - 1):
            count += 1
            out = folder / f"model-{count:05d}.safetensors"
            mx.save_safetensors(str(out), shard, metadata={"format": "mlx"})
            shard, size = {}, 0
    return quant


def _requantisable(w: mx.array) -> bool:
    # A Linear or Embedding matrix whose rows split into whole groups.
    return w.ndim == 2 and w.shape[-1] % REQUANT_GROUP_SIZE == 0


def _instantiate(config: dict[str, Any], weights: dict[str, mx.array] | None) -> nn.Module:
    """Build the mlx-lm model and quantise the layers the file has quantised, as mlx-lm does;
    without weights, a skeleton whose parameters are never computed."""
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    if weights is None:
        return model
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)

    def quantised(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        return infer_quant_config(path, module, weights)

    nn.quantize(model, group_size=32, bits=4, class_predicate=quantised)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    return model
