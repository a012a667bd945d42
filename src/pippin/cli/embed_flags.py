"""`pippin serve`'s embedding and reranking flags and the `EmbedSettings` they give."""

from __future__ import annotations

import argparse

from pippin.argtypes import positive_int
from pippin.embed.config import EmbedSettings


def _matryoshka(text: str) -> tuple[int, ...]:
    if text.strip().lower() == "any":
        return ()
    try:
        dims = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError("must be 'any' or a comma-separated list") from None
    if not dims or dims[0] < 1:
        raise argparse.ArgumentTypeError("widths must be positive integers")
    return dims


def add_embed_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "embedding and reranking",
        "optional models served beside the chat model on /v1/embeddings and /v1/rerank",
    )
    g.add_argument(
        "--embedding-model",
        metavar="MODEL",
        help="embedding model for /v1/embeddings: a folder or Hub id of a BERT-family "
        "encoder (BERT, RoBERTa, XLM-RoBERTa) or an mlx-lm decoder (e.g. Qwen3-Embedding); "
        "pooling and normalisation come from its sentence-transformers files",
    )
    g.add_argument(
        "--embedding-served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) of the embedding model in the 'model' field; default: its folder name",
    )
    g.add_argument(
        "--rerank-model",
        metavar="MODEL",
        help="rerank model for /v1/rerank, /v2/rerank and /rerank: a BERT or XLM-RoBERTa "
        "cross-encoder (*ForSequenceClassification, one label) or a Qwen3-Reranker-style "
        "decoder (scored by its 'yes'/'no' logits)",
    )
    g.add_argument(
        "--rerank-served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) of the rerank model in the 'model' field; default: its folder name",
    )
    g.add_argument(
        "--auto-truncate",
        action="store_true",
        help="cut embedding and rerank inputs longer than the model takes (as "
        "sentence-transformers does); without it they are refused with a 400",
    )
    g.add_argument(
        "--matryoshka-dimensions",
        type=_matryoshka,
        metavar="DIMS",
        help="widths the embedding model may be shortened to with 'dimensions': 'any' or "
        "a list like 64,128,256; default: config.json's matryoshka_dimensions or "
        "is_matryoshka, else 'dimensions' is refused",
    )
    g.add_argument(
        "--embedding-batch-tokens",
        type=positive_int,
        metavar="N",
        default=EmbedSettings.max_batch_tokens,
        help="padded tokens in one embedding/rerank forward pass; bounds how long one "
        "pass holds the device (default: %(default)s)",
    )
    g.add_argument(
        "--embedding-batch-size",
        type=positive_int,
        metavar="N",
        default=EmbedSettings.max_batch_size,
        help="most inputs in one embedding/rerank forward pass (default: %(default)s)",
    )


def embed_settings(args: argparse.Namespace) -> EmbedSettings:
    return EmbedSettings(
        embedding_model=args.embedding_model,
        embedding_names=list(args.embedding_served_model_name or []),
        rerank_model=args.rerank_model,
        rerank_names=list(args.rerank_served_model_name or []),
        auto_truncate=args.auto_truncate,
        matryoshka=args.matryoshka_dimensions,
        max_batch_tokens=args.embedding_batch_tokens,
        max_batch_size=args.embedding_batch_size,
    )
