"""Hidden states ``[B, L, H]`` -> one vector per row, as sentence-transformers' Pooling
module computes it. Rows are right-padded; ``valid`` marks the real tokens."""

from __future__ import annotations

import mlx.core as mx


def pool(h: mx.array, valid: mx.array, lengths: mx.array, modes: tuple[str, ...]) -> mx.array:
    """Concatenates the modes in the order given (sentence-transformers' order)."""
    h = h.astype(mx.float32)
    m = valid[..., None].astype(h.dtype)
    count = mx.maximum(m.sum(axis=1), 1e-9)
    parts = []
    for mode in modes:
        if mode == "cls":
            parts.append(h[:, 0])
        elif mode == "mean":
            parts.append((h * m).sum(axis=1) / count)
        elif mode == "mean_sqrt_len":
            parts.append((h * m).sum(axis=1) / mx.sqrt(count))
        elif mode == "max":
            parts.append(mx.where(m > 0, h, mx.array(-1e9, h.dtype)).max(axis=1))
        elif mode == "weightedmean":
            w = m * (mx.arange(1, h.shape[1] + 1, dtype=h.dtype)[None, :, None])
            parts.append((h * w).sum(axis=1) / mx.maximum(w.sum(axis=1), 1e-9))
        elif mode == "lasttoken":
            parts.append(last_token(h, lengths))
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=-1)


def last_token(h: mx.array, lengths: mx.array) -> mx.array:
    """Each row's hidden state at its last real token."""
    return h[mx.arange(h.shape[0]), lengths - 1]
