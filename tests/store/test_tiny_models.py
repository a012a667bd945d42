"""The tiny random models: they load, decode sensibly, and match transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache
from mlx_lm.utils import load, load_tokenizer
from support.tiny_models import ARCHS, EOS_TOKEN, SPECIAL_TOKENS, build_tiny_model, gpt_oss_hf_state

TinyModelFactory = Callable[..., Path]

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return",
)
# Longer than gemma3's sliding window (8), so the window is crossed in prefill and decode.
CHAT = [
    {"role": "system", "content": "You are brief."},
    {"role": "user", "content": "Write one line about the sea, then stop."},
]
N_TOKENS = 20


def _greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and their full log-prob vectors through mlx-lm's cached decode path."""
    tokens: list[int] = []
    logprobs: list[np.ndarray] = []
    for (token, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        tokens.append(int(token))
        logprobs.append(np.array(lp))
    return tokens, logprobs


def test_tokenizer_loads_in_transformers_and_mlx_lm(tiny_models: TinyModelFactory) -> None:
    from transformers import AutoTokenizer

    path = tiny_models("llama")
    hf = AutoTokenizer.from_pretrained(path)
    wrapped = load_tokenizer(path)

    assert 512 <= len(hf) <= 1024
    ids = {t: hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert sorted(ids.values()) == [0, 1, 2]
    assert hf.eos_token == EOS_TOKEN
    assert wrapped.eos_token_ids == {ids[EOS_TOKEN]}
    # The byte-level decoder is what makes mlx-lm pick its BPE streaming detokenizer.
    assert type(wrapped.detokenizer).__name__ == "BPEStreamingDetokenizer"

    text = "héllo wörld 你好 🙂\n\tdef f(x): return x"
    assert hf.decode(hf.encode(text)) == text
    assert wrapped.decode(wrapped.encode(text)) == text

    rendered = hf.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are brief.<|im_end|>\n"
        "<|im_start|>user\nWrite one line about the sea, then stop.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    chat_ids = wrapped.apply_chat_template(CHAT, add_generation_prompt=True)
    assert chat_ids[0] == ids["<|im_start|>"]
    assert chat_ids.count(ids[EOS_TOKEN]) == 2


def test_loads_and_decodes_sensibly(tiny_models: TinyModelFactory, tiny_arch: str) -> None:
    path = tiny_models(tiny_arch)
    model, tokenizer = load(str(path))
    assert tokenizer.eos_token_ids == {tokenizer.convert_tokens_to_ids(EOS_TOKEN)}

    runs = [_greedy(model, tokenizer.encode(p), N_TOKENS)[0] for p in PROMPTS]
    chat = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    runs.append(_greedy(model, chat, N_TOKENS)[0])

    assert len({tuple(r) for r in runs}) == len(runs), runs
    for run in runs:
        # Random weights cycle sooner or later; what must not happen is a model that maps
        # everything to one token, which would hide bugs in caches and samplers.
        assert len(set(run)) >= 4, run
        assert all(0 <= t < model.args.vocab_size for t in run)


def test_cache_layer_types(tiny_models: TinyModelFactory) -> None:
    """The hybrid archs really build their sliding-window and recurrent cache layers."""
    gemma, _ = load(str(tiny_models("gemma3")))
    kinds = [type(c) for c in gemma.make_cache()]
    assert kinds == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]
    assert gemma.make_cache()[0].max_size == 8

    nxt, _ = load(str(tiny_models("qwen3_next")))
    kinds = [type(c) for c in nxt.make_cache()]
    assert kinds == [ArraysCache, ArraysCache, ArraysCache, KVCache]

    oss, _ = load(str(tiny_models("gpt_oss")))
    kinds = [type(c) for c in oss.make_cache()]
    assert kinds == [RotatingKVCache, KVCache, RotatingKVCache, KVCache]
    assert oss.make_cache()[0].max_size == 8


def test_gemma3_sliding_window_changes_logits(tiny_models: TinyModelFactory) -> None:
    """Same weights with the window widened: equal logits inside the window, not past it."""
    windowed, tok = load(str(tiny_models("gemma3")))
    wide, _ = load(str(tiny_models("gemma3", sliding_window=4096)))
    ids = mx.array(tok.apply_chat_template(CHAT, add_generation_prompt=True))[None]
    a = np.array(windowed(ids)[0])
    b = np.array(wide(ids)[0])
    np.testing.assert_allclose(a[:8], b[:8], atol=1e-4)
    assert np.abs(a[8:] - b[8:]).max() > 1e-2


def test_builds_are_deterministic_and_memoised(
    tiny_models: TinyModelFactory, tmp_path: Path
) -> None:
    a = build_tiny_model("qwen3", tmp_path / "a", seed=0)
    b = build_tiny_model("qwen3", tmp_path / "b", seed=0)
    c = build_tiny_model("qwen3", tmp_path / "c", seed=1)
    blob = (a / "model.safetensors").read_bytes()
    assert blob == (b / "model.safetensors").read_bytes()
    assert blob != (c / "model.safetensors").read_bytes()

    assert tiny_models("qwen3") == tiny_models("qwen3")
    assert tiny_models("qwen3", num_hidden_layers=3) != tiny_models("qwen3")
    model, _ = load(str(tiny_models("qwen3", num_hidden_layers=3)))
    assert len(model.layers) == 3


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers(tiny_models: TinyModelFactory, arch: str) -> None:
    """Logits of mlx-lm (full prefill, and cached decode) equal transformers' on the weights."""
    torch = pytest.importorskip(
        "torch", reason="torch is needed for the reference: pip install torch==2.13.0"
    )
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    path = tiny_models(arch)
    model, tokenizer = load(str(path))
    prompt = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    generated, logprobs = _greedy(model, prompt, N_TOKENS)
    full = prompt + generated

    if arch == "gpt_oss":
        # The file is in mlx-lm's layout (see support.tiny_models._to_hf_layout): transformers gets
        # the same arrays in its own.
        from transformers import AutoConfig

        ref_model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(path), dtype=torch.float32
        ).eval()
        state = gpt_oss_hf_state(
            {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}
        )
        ref_model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True)
    else:
        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = ref_model(torch.tensor([full])).logits[0].float()
    ref_logprobs = torch.log_softmax(ref, dim=-1).numpy()
    ref = ref.numpy()

    ours = np.array(model(mx.array(full)[None])[0])
    # Logits have a spread of about 3; float32 reference differences are ~1e-4.
    np.testing.assert_allclose(ours, ref, atol=2e-3, rtol=0)
    # Each decoded step (through mlx-lm's caches: rotating for gemma3's window, recurrent
    # state for qwen3_next) predicts what the reference predicts at that position.
    start = len(prompt) - 1
    np.testing.assert_allclose(
        np.stack(logprobs), ref_logprobs[start : start + N_TOKENS], atol=2e-3, rtol=0
    )
    assert generated == ref[start : start + N_TOKENS].argmax(-1).tolist()
