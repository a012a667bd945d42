"""Audio in chat: a clip's prompt tokens and encoder inputs (API side).

An audio clip travels as an `ImageInput` whose `token_id` is the model's audio token and
whose arrays are the feature extractor's (`input_features`, `input_features_mask`): the
engine treats it as it treats an image (content key in the block hashes, the encoder as
its own batched step, its embeddings written over its placeholder span). `encoder`
gets a clip's embeddings from mlx-vlm's own `get_input_embeddings` over a row of audio
tokens, so the family's tower and projection are its own code.

Gemma 4 (E2B/E4B, the checkpoints with an `audio_config`) only, for now: its language
model scales token embeddings by `embed_scale` and adds per-layer inputs computed from
the token ids with image and audio positions zeroed (`Model.get_input_embeddings`), which
`load.Gemma4Adapter` does for every step (`load.AUDIO_FAMILIES`). Its images are not
served yet (their position ids and attention are not checked against mlx-vlm's), so they
are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from pippin.vision.inputs import ImageInput, MultiModal, content_key
from pippin.vision.load import VisionParts


class AudioPromptError(ValueError):
    """The prompt and its audio clips do not agree."""


def sample_rate(parts: VisionParts) -> int:
    """The rate the model's feature extractor takes."""
    return int(parts.processor.feature_extractor.sampling_rate)


def max_seconds(parts: VisionParts) -> float:
    """The longest clip the model takes whole (its processor caps a clip's tokens)."""
    proc = parts.processor
    return float(proc.audio_seq_length * proc.audio_ms_per_token / 1000)


def placeholder(parts: VisionParts) -> str:
    """The text a chat template writes for one clip."""
    return str(parts.processor.audio_token)


def process_audio(
    parts: VisionParts, tokenizer: Any, samples: np.ndarray
) -> tuple[list[int], int, dict[str, np.ndarray]]:
    """What one clip's placeholder becomes: its tokens, where its run of audio tokens
    starts in them, and the clip's encoder inputs."""
    out = parts.processor(text=[placeholder(parts)], audio=[samples], return_tensors="np")
    ids = [int(t) for t in np.asarray(out["input_ids"]).reshape(-1)]
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and ids and ids[0] == bos:
        ids = ids[1:]
    where = [i for i, t in enumerate(ids) if t == parts.audio_token_id]
    if not where or where[-1] - where[0] + 1 != len(where):
        raise AudioPromptError("the processor did not give the clip one run of audio tokens")
    arrays = {k: np.asarray(out[k]) for k in ("input_features", "input_features_mask") if k in out}
    if "input_features" not in arrays:
        raise AudioPromptError("the processor gave no audio features")
    return ids, where[0], arrays


def expand_audio(
    parts: VisionParts,
    tokenizer: Any,
    ids: list[int],
    mm: MultiModal | None,
    clips: Sequence[tuple[np.ndarray, str]],
) -> tuple[list[int], MultiModal | None]:
    """`ids` (with any images already expanded into `mm`) with each audio placeholder
    replaced by its clip's expansion; `clips` are (samples, sha256 of the upload) in
    prompt order. Image spans after a clip move with it."""
    if not clips:
        return ids, mm
    assert parts.audio_token_id is not None
    marker = tokenizer.encode(placeholder(parts), add_special_tokens=False)
    if marker != [parts.audio_token_id]:
        raise AudioPromptError("the model's audio placeholder is not its one audio token")
    where = [i for i, t in enumerate(ids) if t == parts.audio_token_id]
    if len(where) != len(clips):
        raise AudioPromptError(
            f"the chat template wrote {len(where)} audio placeholders for {len(clips)} clips"
        )
    out: list[int] = []
    items: list[ImageInput] = []
    grown: list[tuple[int, int]] = []  # (placeholder position, tokens it added)
    prev = 0
    for pos, (samples, sha) in zip(where, clips):
        expansion, first, arrays = process_audio(parts, tokenizer, samples)
        n = sum(1 for t in expansion if t == parts.audio_token_id)
        out.extend(ids[prev:pos])
        start = len(out) + first
        out.extend(expansion)
        key = content_key(sha, arrays)
        items.append(ImageInput(key, start, start + n, arrays, token_id=parts.audio_token_id))
        grown.append((pos, len(expansion) - 1))
        prev = pos + 1
    out.extend(ids[prev:])
    for im in mm.images if mm is not None else ():
        d = sum(g for pos, g in grown if pos < im.start)
        items.append(replace(im, start=im.start + d, end=im.end + d))
    if mm is not None and mm.positions is not None:
        raise AudioPromptError("audio with M-RoPE positions is not supported")
    return out, MultiModal(tuple(sorted(items, key=lambda x: x.start)))
