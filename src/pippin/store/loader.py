"""Load a model for serving: a local MLX or Hugging Face folder, a GGUF file, or a Hub id.

Folders go through mlx-lm's own loaders unchanged; GGUF files through `gguf_loader`. Both end
as an mlx-lm model, a `TokenizerWrapper` and the model's own defaults in a `LoadedModel`.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear
from mlx_lm.tokenizer_utils import TokenizerWrapper

from pippin import envs, heap
from pippin.vision.load import VisionParts, is_vlm_folder, load_vlm, vision_family

from .default_model import (
    DEFAULT_FILE,
    DEFAULT_INSTALL,
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_SAMPLING,
    DEFAULT_PACKAGE,
)
from .loaded import LoadedModel, ModelLoadError

logger = logging.getLogger(__name__)

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# generation_config.json names -> SamplingParams names.
_GENERATION_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


def default_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs llm and llama_cpp).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"default model not installed; run: {DEFAULT_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file missing; run: {DEFAULT_INSTALL}")
    return path


def load_model(
    spec: str | None,
    *,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    weights: bool = True,
) -> LoadedModel:
    """Load `spec` (None for the default model) ready to serve.

    weights False leaves the weights unread (lazy): for a process that only needs the
    tokenizer and config while another process runs the model.

    dtype None keeps float32 on the CPU (MLX's fastest there) and the checkpoint's dtype on a GPU;
    an explicit dtype casts the floating-point parameters (quantised weights stay packed).
    On the CPU, dtype None also unpacks quantised weights to float32 when they fit
    (`_dequantize_for_cpu`).
    """
    if dtype is not None and dtype not in _DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (use one of {', '.join(_DTYPES)})")
    path, source, name = resolve_spec(spec, revision)
    vision = None
    try:
        if path.suffix == ".gguf":
            from . import gguf_loader

            model, tokenizer, config, folder = gguf_loader.load_gguf(
                path, trust_remote_code=trust_remote_code, weights=weights
            )
        elif is_vlm_folder(path):
            model, tokenizer, config, vision = _load_vlm_folder(path, trust_remote_code, weights)
            folder = path
        else:
            if vision_family(path) is not None:
                logger.info(
                    "%s has a vision part that pippin does not run (its family is not "
                    "supported yet, or the vision extra is not installed): text only",
                    name,
                )
            model, tokenizer, config = _load_folder(path, trust_remote_code)
            folder = path
        generation = read_json(folder / "generation_config.json")
        for token_id in _eos_ids(generation, read_json(folder / "config.json")):
            tokenizer.add_eos_token(str(token_id))
        chosen = cast_params(model, config, dtype)
        if weights and dtype is None and mx.default_device() == mx.cpu and cpu_unpack():
            _dequantize_for_cpu(model)
        if weights:
            mx.eval(model.parameters())
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, ImportError) as e:
        raise ModelLoadError(f"cannot load {source}: {one_line(e)}") from e
    logger.info("loaded model %s (%s)", name, chosen)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        source=source,
        name=name,
        generation_defaults=_generation_defaults(generation, path),
        eos_token_ids=set(tokenizer.eos_token_ids),
        max_position_embeddings=context_length(config),
        dtype=chosen,
        vision=vision,
    )


def materialize(loaded: LoadedModel) -> LoadedModel:
    """Evaluate a lazily loaded model in the thread that loaded it.

    On CUDA each thread has its own streams, and the engine thread cannot evaluate
    work recorded on another thread's stream: the weights, and arrays models derive
    at construction (RoPE frequencies and the like), which one forward pass computes."""
    mx.eval(loaded.model.parameters())
    try:
        mx.eval(loaded.model(mx.array([[0]])))
    except Exception:  # a model that takes other inputs: its weights are evaluated
        pass
    return loaded


def resolve_spec(spec: str | None, revision: str | None) -> tuple[Path, str, str]:
    """(local path, source, name): downloads Hub models."""
    if spec is None:
        path = default_model_path()
        return path, str(path), DEFAULT_MODEL_NAME
    path = Path(spec).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return ggufs[0], str(ggufs[0]), ggufs[0].stem
        if not (path / "config.json").exists():
            raise ModelLoadError(f"{spec}: folder has no config.json")
        return path, str(path), path.resolve().name
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{spec}: a file must be a .gguf (or give its folder)")
        return path, str(path), path.stem
    if spec.startswith(("/", ".", "~")) or not _is_hub_spec(spec):
        raise ModelLoadError(f"{spec}: no such file or folder")
    return _download(spec, revision), spec, spec


def model_name(spec: str | None) -> str:
    """The name `resolve_spec` gives ``spec``, without downloading anything."""
    if spec is None:
        return DEFAULT_MODEL_NAME
    path = Path(spec).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and len(ggufs) == 1:
            return ggufs[0].stem
        return path.resolve().name
    if path.is_file():
        return path.stem
    return spec


def release_memory() -> None:
    """Give back what an unloaded model held: its arrays, then MLX's buffer cache."""
    heap.collect()
    mx.clear_cache()


def _is_hub_spec(spec: str) -> bool:
    # "org/name", or "org/name/file.gguf" for one GGUF file of a Hub repository.
    parts = spec.split("/")
    if spec.endswith(".gguf") and len(parts) >= 3:
        return bool(_HUB_ID.match("/".join(parts[:2])))
    return bool(_HUB_ID.match(spec))


@functools.cache  # once per process: `pippin serve` resolves the model before it loads it
def _download(spec: str, revision: str | None) -> Path:
    try:
        if spec.endswith(".gguf"):
            from huggingface_hub import hf_hub_download

            org, repo, filename = spec.split("/", 2)
            return Path(hf_hub_download(f"{org}/{repo}", filename, revision=revision))
        from mlx_lm.utils import _download as mlx_download

        return mlx_download(spec, revision=revision)
    except Exception as e:  # huggingface_hub raises many kinds; all mean "not available"
        raise ModelLoadError(f"{spec}: not found locally or on the Hub: {one_line(e)}") from e


def _load_folder(
    path: Path, trust_remote_code: bool
) -> tuple[nn.Module, TokenizerWrapper, dict[str, Any]]:
    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    # Lazy, so a cast below happens before the checkpoint dtype is ever materialised.
    model, config = mlx_load_model(path, lazy=True, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(
        path,
        {"trust_remote_code": trust_remote_code},
        eos_token_ids=config.get("eos_token_id"),
    )
    return model, tokenizer, config


def _load_vlm_folder(
    path: Path, trust_remote_code: bool, weights: bool
) -> tuple[nn.Module, TokenizerWrapper, dict[str, Any], VisionParts]:
    """A vision-language folder through mlx-vlm: its language model for the engine, the
    vision tower and processor beside it (`pippin.vision.load`)."""
    from mlx_lm.utils import load_tokenizer

    model, vision, config = load_vlm(path, weights=weights)
    tokenizer = load_tokenizer(
        path,
        {"trust_remote_code": trust_remote_code},
        eos_token_ids=config.get("eos_token_id"),
    )
    return model, tokenizer, config, vision


def cast_params(model: nn.Module, config: dict[str, Any], dtype: str | None) -> str:
    """Cast floating parameters to the wanted dtype and return its name."""
    if dtype is None:
        if mx.default_device() == mx.cpu:
            dtype = "float32"
        else:
            # The checkpoint's dtype; casting keeps a stray float32 norm from promoting
            # every activation after it.
            dtype = config.get("torch_dtype") or config.get("dtype")
            if dtype not in _DTYPES:
                dtype = _dominant_dtype(model)
    target = _DTYPES[dtype]
    # Some models keep a few parameters in float32 on purpose (see mlx_lm convert).
    keep = getattr(model, "cast_predicate", lambda _: True)

    def cast(key: str, value: mx.array) -> mx.array:
        if keep(key) and mx.issubdtype(value.dtype, mx.floating):
            return value.astype(target)
        return value

    model.update(tree_map_with_path(cast, model.parameters()))
    return dtype


# The share of the machine's memory a quantised model's weights may take once unpacked to
# float32 on the CPU.
CPU_UNPACK_SHARE = 0.25


def cpu_unpack() -> bool:
    """Whether quantised weights may be unpacked on the CPU (`PIPPIN_CPU_UNPACK`, not 0);
    also off when GGUF K-quants are re-quantised on purpose (`PIPPIN_GGUF_REQUANT=1`), or
    the re-quantisation would be undone."""
    return envs.PIPPIN_CPU_UNPACK != "0" and envs.PIPPIN_GGUF_REQUANT != "1"


def _dequantize_for_cpu(model: nn.Module) -> None:
    """Unpack a quantised model's weights to float32 on the CPU when they take at most
    `CPU_UNPACK_SHARE` of the machine's memory so.

    MLX's CPU quantised matmul does not use BLAS: SmolLM2-135M (Q4_1) read a 512-token
    prompt in 47 s against 2.1 s unpacked, with OpenBLAS (docs/benchmarks.md). The
    unpacked weights are the quantised values exactly, so outputs agree to rounding.
    Mixture-of-experts layers (mlx-lm's `QuantizedSwitchLinear`: a stack of experts) become
    its `SwitchLinear` likewise."""
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    layers = [(path, m) for path, m in model.named_modules() if type(m) in kinds]
    if not layers:
        return
    unpacked = sum(4 * m.weight.size * 32 // m.bits for _, m in layers)
    rest = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if unpacked + rest > CPU_UNPACK_SHARE * memory:
        logger.info("quantised weights kept packed: %.1f GB unpacked", unpacked / 1e9)
        return
    new: list[tuple[str, nn.Module]] = []
    for path, m in layers:
        w = mx.dequantize(m.weight, m.scales, m.get("biases"), m.group_size, m.bits, m.mode)
        w = w.astype(mx.float32)
        if isinstance(m, nn.QuantizedEmbedding):
            layer: nn.Module = nn.Embedding(*w.shape)
        elif isinstance(m, QuantizedSwitchLinear):  # weight [experts, out, in]
            layer = SwitchLinear(w.shape[2], w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                layer.bias = m.bias.astype(mx.float32)
        else:
            layer = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            if "bias" in m:
                layer.bias = m.bias.astype(mx.float32)
        layer.weight = w
        new.append((path, layer))
    model.update_modules(tree_unflatten(new))
    logger.info("%d quantised layers unpacked to float32 for the CPU", len(layers))


def _dominant_dtype(model: nn.Module) -> str:
    sizes: dict[str, int] = {}
    for _, v in tree_flatten(model.parameters()):
        key = str(v.dtype).removeprefix("mlx.core.")
        if key in _DTYPES:
            sizes[key] = sizes.get(key, 0) + v.size
    return max(sizes, key=sizes.__getitem__) if sizes else "float32"


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        logger.warning("ignoring unreadable %s", path.name)
        return {}
    return data if isinstance(data, dict) else {}


def _generation_defaults(generation: dict[str, Any], path: Path) -> dict[str, Any]:
    """The model's own sampling defaults; the default model's file (wherever it lies) gets
    those pippin ships for it, below any its file carries."""
    own = {
        ours: generation[theirs]
        for theirs, ours in _GENERATION_KEYS.items()
        if generation.get(theirs) is not None
    }
    shipped = DEFAULT_MODEL_SAMPLING if path.name == DEFAULT_FILE else {}
    return {**shipped, **own}


def _eos_ids(*configs: dict[str, Any]) -> set[int]:
    ids: set[int] = set()
    for config in configs:
        for source in (config, config.get("text_config") or {}):
            value = source.get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(v for v in value if isinstance(v, int))
    return ids


def context_length(config: dict[str, Any]) -> int | None:
    for source in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(source.get(key), int):
                return source[key]
    return None


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
