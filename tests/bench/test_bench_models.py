"""The benchmarks' random-weight models: the Llama shapes carry the real Llama 3 tokenizer,
and `-4bit`/`-8bit` builds are quantised as mlx-community ships models."""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
import pytest
from mlx_lm.utils import load
from tiny_models import tiny_config

from pippin.bench import models
from pippin.bench.workload import load_workload, words_per_token

# The 8B's configuration at the tests' tiny sizes (the Llama 3 vocabulary kept).
_SIZES = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_TINY = tiny_config("llama", vocab_size=128256, eos_token_id=128009, pad_token_id=128004)
TINY_LLAMA = {
    **models.CONFIGS["llama-3.1-8b"],
    **{k: _TINY[k] for k in (*_SIZES, "num_key_value_heads", "head_dim")},
}


@pytest.fixture
def tiny_llama(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(models.CONFIGS, "tiny-llama", TINY_LLAMA)
    return "tiny-llama"


@pytest.mark.parametrize("bits", [4, 8])
def test_quantised_llama_with_the_real_tokenizer(
    tiny_llama: str, tmp_path: Path, bits: int
) -> None:
    path = models.build_model(f"{tiny_llama}-{bits}bit", tmp_path)
    model, tokenizer = load(str(path))
    quantised = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    # Every projection and the LM head, at group size 64.
    assert len(quantised) == 2 * 7 + 1
    assert {(m.group_size, m.bits, m.mode) for m in quantised} == {(64, bits, "affine")}
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert len(tokenizer._tokenizer.get_vocab()) == 128256
    messages = [{"role": "user", "content": "Hello"}]
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    text = tokenizer.decode(ids)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello")
    assert text.endswith("<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert ids[0] == 128000 and 128009 in ids
    assert {128001, 128009} <= set(tokenizer.eos_token_ids)
    # Built once: a second call reuses the folder.
    assert models.build_model(f"{tiny_llama}-{bits}bit", tmp_path) == path


def test_unknown_quantisation_is_refused() -> None:
    with pytest.raises(ValueError, match="-4bit or -8bit"):
        models.build_model("llama-3.1-8b-3bit")


def test_real_tokenizer_workload() -> None:
    w = load_workload("real-tokenizer")
    assert (w.tokenizer, w.prompt_tokens.args, w.output_tokens.args) == ("llama3", (512,), (256,))
    assert "llama3 tokens" in w.describe()
    assert load_workload("long-context").prompt_tokens.args == (16384,)
    # Common English words are about a Llama 3 token each (the small BPE's differ).
    assert 0.8 < words_per_token("llama3") <= 1.2
