"""Tiny random-weight rerankers for the embedding/rerank tests, built at test time.

- ``build_cross_encoder(dest, "bert" | "xlm-roberta")``: a ``*ForSequenceClassification``
  with one label, made by ``transformers`` from a seeded random init and saved as
  safetensors, with a WordPiece (BERT) or byte-level BPE (XLM-RoBERTa, ``<s>``/``</s>``
  pair template) tokenizer trained on the standard library's sources.
- ``build_yes_no_reranker(dest, qwen3_dir)``: the tiny Qwen3 of ``tiny_models`` with
  single "yes" and "no" tokens added (and two more embedding rows), as Qwen3-Reranker has.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from .tiny_models import corpus

_ENCODER = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "num_labels": 1,
    # Wider than the usual 0.02, so outputs differ visibly between inputs.
    "initializer_range": 0.3,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def _bert_tokenizer(dest: Path) -> int:
    from tokenizers import BertWordPieceTokenizer

    tok = BertWordPieceTokenizer(lowercase=True)
    tok.train_from_iterator(corpus(), vocab_size=600, show_progress=False)
    tok.save(str(dest / "tokenizer.json"))
    return tok.get_vocab_size()


def _roberta_tokenizer(dest: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<s>", "<pad>", "</s>", "<unk>"]  # XLM-R's ids 0-3
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok.save(str(dest / "tokenizer.json"))
    return tok.get_vocab_size()


def build_cross_encoder(dest: Path, family: str, seed: int = 0) -> Path:
    import torch
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        XLMRobertaConfig,
        XLMRobertaForSequenceClassification,
    )

    dest.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if family == "bert":
        vocab = _bert_tokenizer(dest)
        config = BertConfig(vocab_size=vocab, pad_token_id=0, **_ENCODER)
        model = BertForSequenceClassification(config)
        specials = {
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        }
    else:
        vocab = _roberta_tokenizer(dest)
        config = XLMRobertaConfig(
            vocab_size=vocab, pad_token_id=1, bos_token_id=0, eos_token_id=2, type_vocab_size=1,
            **{**_ENCODER, "max_position_embeddings": 130},
        )  # fmt: skip
        model = XLMRobertaForSequenceClassification(config)
        specials = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    model.eval()
    model.save_pretrained(str(dest), safe_serialization=True)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 128,
        **specials,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return dest


def build_yes_no_reranker(dest: Path, qwen3_dir: Path, seed: int = 0) -> Path:
    import mlx.core as mx
    from tokenizers import Tokenizer

    shutil.copytree(qwen3_dir, dest)
    tok = Tokenizer.from_file(str(dest / "tokenizer.json"))
    tok.add_tokens(["yes", "no"])
    tok.save(str(dest / "tokenizer.json"))
    config = json.loads((dest / "config.json").read_text())
    weights = dict(mx.load(str(dest / "model.safetensors")))
    emb = np.array(weights["model.embed_tokens.weight"])
    extra = np.random.default_rng(seed).standard_normal((2, emb.shape[1])).astype(np.float32)
    emb = np.concatenate([emb, 0.1 * extra])
    weights["model.embed_tokens.weight"] = mx.array(emb)
    config["vocab_size"] = emb.shape[0]
    mx.save_safetensors(str(dest / "model.safetensors"), weights, metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest
