"""A tiny random Whisper: the model pippin loads (mlx-audio's Whisper through
`load_whisper`) and transformers' WhisperForConditionalGeneration on the same weights
give the same logits and the same greedy tokens for the same audio, through the decode
that pippin's transcription runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the reference needs torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("mlx_audio", reason="mlx-audio is in the 'audio' extra")

import mlx.core as mx  # noqa: E402

from pippin.audio.whisper_model import load_whisper  # noqa: E402

STEPS = 16


@pytest.fixture(scope="module")
def tiny_random(tmp_path_factory: pytest.TempPathFactory, tiny_en: Path) -> tuple[Path, object]:
    """A 2-layer, 64-wide Whisper with random weights in Hugging Face's layout, with the
    real tiny.en tokenizer (same vocabulary)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    torch.manual_seed(0)
    config = WhisperConfig(
        vocab_size=51864,
        num_mel_bins=80,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        max_source_positions=1500,
        max_target_positions=448,
    )
    model = WhisperForConditionalGeneration(config).eval()
    with torch.no_grad():  # wider weights: clear argmax margins between the two arithmetics
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.2)
        # The encoder's positions are fixed sinusoids in Whisper (mlx-audio computes them).
        n, dim = 1500, 64
        inc = np.log(10000) / (dim // 2 - 1)
        t = np.arange(n)[:, None] * np.exp(-inc * np.arange(dim // 2))[None]
        sinus = np.concatenate([np.sin(t), np.cos(t)], axis=1)
        model.model.encoder.embed_positions.weight.copy_(torch.tensor(sinus))
    path = tmp_path_factory.mktemp("tiny_random_whisper")
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "processor_config.json"):
        if (tiny_en / name).exists():
            shutil.copy(tiny_en / name, path / name)
    (path / "generation_config.json").write_text(json.dumps({"alignment_heads": [[1, 0]]}))
    return path, model


def _mel() -> np.ndarray:
    """Log-mel features (3000 frames, 80 bins) of 4 s of a chirp in noise, 30 s padded."""
    from mlx_audio.stt.models.whisper.audio import log_mel_spectrogram, pad_or_trim

    rng = np.random.default_rng(0)
    t = np.arange(64_000) / 16_000
    audio = 0.3 * np.sin(2 * np.pi * (200 + 300 * t) * t) + 0.05 * rng.standard_normal(t.size)
    mel = log_mel_spectrogram(mx.array(audio.astype(np.float32)), n_mels=80)
    return np.array(pad_or_trim(mel, 3000, axis=-2))


def test_logits_and_greedy_tokens_match_transformers(
    tiny_random: tuple[Path, object], tmp_path: Path
) -> None:
    from mlx_audio.stt.models.whisper.decoding import DecodingOptions

    path, ref = tiny_random
    ours = load_whisper(path, tmp_path)
    tokenizer = ours.get_tokenizer(language="en")
    prefix = list(tokenizer.sot_sequence_including_notimestamps)
    mel = _mel()

    features = torch.tensor(mel.T[None])  # (1, 80, 3000)
    ids = torch.tensor([prefix])
    with torch.no_grad():
        ref_logits = ref(input_features=features, decoder_input_ids=ids).logits[0].numpy()
    our_logits = np.array(ours(mx.array(mel[None]), mx.array([prefix]))[0])
    np.testing.assert_allclose(our_logits, ref_logits, atol=2e-3, rtol=1e-3)

    # The reference: transformers' forward pass, greedy, until end of text.
    tokens = list(prefix)
    with torch.no_grad():
        for _ in range(STEPS):
            logits = ref(input_features=features, decoder_input_ids=torch.tensor([tokens])).logits
            tokens.append(int(logits[0, -1].argmax()))
            if tokens[-1] == tokenizer.eot:
                break
    expected = [t for t in tokens[len(prefix) :] if t != tokenizer.eot]

    # pippin: mlx-audio's decode (what transcription runs), without its suppressions.
    options = DecodingOptions(
        language="en",
        without_timestamps=True,
        temperature=0.0,
        sample_len=STEPS,
        suppress_tokens=[],
        suppress_blank=False,
        fp16=False,
    )
    result = ours.decode(mx.array(mel), options)
    assert result.tokens == expected
    assert len(expected) >= 4  # a real sequence, not an immediate end of text
