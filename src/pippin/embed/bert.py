"""BERT-family encoders in MLX: BERT, RoBERTa, XLM-RoBERTa (and CamemBERT, which is
XLM-RoBERTa), as bare encoders for embeddings and with the sequence-classification heads
cross-encoders use.

Module and parameter names mirror the Hugging Face checkpoints, so weights load by name
(``embeddings.word_embeddings.weight``, ``encoder.layer.0.attention.self.query.weight``...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert")
_ROBERTA_LIKE = ("roberta", "xlm-roberta", "camembert")
_ACTIVATIONS = {
    "gelu": nn.gelu,
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "relu": nn.relu,
    "silu": nn.silu,
    "swish": nn.silu,
}


@dataclass
class EncoderArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> EncoderArgs:
        if config.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"position_embedding_type {config['position_embedding_type']!r} is not supported"
            )
        if config.get("hidden_act", "gelu") not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported")
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    @property
    def roberta_like(self) -> bool:
        return self.model_type in _ROBERTA_LIKE

    @property
    def max_tokens(self) -> int:
        """Longest input: RoBERTa's positions start after the padding index."""
        if self.roberta_like:
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings


class Embeddings(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.position_embeddings = nn.Embedding(a.max_position_embeddings, a.hidden_size)
        self.token_type_embeddings = nn.Embedding(a.type_vocab_size, a.hidden_size)
        self.LayerNorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        # RoBERTa numbers positions from pad_token_id + 1 (padding itself sits at pad_token_id).
        self._offset = a.pad_token_id + 1 if a.roberta_like else 0

    def __call__(self, ids: mx.array, type_ids: mx.array | None) -> mx.array:
        positions = mx.arange(ids.shape[1]) + self._offset
        h = self.word_embeddings(ids) + self.position_embeddings(positions)[None]
        if type_ids is None:
            h = h + self.token_type_embeddings.weight[0]
        else:
            h = h + self.token_type_embeddings(type_ids)
        return self.LayerNorm(h)


class SelfAttention(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.heads = a.num_attention_heads
        self.query = nn.Linear(a.hidden_size, a.hidden_size)
        self.key = nn.Linear(a.hidden_size, a.hidden_size)
        self.value = nn.Linear(a.hidden_size, a.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape
        split = lambda t: t.reshape(b, n, self.heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        scale = 1.0 / math.sqrt(d // self.heads)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(b, n, d)


class DenseNorm(nn.Module):
    """``dense`` then ``LayerNorm(x + residual)``: BERT's attention and FFN outputs."""

    def __init__(self, d_in: int, a: EncoderArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(d_in, a.hidden_size)
        self.LayerNorm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.self = SelfAttention(a)  # the checkpoint's name: attention.self.*
        self.output = DenseNorm(a.hidden_size, a)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.intermediate_size)
        self._act = _ACTIVATIONS[a.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self._act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.attention = Attention(a)
        self.intermediate = Intermediate(a)
        self.output = DenseNorm(a.intermediate_size, a)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        h = self.attention(x, mask)
        return self.output(self.intermediate(h), h)


class Encoder(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.layer = [Layer(a) for _ in range(a.num_hidden_layers)]


class Pooler(nn.Module):
    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.hidden_size)

    def __call__(self, h: mx.array) -> mx.array:
        return mx.tanh(self.dense(h[:, 0]))


class EncoderModel(nn.Module):
    """The bare encoder (``BertModel`` / ``XLMRobertaModel`` without the pooler)."""

    def __init__(self, a: EncoderArgs) -> None:
        super().__init__()
        self.args = a
        self.embeddings = Embeddings(a)
        self.encoder = Encoder(a)

    def __call__(self, ids: mx.array, type_ids: mx.array | None, valid: mx.array) -> mx.array:
        """Hidden states ``[B, L, H]``; ``valid`` is the ``[B, L]`` padding mask."""
        h = self.embeddings(ids, type_ids)
        neg = mx.array(mx.finfo(h.dtype).min, h.dtype)
        mask = mx.where(valid[:, None, None, :], mx.array(0, h.dtype), neg)
        for layer in self.encoder.layer:
            h = layer(h, mask)
        return h


class RobertaHead(nn.Module):
    def __init__(self, a: EncoderArgs, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(a.hidden_size, a.hidden_size)
        self.out_proj = nn.Linear(a.hidden_size, num_labels)

    def __call__(self, h: mx.array) -> mx.array:
        return self.out_proj(mx.tanh(self.dense(h[:, 0])))


class SequenceClassifier(nn.Module):
    """``BertForSequenceClassification`` (pooler + linear) or the RoBERTa family's
    (``classifier.dense`` + ``classifier.out_proj`` on the first token). Returns logits."""

    def __init__(self, a: EncoderArgs, num_labels: int) -> None:
        super().__init__()
        self.base = EncoderModel(a)
        if a.roberta_like:
            self.classifier: nn.Module = RobertaHead(a, num_labels)
        else:
            self.pooler = Pooler(a)
            self.classifier = nn.Linear(a.hidden_size, num_labels)

    def __call__(self, ids: mx.array, type_ids: mx.array | None, valid: mx.array) -> mx.array:
        h = self.base(ids, type_ids, valid)
        if self.base.args.roberta_like:
            return self.classifier(h)
        return self.classifier(self.pooler(h))


def map_weights(
    weights: dict[str, mx.array], a: EncoderArgs, *, classifier: bool
) -> dict[str, mx.array]:
    """Checkpoint names -> this module's: drops the ``bert.``/``roberta.`` prefix (kept
    as ``base.`` for classifiers), old ``gamma``/``beta`` names and unused buffers."""
    prefixes = ("bert.", "roberta.", "xlm_roberta.", "camembert.", "model.")
    out: dict[str, mx.array] = {}
    for name, w in weights.items():
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight")
        name = name.replace("LayerNorm.beta", "LayerNorm.bias")
        for p in prefixes:
            if name.startswith(p):
                name = name[len(p) :]
                break
        if name.endswith("position_ids") or name.startswith(("lm_head.", "cls.")):
            continue
        if name.startswith("pooler."):
            if not classifier or a.roberta_like:
                continue
            out[name] = w
            continue
        if name.startswith("classifier."):
            if classifier:
                out[name] = w
            continue
        out[f"base.{name}" if classifier else name] = w
    return out
