"""What KV computed by one process can be trusted by another: the model's fingerprint.

Two processes may share KV blocks only if the same tokens give the same KV. That depends
on the weights, the dtype and the KV layout (block size, layer shapes, quantisation), so
the fingerprint hashes all of them. Hashing every weight of a large model would take
minutes; instead each parameter contributes its name, shape, dtype and a strided sample
of its values (a fine-tune or a changed quantisation changes the samples). Recurrent-state
snapshots on disk have one of their own (`state_fingerprint`): this one plus their layout.
"""

from __future__ import annotations

import hashlib
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

from pippin.runner.paged_cache import LayerSpec

# Bump when the block file payload layout changes.
KV_FORMAT_VERSION = 1
SAMPLES_PER_PARAM = 256

_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def raw_view(a: mx.array) -> mx.array:
    """The same bytes as an unsigned integer array (numpy has no bfloat16)."""
    return a if a.dtype == _UINT[a.dtype.size] else a.view(_UINT[a.dtype.size])


def raw_dtype(dtype: mx.Dtype) -> np.dtype:
    """The numpy dtype `raw_view`'s bytes read as."""
    return np.dtype(f"<u{dtype.size}")


def from_raw(a: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """The inverse of `raw_view` (through numpy): those bytes as an array of `dtype`."""
    out = mx.array(a)
    return out if out.dtype == dtype else out.view(dtype)


def weights_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    params = sorted(tree_flatten(model.parameters()), key=lambda kv: kv[0])
    samples = []
    for name, p in params:
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype}".encode())
        flat = p.reshape(-1)
        step = max(flat.size // SAMPLES_PER_PARAM, 1)
        samples.append(raw_view(flat[::step][:SAMPLES_PER_PARAM]))
    mx.eval(samples)
    for s in samples:
        h.update(np.array(s).tobytes())
    return h.hexdigest()


def kv_fingerprint(
    model: nn.Module, config: dict, specs: dict[int, LayerSpec], block_size: int
) -> str:
    layout = {
        "version": KV_FORMAT_VERSION,
        "block_size": block_size,
        "layers": {
            str(i): [s.n_kv_heads, s.k_dim, s.v_dim, str(s.dtype), s.bits, s.group_size]
            for i, s in sorted(specs.items())
        },
        "config": config,
        "weights": weights_digest(model),
    }
    text = json.dumps(layout, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def state_fingerprint(kv_fp: str, layout: list[tuple[int, int, tuple[int, ...], mx.Dtype]]) -> str:
    """The fingerprint of a model's recurrent-state snapshots: its KV fingerprint (weights,
    config, block size) plus every state array's (layer, index, shape, dtype)."""
    text = json.dumps(
        {"kind": "state", "kv": kv_fp, "layout": [[i, j, list(s), str(d)] for i, j, s, d in layout]}
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]
