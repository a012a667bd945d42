"""Embedding and reranking models ready to run: which family, how they are loaded, and
their forward pass from a padded batch to vectors (embedders) or scores (rerankers).

- BERT-family encoders (``bert.py``) with the pooling their sentence-transformers files
  declare; as cross-encoders, ``*ForSequenceClassification`` with one label.
- Decoders through mlx-lm's own model classes: embedders pool the final hidden states
  (last token by default, as Qwen3-Embedding); rerankers are scored as Qwen3-Reranker is,
  by the probability of "yes" against "no" after a fixed judging prompt.

Everything here runs on the embedding worker's thread, except tokenizing (``inputs.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn

from pippin.embed.bert import ENCODER_TYPES, EncoderArgs, EncoderModel, SequenceClassifier
from pippin.embed.bert import map_weights as map_encoder_weights
from pippin.embed.inputs import Item, TextEncoder
from pippin.embed.pooling import last_token, pool
from pippin.embed.st_config import EmbedSpec, cross_encoder_activation, read_embed_spec
from pippin.store.loader import (
    ModelLoadError,
    cast_params,
    context_length,
    one_line,
    read_json,
    resolve_spec,
)

log = logging.getLogger(__name__)

Kind = Literal["embedding", "rerank"]
_UNSUPPORTED = {
    "modernbert": "ModernBERT",
    "nomic_bert": "NomicBERT",
    "new": "GTE 'new' (Alibaba-NLP)",
}

# Qwen3-Reranker's prompt (from its model card): the model answers "yes" or "no".
RERANK_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the "
    'Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
    "<|im_end|>\n<|im_start|>user\n"
)
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass
class LoadOptions:
    dtype: str | None = None
    trust_remote_code: bool = False
    revision: str | None = None
    truncate: bool = False
    # None: from config.json; () any width; else the widths allowed.
    matryoshka: tuple[int, ...] | None = None


class ServedModel:
    """Common to embedders and rerankers: the network, the tokenizer and the limits."""

    kind: Kind

    def __init__(
        self, net: nn.Module, text: TextEncoder, *, name: str, source: str, vocab_size: int
    ) -> None:
        self.net = net
        self.text = text
        self.name = name
        self.source = source
        self.vocab_size = vocab_size
        self.uses_type_ids = False
        self.pad_id = 0

    @property
    def max_len(self) -> int:
        return self.text.max_len

    def forward(self, ids: mx.array, type_ids: mx.array | None, lengths: mx.array) -> mx.array:
        raise NotImplementedError


class Embedder(ServedModel):
    kind: Kind = "embedding"

    def __init__(self, *args: Any, spec: EmbedSpec, dim: int, decoder: bool, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.spec = spec
        self.dim = dim
        self.decoder = decoder

    def forward(self, ids: mx.array, type_ids: mx.array | None, lengths: mx.array) -> mx.array:
        valid = mx.arange(ids.shape[1])[None] < lengths[:, None]
        if self.decoder:
            h = self.net.model(ids)  # right padding: causal attention never sees it
        else:
            h = self.net(ids, type_ids, valid)
        return pool(h, valid, lengths, self.spec.pooling)

    def items(
        self, inputs: list[str] | list[list[int]], truncate: bool | None = None
    ) -> list[Item]:
        """`truncate`: cut too-long inputs (None: the server's --auto-truncate)."""
        if inputs and isinstance(inputs[0], str):
            return self.text.texts(inputs, self.spec.default_prompt, truncate)  # type: ignore[arg-type]
        return self.text.ids(inputs, truncate)  # type: ignore[arg-type]


class Reranker(ServedModel):
    kind: Kind = "rerank"

    def pairs(self, query: str, docs: list[str], max_doc_tokens: int | None) -> list[Item]:
        raise NotImplementedError


class CrossEncoder(Reranker):
    def __init__(self, *args: Any, activation: str, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.activation = activation

    def forward(self, ids: mx.array, type_ids: mx.array | None, lengths: mx.array) -> mx.array:
        valid = mx.arange(ids.shape[1])[None] < lengths[:, None]
        logit = self.net(ids, type_ids, valid)[:, 0].astype(mx.float32)
        return mx.sigmoid(logit) if self.activation == "sigmoid" else logit

    def pairs(self, query: str, docs: list[str], max_doc_tokens: int | None) -> list[Item]:
        return self.text.pairs(query, docs, max_doc_tokens)


class YesNoReranker(Reranker):
    """A decoder judging relevance: P("yes") against P("no") after Qwen3-Reranker's prompt."""

    def __init__(self, *args: Any, yes: int, no: int, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.yes, self.no = yes, no
        self.prefix = self.text.encode(RERANK_PREFIX)
        self.suffix = self.text.encode(RERANK_SUFFIX)

    def forward(self, ids: mx.array, type_ids: mx.array | None, lengths: mx.array) -> mx.array:
        h = last_token(self.net.model(ids), lengths)
        lm_head = getattr(self.net, "lm_head", None)
        logits = lm_head(h) if lm_head is not None else self.net.model.embed_tokens.as_linear(h)
        two = logits[:, mx.array([self.no, self.yes])].astype(mx.float32)
        return mx.softmax(two, axis=-1)[:, 1]

    def pairs(self, query: str, docs: list[str], max_doc_tokens: int | None) -> list[Item]:
        middles = [
            f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {self.text.cut(d, max_doc_tokens)}"
            for d in docs
        ]
        return self.text.framed(self.prefix, middles, self.suffix)


# --- loading --------------------------------------------------------------------


def resolve_served(spec: str, kind: Kind, revision: str | None) -> tuple[Path, str, str]:
    """(folder, source, name) of an embedding or rerank model; ModelLoadError if there is
    none (`pippin serve` checks this before the server starts)."""
    path, source, name = resolve_spec(spec, revision)
    if not path.is_dir():
        raise ModelLoadError(f"{source}: {kind} models are loaded from a model folder")
    return path, source, name


def load_served_model(spec: str, kind: Kind, opts: LoadOptions) -> ServedModel:
    """Load ``spec`` (a folder or a Hub id) as an embedding or rerank model; anything it
    cannot serve exactly fails here, with a one-line ModelLoadError."""
    path, source, name = resolve_served(spec, kind, opts.revision)
    config = read_json(path / "config.json")
    model_type = str(config.get("model_type", ""))
    if model_type in _UNSUPPORTED:
        raise ModelLoadError(f"{source}: {_UNSUPPORTED[model_type]} models are not supported yet")
    try:
        tokenizer = _tokenizer(path, opts.trust_remote_code)
        if model_type in ENCODER_TYPES:
            model = _load_encoder(path, config, kind, tokenizer, opts, name, source)
        else:
            model = _load_decoder(path, config, kind, tokenizer, opts, name, source)
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, ImportError) as e:
        raise ModelLoadError(f"cannot load {source}: {one_line(e)}") from e
    log.info("loaded %s model %s (max %d tokens)", kind, name, model.max_len)
    return model


def _tokenizer(path: Path, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    if not getattr(hf, "is_fast", False):
        raise ModelLoadError("the model needs a fast (tokenizers) tokenizer")
    return hf


def _max_len(hf: Any, model_limit: int, spec_limit: int | None) -> int:
    """sentence-transformers' rule: max_seq_length if declared, else the smaller of the
    model's positions and the tokenizer's model_max_length; never above the positions."""
    if spec_limit:
        return min(spec_limit, model_limit)
    tok_limit = getattr(hf, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < model_limit:
        return tok_limit
    return model_limit


def _load_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path.name}: no .safetensors weights (convert the checkpoint)")
    weights: dict[str, mx.array] = {}
    for f in files:
        weights.update(mx.load(str(f)))
    return weights


def _load_encoder(
    path: Path,
    config: dict[str, Any],
    kind: Kind,
    hf: Any,
    opts: LoadOptions,
    name: str,
    source: str,
) -> ServedModel:
    args = EncoderArgs.from_config(config)
    weights = _load_weights(path)
    if kind == "embedding":
        spec = read_embed_spec(path, config, decoder=False)
        if opts.matryoshka is not None:
            spec.matryoshka = opts.matryoshka
        net: nn.Module = EncoderModel(args)
        net.load_weights(list(map_encoder_weights(weights, args, classifier=False).items()))
        cast_params(net, config, opts.dtype)
        mx.eval(net.parameters())
        text = TextEncoder(
            hf.backend_tokenizer, _max_len(hf, args.max_tokens, spec.max_seq_length), opts.truncate
        )
        dim = args.hidden_size * len(spec.pooling)
        common = {"name": name, "source": source, "vocab_size": args.vocab_size}
        model: ServedModel = Embedder(net, text, spec=spec, dim=dim, decoder=False, **common)
    else:
        archs = config.get("architectures") or []
        if not any(a.endswith("ForSequenceClassification") for a in archs):
            raise ModelLoadError(f"{source}: a cross-encoder must be *ForSequenceClassification")
        labels = config.get("id2label") or {}
        num_labels = int(config.get("num_labels") or len(labels) or 2)
        if num_labels != 1:
            raise ModelLoadError(
                f"{source}: cross-encoders with {num_labels} labels are not supported (need 1)"
            )
        activation = cross_encoder_activation(config)
        net = SequenceClassifier(args, num_labels)
        net.load_weights(list(map_encoder_weights(weights, args, classifier=True).items()))
        cast_params(net, config, opts.dtype)
        mx.eval(net.parameters())
        text = TextEncoder(hf.backend_tokenizer, _max_len(hf, args.max_tokens, None), opts.truncate)
        common = {"name": name, "source": source, "vocab_size": args.vocab_size}
        model = CrossEncoder(net, text, activation=activation, **common)
        # Token types only where the tokenizer gives them to the model, as transformers does.
        names = getattr(hf, "model_input_names", None) or []
        model.uses_type_ids = "token_type_ids" in names and args.type_vocab_size > 1
    model.pad_id = args.pad_token_id
    return model


def _decoder_classes(config: dict[str, Any]) -> tuple[type, type]:
    """mlx-lm's classes, reading checkpoints saved without the ``model.`` prefix too
    (Qwen3-Embedding is saved from the bare ``Qwen3Model``)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)

    class Model(model_class):  # type: ignore[misc, valid-type]
        def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
            if weights and not any(k.startswith("model.") for k in weights):
                weights = {f"model.{k}": v for k, v in weights.items()}
            parent = getattr(super(), "sanitize", None)
            return parent(weights) if parent is not None else weights

    return Model, args_class


def _load_decoder(
    path: Path,
    config: dict[str, Any],
    kind: Kind,
    hf: Any,
    opts: LoadOptions,
    name: str,
    source: str,
) -> ServedModel:
    from mlx_lm.utils import load_model as mlx_load_model

    archs = config.get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in archs):
        raise ModelLoadError(f"{source}: decoder sequence-classification heads are not supported")
    try:
        net, config = mlx_load_model(
            path,
            lazy=True,
            get_model_classes=_decoder_classes,
            trust_remote_code=opts.trust_remote_code,
        )
    except ValueError as e:
        if "not supported" in str(e):
            raise ModelLoadError(
                f"{source}: model type {config.get('model_type')!r} is neither a BERT-family "
                "encoder nor an mlx-lm decoder"
            ) from e
        raise
    if not hasattr(net, "model"):
        raise ModelLoadError(f"{source}: the mlx-lm model has no inner .model to read from")
    cast_params(net, config, opts.dtype)
    mx.eval(net.parameters())
    limit = context_length(config) or 32768
    vocab = int(config.get("vocab_size") or hf.backend_tokenizer.get_vocab_size())
    common = {"name": name, "source": source, "vocab_size": vocab}
    if kind == "embedding":
        spec = read_embed_spec(path, config, decoder=True)
        if opts.matryoshka is not None:
            spec.matryoshka = opts.matryoshka
        text = TextEncoder(
            hf.backend_tokenizer, _max_len(hf, limit, spec.max_seq_length), opts.truncate
        )
        dim = int(config["hidden_size"]) * len(spec.pooling)
        return Embedder(net, text, spec=spec, dim=dim, decoder=True, **common)
    text = TextEncoder(hf.backend_tokenizer, _max_len(hf, limit, None), opts.truncate)
    yes, no = text.token_id("yes"), text.token_id("no")
    if yes is None or no is None:
        raise ModelLoadError(
            f"{source}: a decoder reranker needs single 'yes' and 'no' tokens "
            "(Qwen3-Reranker style)"
        )
    return YesNoReranker(net, text, yes=yes, no=no, **common)
