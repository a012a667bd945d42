"""What a Hub pull fetches: the repo and tag a model name means, and the repo's files
that make the model (one GGUF file picked by its quantisation tag, or a model folder).

Names are Ollama's for Hugging Face: ``hf.co/org/repo:Q4_K_M``,
``huggingface.co/org/repo``, or plainly ``org/repo[:tag]``. The tag picks a GGUF file by
the quantisation its name ends with, case-insensitively; none (or ``latest``) means the
model folder where the repo has one, else Ollama's default ``Q4_K_M``, else the repo's
only GGUF file.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from pippin.store.library import LibraryError, normalize

DEFAULT_TAG = "Q4_K_M"  # Ollama's, for a GGUF repo pulled without a tag
_REPO = re.compile(r"^[A-Za-z0-9][\w.\-]*/[A-Za-z0-9][\w.\-]*$")
_HOSTS = ("hf.co/", "huggingface.co/")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})$")
# A model folder's files, as mlx-lm's own download fetches them (its
# DEFAULT_ALLOW_PATTERNS; a test holds the two equal), at the repo's top level only:
# no README, images, PyTorch .bin, ONNX or `original/` copies of the weights.
FOLDER_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)


class PullError(Exception):
    """Why a pull failed, in one line; ``kind`` says what kind of failure (the API's
    status): bad_name, not_found, auth, network, checksum, disk, cancelled."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class HubRef:
    repo: str  # org/repo
    tag: str | None  # None: none given, or "latest"
    name: str  # the library name it is kept under (normalized)


@dataclass(frozen=True)
class RemoteFile:
    path: str  # in the repo
    size: int
    sha256: str | None  # LFS files: the checksum the Hub lists
    blob_id: str | None  # other files: their git blob id (sha1 of "blob <size>\0" + bytes)


def parse_name(name: str) -> HubRef:
    """The repo and tag of ``name``; `PullError` (bad_name) for a name that is none."""
    name = name.strip()
    try:
        stored = normalize(name)
    except LibraryError as e:
        raise PullError("bad_name", str(e)) from None
    rest = name
    for host in _HOSTS:
        if rest.lower().startswith(host):
            rest = rest[len(host) :]
            break
    repo, _, tag = rest.partition(":")
    if not _REPO.match(repo) or ".." in repo or "--" in repo:
        raise PullError(
            "bad_name",
            f"'{name}' is not a Hugging Face repository: pippin pulls models from "
            "Hugging Face, named hf.co/ORG/REPO[:QUANT] or ORG/REPO",
        )
    return HubRef(repo, None if tag in ("", "latest") else tag, stored)


def _stem(path: str) -> str:
    """The GGUF file's name without folder, `.gguf` and split suffix."""
    return _SPLIT.sub("", path.rsplit("/", 1)[-1][: -len(".gguf")])


def gguf_tag(path: str) -> str:
    """The tag a GGUF file answers to: the last part of its name (``...-Q4_K_M.gguf``)."""
    return re.split(r"[-.]", _stem(path))[-1]


def _matches(path: str, tag: str) -> bool:
    stem, tag = _stem(path).lower(), tag.lower()
    # The quantisation ends the name; "-UD-Q4_K_XL" style tags span several parts.
    return stem == tag or stem.endswith((f"-{tag}", f".{tag}"))


def _is_folder_file(path: str) -> bool:
    return "/" not in path and any(fnmatch.fnmatch(path, p) for p in FOLDER_PATTERNS)


def choose_files(ref: HubRef, files: list[RemoteFile]) -> tuple[list[RemoteFile], str, str]:
    """(files to fetch, entry, format): the GGUF file the tag picks (entry: its path), or
    the model folder (entry ""). `PullError` when the repo has no such model."""
    ggufs = [
        f
        for f in files
        if f.path.lower().endswith(".gguf") and not f.path.rsplit("/", 1)[-1].startswith("mmproj")
    ]
    paths = {f.path for f in files}
    weights = [f for f in files if _is_folder_file(f.path) and f.path.endswith(".safetensors")]
    if ref.tag is None and "config.json" in paths and weights:
        return [f for f in files if _is_folder_file(f.path)], "", "safetensors"
    if not ggufs:
        if ref.tag is not None:
            raise PullError(
                "not_found",
                f"{ref.repo} has no GGUF files, so no tag '{ref.tag}': "
                f"pull it without a tag ({ref.repo})",
            )
        raise PullError(
            "not_found",
            f"{ref.repo} has neither GGUF files nor a safetensors model (config.json and "
            "model*.safetensors): pippin loads MLX, safetensors and GGUF models",
        )
    tags = ", ".join(sorted({gguf_tag(f.path) for f in ggufs}, key=str.lower))
    tag = ref.tag or DEFAULT_TAG
    chosen = [f for f in ggufs if _matches(f.path, tag)]
    if not chosen and ref.tag is None and len(ggufs) == 1:
        chosen = ggufs
    if not chosen:
        raise PullError(
            "not_found",
            f"{ref.repo} has no GGUF file tagged '{tag}'; its tags: {tags} "
            f"(pull e.g. hf.co/{ref.repo}:{gguf_tag(ggufs[0].path)})",
        )
    splits = [m for f in chosen if (m := _SPLIT.search(f.path[: -len(".gguf")]))]
    if splits:
        raise PullError(
            "bad_name",
            f"{ref.repo}'s '{tag}' model is split into {int(splits[0].group(2))} GGUF files; "
            "pippin loads a model from one GGUF file",
        )
    if len(chosen) > 1:
        names = ", ".join(f.path for f in chosen)
        raise PullError(
            "bad_name",
            f"tag '{tag}' matches several files of {ref.repo} ({names}); its tags: {tags}",
        )
    return chosen, chosen[0].path, "gguf"
