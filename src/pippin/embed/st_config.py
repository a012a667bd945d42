"""What a model folder's sentence-transformers files declare: pooling, normalisation,
length, prompts, Matryoshka dimensions and a cross-encoder's activation.

Files read: ``modules.json``, ``<pooling>/config.json`` (usually ``1_Pooling``),
``sentence_bert_config.json``, ``config_sentence_transformers.json`` and ``config.json``.
A module pippin does not implement (``Dense``, ``LayerNorm``, ...) is refused at load, so a
model is never served with part of its pipeline silently left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pippin.store.loader import ModelLoadError, read_json

# Pooling modes in the order sentence-transformers concatenates them.
POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len", "weightedmean", "lasttoken")
_MODULE_PREFIX = "sentence_transformers.models."
_KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}
# Cross-encoder activations pippin implements (sentence-transformers writes the class path).
ACTIVATIONS = {"sigmoid": "sigmoid", "identity": "identity"}


@dataclass
class EmbedSpec:
    """How hidden states become one vector."""

    pooling: tuple[str, ...]
    normalize: bool
    # From sentence_bert_config.json; None: only the model's own limits apply.
    max_seq_length: int | None = None
    # Prepended to every text input (config_sentence_transformers.json default_prompt_name).
    default_prompt: str = ""
    # None: not a Matryoshka model; () any width up to the full one; else the allowed widths.
    matryoshka: tuple[int, ...] | None = None
    notes: list[str] = field(default_factory=list)


def read_embed_spec(folder: Path, config: dict[str, Any], *, decoder: bool) -> EmbedSpec:
    """The folder's sentence-transformers pipeline; without ``modules.json`` the defaults
    are mean pooling (sentence-transformers' own default for an encoder) or last-token
    pooling with normalisation (Qwen3-Embedding and the other decoder embedders)."""
    modules = _read_list(folder / "modules.json")
    sbert = read_json(folder / "sentence_bert_config.json")
    st = read_json(folder / "config_sentence_transformers.json")
    max_len = sbert.get("max_seq_length")
    spec = EmbedSpec(
        pooling=("lasttoken",) if decoder else ("mean",),
        normalize=decoder,
        max_seq_length=max_len if isinstance(max_len, int) and max_len > 0 else None,
        default_prompt=_default_prompt(st),
        matryoshka=_matryoshka(config),
    )
    if not modules:
        return spec
    spec.normalize = False
    pooling_seen = False
    for m in modules:
        kind = str(m.get("type", "")).removeprefix(_MODULE_PREFIX)
        if kind not in _KNOWN_MODULES:
            raise ModelLoadError(
                f"sentence-transformers module {m.get('type')!r} is not supported "
                "(pippin runs Transformer, Pooling and Normalize)"
            )
        if kind == "Pooling":
            pooling_seen = True
            spec.pooling = _pooling_modes(
                read_json(folder / str(m.get("path", "")) / "config.json")
            )
        elif kind == "Normalize":
            spec.normalize = True
    if not pooling_seen:
        raise ModelLoadError("modules.json has no Pooling module")
    return spec


def _read_list(path: Path) -> list[dict[str, Any]]:
    import json

    if not path.is_file():
        return []
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"unreadable {path.name}: {e}") from e
    if not isinstance(data, list):
        raise ModelLoadError(f"{path.name} is not a list of modules")
    return [m for m in data if isinstance(m, dict)]


def _pooling_modes(cfg: dict[str, Any]) -> tuple[str, ...]:
    if cfg.get("include_prompt") is False:
        raise ModelLoadError("pooling with include_prompt=false is not supported")
    if "pooling_mode" in cfg:  # the short form some configs use
        mode = str(cfg["pooling_mode"]).removesuffix("_tokens").removesuffix("_token")
        modes = (mode,)
    else:
        modes = tuple(
            m
            for m in POOLING_MODES
            if cfg.get(f"pooling_mode_{m}_token")
            or cfg.get(f"pooling_mode_{m}_tokens")
            or cfg.get(f"pooling_mode_{m}")
        )
    bad = [m for m in modes if m not in POOLING_MODES]
    if bad or not modes:
        raise ModelLoadError(f"unsupported pooling configuration: {bad or 'no mode set'}")
    return modes


def _default_prompt(st: dict[str, Any]) -> str:
    name = st.get("default_prompt_name")
    prompts = st.get("prompts") or {}
    if name and isinstance(prompts, dict):
        if name not in prompts:
            raise ModelLoadError(f"default_prompt_name {name!r} is not among the prompts")
        return str(prompts[name])
    return ""


def _matryoshka(config: dict[str, Any]) -> tuple[int, ...] | None:
    """vLLM's convention in config.json: ``matryoshka_dimensions`` (a list) or
    ``is_matryoshka: true`` (any width)."""
    dims = config.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims:
        return tuple(sorted(int(d) for d in dims))
    if config.get("is_matryoshka"):
        return ()
    return None


def cross_encoder_activation(config: dict[str, Any]) -> str:
    """The activation sentence-transformers' CrossEncoder applies to a one-label model's
    logit: Sigmoid unless the config names another. Unknown ones fail the load."""
    st = config.get("sentence_transformers") or {}
    name = st.get("activation_fn") or config.get("sbert_ce_default_activation_function")
    if not name:
        return "sigmoid"
    short = str(name).rsplit(".", 1)[-1].lower()
    if short not in ACTIVATIONS:
        raise ModelLoadError(f"cross-encoder activation {name!r} is not supported")
    return ACTIVATIONS[short]
