"""Convert a CTranslate2 Whisper model (model.bin, config.json, tokenizer.json) into the MLX
Whisper layout that mlx-whisper loads (config.json + weights.safetensors), plus the Hugging Face
tokenizer and feature-extractor files.

CTranslate2's model.bin (binary version 6; ctranslate2/specs/model_spec.py `save`) is: the
version, the spec name, the revision, the variables (name, shape, dtype id, byte count, bytes)
and aliases. Attention projections are fused there (q|k|v for self-attention, k|v for
cross-attention) and Whisper's key projection has no bias, so the fused biases are split and
the key's (zero) part dropped.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
from pathlib import Path

import numpy as np

# CTranslate2's DataType enum (include/ctranslate2/types.h).
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
_TIMESTAMPS = 1501  # <|0.00|> .. <|30.00|> in steps of 0.02 s


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from("<" + fmt, self.data, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return value

    def string(self) -> str:
        n = self.unpack("H")  # length including the trailing NUL
        text = self.data[self.pos : self.pos + n - 1].decode()
        self.pos += n
        return text


def read_ct2_model(path: Path) -> dict[str, np.ndarray]:
    """Every variable of a CTranslate2 model.bin, aliases resolved."""
    reader = _Reader(path.read_bytes())
    version = reader.unpack("I")
    if version < 5:
        raise ValueError(f"unsupported CTranslate2 model version {version}")
    reader.string()  # spec name
    reader.unpack("I")  # revision
    variables: dict[str, np.ndarray] = {}
    for _ in range(reader.unpack("I")):
        name = reader.string()
        shape = [reader.unpack("I") for _ in range(reader.unpack("B"))]
        dtype_id = reader.unpack("B")
        nbytes = reader.unpack("I")
        if dtype_id not in _CT2_DTYPES:
            raise ValueError(f"{name}: unsupported CTranslate2 dtype {dtype_id} (quantised?)")
        buf = reader.data[reader.pos : reader.pos + nbytes]
        reader.pos += nbytes
        variables[name] = np.frombuffer(buf, dtype=_CT2_DTYPES[dtype_id]).reshape(shape)
    for _ in range(reader.unpack("I")):
        alias, target = reader.string(), reader.string()
        variables[alias] = variables[target]
    return variables


def _layer_count(v: dict[str, np.ndarray], side: str) -> int:
    return len({k.split("/")[1] for k in v if re.match(rf"{side}/layer_\d+/", k)})


def _attention(
    out: dict[str, np.ndarray], v: dict[str, np.ndarray], src: str, dst: str, fused: str
) -> None:
    """Split CTranslate2's fused projections into MLX Whisper's query/key/value/out."""
    if fused == "qkv":
        w, b = v[f"{src}/linear_0/weight"], v[f"{src}/linear_0/bias"]
        parts_w, parts_b = np.split(w, 3, axis=0), np.split(b, 3)
        out_name = "linear_1"
    else:
        wkv, bkv = v[f"{src}/linear_1/weight"], v[f"{src}/linear_1/bias"]
        parts_w = [v[f"{src}/linear_0/weight"], *np.split(wkv, 2, axis=0)]
        parts_b = [v[f"{src}/linear_0/bias"], *np.split(bkv, 2)]
        out_name = "linear_2"
    for name, w, b in zip(("query", "key", "value"), parts_w, parts_b, strict=True):
        out[f"{dst}.{name}.weight"] = w
        if name != "key":
            out[f"{dst}.{name}.bias"] = b
    out[f"{dst}.out.weight"] = v[f"{src}/{out_name}/weight"]
    out[f"{dst}.out.bias"] = v[f"{src}/{out_name}/bias"]


def _norm(out: dict[str, np.ndarray], v: dict[str, np.ndarray], src: str, dst: str) -> None:
    out[f"{dst}.weight"] = v[f"{src}/gamma"]
    out[f"{dst}.bias"] = v[f"{src}/beta"]


def ct2_to_mlx_weights(v: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """MLX Whisper weights and ModelDimensions from CTranslate2 variables."""
    out: dict[str, np.ndarray] = {}
    for conv in ("conv1", "conv2"):
        # (out, in, kernel) -> MLX Conv1d's (out, kernel, in)
        out[f"encoder.{conv}.weight"] = v[f"encoder/{conv}/weight"].transpose(0, 2, 1)
        out[f"encoder.{conv}.bias"] = v[f"encoder/{conv}/bias"]
    n_audio_layer, n_text_layer = _layer_count(v, "encoder"), _layer_count(v, "decoder")
    for side, n, attn in (("encoder", n_audio_layer, False), ("decoder", n_text_layer, True)):
        for i in range(n):
            src, dst = f"{side}/layer_{i}", f"{side}.blocks.{i}"
            _attention(out, v, f"{src}/self_attention", f"{dst}.attn", "qkv")
            _norm(out, v, f"{src}/self_attention/layer_norm", f"{dst}.attn_ln")
            if attn:
                _attention(out, v, f"{src}/attention", f"{dst}.cross_attn", "q_kv")
                _norm(out, v, f"{src}/attention/layer_norm", f"{dst}.cross_attn_ln")
            for j, mlp in ((0, "mlp1"), (1, "mlp2")):
                out[f"{dst}.{mlp}.weight"] = v[f"{src}/ffn/linear_{j}/weight"]
                out[f"{dst}.{mlp}.bias"] = v[f"{src}/ffn/linear_{j}/bias"]
            _norm(out, v, f"{src}/ffn/layer_norm", f"{dst}.mlp_ln")
    _norm(out, v, "encoder/layer_norm", "encoder.ln_post")
    _norm(out, v, "decoder/layer_norm", "decoder.ln")
    out["decoder.token_embedding.weight"] = v["decoder/embeddings/weight"]
    out["decoder.positional_embedding"] = v["decoder/position_encodings/encodings"]
    # safetensors writes an array's memory: a transposed or split view must be made contiguous.
    out = {k: np.ascontiguousarray(a) for k, a in out.items()}
    n_vocab, n_text_state = out["decoder.token_embedding.weight"].shape
    n_audio_state = out["encoder.conv1.weight"].shape[0]
    dims = {
        "n_mels": int(out["encoder.conv1.weight"].shape[2]),
        "n_audio_ctx": int(v["encoder/position_encodings/encodings"].shape[0]),
        "n_audio_state": int(n_audio_state),
        "n_audio_head": int(v["encoder/num_heads"]),
        "n_audio_layer": n_audio_layer,
        "n_vocab": int(n_vocab),
        "n_text_ctx": int(out["decoder.positional_embedding"].shape[0]),
        "n_text_state": int(n_text_state),
        "n_text_head": int(v["decoder/num_heads"]),
        "n_text_layer": n_text_layer,
    }
    return out, dims


def add_timestamp_tokens(tokenizer: dict, n_vocab: int) -> dict:
    """Add Whisper's <|0.00|> .. <|30.00|> tokens after <|notimestamps|> when missing: without
    them timestamped decoding has no ids to emit."""
    added = tokenizer["added_tokens"]
    if any(t["content"] == "<|0.00|>" for t in added):
        return tokenizer
    notimestamps = next(t["id"] for t in added if t["content"] == "<|notimestamps|>")
    first = notimestamps + 1
    if first + _TIMESTAMPS != n_vocab:
        raise ValueError(f"timestamp tokens would end at {first + _TIMESTAMPS}, not {n_vocab}")
    for i in range(_TIMESTAMPS):
        added.append(
            {
                "id": first + i,
                "content": f"<|{i * 0.02:.2f}|>",
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    return tokenizer


def convert_ct2_whisper(src: Path, dst: Path) -> Path:
    """Write the MLX Whisper folder for the CTranslate2 model in `src`; returns `dst`."""
    import mlx.core as mx

    weights, dims = ct2_to_mlx_weights(read_ct2_model(src / "model.bin"))
    dst.mkdir(parents=True, exist_ok=True)
    ct2_config = json.loads((src / "config.json").read_text())
    config = {"model_type": "whisper", **dims}
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    # mlx-audio reads the cross-attention heads for word times from here.
    heads = ct2_config.get("alignment_heads")
    (dst / "generation_config.json").write_text(json.dumps({"alignment_heads": heads or []}))
    arrays = {k: mx.array(a) for k, a in weights.items()}
    mx.save_safetensors(str(dst / "weights.safetensors"), arrays)
    tok_src = src / "tokenizer.json"
    if tok_src.exists():
        tokenizer = add_timestamp_tokens(json.loads(tok_src.read_text()), dims["n_vocab"])
        (dst / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
        _write_processor(dst, dims["n_mels"])
    return dst


def _write_processor(dst: Path, n_mels: int) -> None:
    """The Hugging Face processor files (feature extractor and tokenizer config) that
    mlx-audio's Whisper loads its tokenizer through."""
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizerFast

    eot = "<|endoftext|>"
    tokenizer = WhisperTokenizerFast(
        tokenizer_file=str(dst / "tokenizer.json"),
        bos_token=eot,
        eos_token=eot,
        unk_token=eot,
        pad_token=eot,
    )
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    WhisperProcessor(feature_extractor=extractor, tokenizer=tokenizer).save_pretrained(str(dst))


def is_ct2_whisper(path: Path) -> bool:
    return (path / "model.bin").is_file() and (path / "config.json").is_file()


def ensure_mlx_whisper(path: Path, cache: Path) -> Path:
    """`path` itself when it is an MLX Whisper folder; for a CTranslate2 one, its converted
    copy under `cache` (made once, keyed by the model file's path, size and time)."""
    if not is_ct2_whisper(path):
        return path
    stat = (path / "model.bin").stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    dst = cache / f"whisper-ct2-{key.hexdigest()[:16]}"
    if (dst / "weights.safetensors").exists():
        return dst
    tmp = dst.with_name(dst.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    convert_ct2_whisper(path, tmp)
    try:
        tmp.rename(dst)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
