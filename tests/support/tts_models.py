"""A tiny random-weight KittenTTS model built with mlx-audio's own classes.

KittenTTS rather than Kokoro for the tests: its text front end is espeak-ng through
``phonemizer`` (offline, English), its voices are a local ``voices.npz``, and its decoder's
widths are configurable, so a model runs in about a second on CPU. Kokoro's English G2P
(misaki) needs a spaCy model that no reachable registry ships, and its decoder has fixed
1024-channel layers (58M parameters even when everything else is tiny: minutes per sentence
on a shared CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

VOICES = ("expr-voice-2-f", "expr-voice-5-m")
CONFIG = {
    "model_type": "kitten_tts",
    "hidden_dim": 16,
    "max_conv_dim": 16,
    "max_dur": 10,
    "n_layer": 1,
    "n_mels": 80,
    "n_token": 178,
    "style_dim": 128,  # fixed: voices are 256 wide, split at 128
    "text_encoder_kernel_size": 3,
    "asr_res_dim": 8,
    "decoder_out_dim": 16,
    "plbert": {
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "hidden_size": 16,
        "intermediate_size": 32,
        "max_position_embeddings": 512,
        "embedding_size": 16,
    },
    "istftnet": {
        "resblock_kernel_sizes": [3],
        "upsample_rates": [10, 6],
        "upsample_initial_channel": 16,
        "resblock_dilation_sizes": [[1, 3, 5]],
        "upsample_kernel_sizes": [20, 12],
        "gen_istft_n_fft": 20,
        "gen_istft_hop_size": 5,
    },
}


def build_kitten(path: Path, seed: int = 0, *, deterministic: bool = False) -> Path:
    """The model in ``path``. Its generator mixes in random noise (as the real one does), so
    two runs agree only under the same MLX seed; ``deterministic`` zeroes the generator's
    last conv, which makes the audio a function of the predicted durations alone (for the
    tests over HTTP, where the server's seed is not the test's)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.tts.models.kitten_tts.kitten_tts import Model, ModelConfig

    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(CONFIG))
    weights = dict(tree_flatten(model.parameters()))
    for k in weights:
        # The generator's last conv feeds exp(): random weights would overflow it to inf.
        if "conv_post" in k:
            weights[k] = weights[k] * (0.0 if deterministic and k.endswith("weight_g") else 1e-3)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(CONFIG))
    rng = np.random.default_rng(seed)
    voices = {v: (rng.normal(size=(400, 256)) * 0.1).astype(np.float32) for v in VOICES}
    np.savez(path / "voices.npz", **voices)
    return path


# Kokoro's phoneme vocabulary: punctuation, letters and the IPA espeak-ng writes.
_KOKORO_SYMBOLS = (
    ';:,.!?¡¿—…"«»“” abcdefghijklmnopqrstuvwxyz'
    "ɑɐɒæβɔɕçðʤəɚɛɜɟɡɦɪʝɭɬʎʟɱɯɰŋɲɴøɵθœɹɾɻʁʃʈʧʊʋʌɣχʒʔˈˌːʰʲ↓↑→↗↘ᵻ"
)
KOKORO_VOICES = ("ef_dora", "ff_siwis")


def build_kokoro(path: Path, seed: int = 0) -> Path:
    """A random Kokoro with small text layers. Its decoder's widths are fixed (1024
    channels), so it stays at 58M parameters; ``max_dur`` 1 gives each phoneme one frame,
    which keeps a sentence to seconds on CPU. Voices are Spanish and French: their G2P is
    misaki's espeak-ng one, which runs offline (English needs a spaCy model)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_audio.tts.models.base import check_array_shape
    from mlx_audio.tts.models.kokoro import Model, ModelConfig

    vocab: dict[str, int] = {}
    for ch in _KOKORO_SYMBOLS:
        vocab.setdefault(ch, len(vocab) + 1)
    config = {
        "model_type": "kokoro",
        "istftnet": {
            "upsample_kernel_sizes": [20, 12],
            "upsample_rates": [10, 6],
            "gen_istft_hop_size": 5,
            "gen_istft_n_fft": 20,
            "resblock_dilation_sizes": [[1, 3, 5]],
            "resblock_kernel_sizes": [3],
            "upsample_initial_channel": 512,
        },
        "dim_in": 64,
        "dropout": 0.2,
        "hidden_dim": 512,  # fixed by the decoder
        "max_conv_dim": 512,
        "max_dur": 1,
        "multispeaker": True,
        "n_layer": 1,
        "n_mels": 80,
        "n_token": len(vocab) + 1,
        "style_dim": 128,
        "text_encoder_kernel_size": 5,
        "plbert": {
            "hidden_size": 32,
            "num_attention_heads": 2,
            "intermediate_size": 64,
            "max_position_embeddings": 512,
            "num_hidden_layers": 1,
            "dropout": 0.1,
        },
        "vocab": vocab,
    }
    mx.random.seed(seed)
    model = Model(ModelConfig.from_dict(config))
    saved = {}
    for k, w in tree_flatten(model.parameters()):
        # Saved as the PyTorch checkpoints are laid out: Kokoro's sanitize transposes these.
        torch_layout = ("noise_convs" in k and k.endswith(".weight")) or k.endswith(
            ("F0_proj.weight", "N_proj.weight")
        )
        if "weight_v" in k and not check_array_shape(w):
            torch_layout = True
        saved[k] = w.transpose(0, 2, 1) if torch_layout else w
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / "model.safetensors"), saved)
    (path / "config.json").write_text(json.dumps(config))
    (path / "voices").mkdir(exist_ok=True)
    for name in KOKORO_VOICES:
        pack = mx.random.normal((510, 1, 256)) * 0.1
        mx.save_safetensors(str(path / "voices" / f"{name}.safetensors"), {"voice": pack})
    return path
