"""Audio in chat on a tiny random Gemma 4 in pippin's engine, against mlx-vlm's own
generation on the same inputs."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from support.engine_runs import engine_config, run_to_end  # noqa: E402
from support.tiny_omni import clip, get_tiny_omni  # noqa: E402

from pippin.engine.core import EngineCore  # noqa: E402
from pippin.engine.types import SamplingParams  # noqa: E402
from pippin.store.loader import load_model  # noqa: E402
from pippin.vision import omni  # noqa: E402
from pippin.vision import prompt as vprompt  # noqa: E402

GEN = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(get_tiny_omni(tmp_path_factory.mktemp("omni"))))


def prompt(loaded, text: str, seeds: list[int], seconds: float = 0.5, system: str | None = None):
    parts = [{"type": "audio"} for _ in seeds] + [{"type": "text", "text": text}]
    msgs = [{"role": "user", "content": parts}]
    if system:
        msgs.insert(0, {"role": "system", "content": system})
    tok = loaded.vision.processor.tokenizer
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids, mm = vprompt.build(loaded.vision, loaded.tokenizer, rendered, [])
    clips = []
    for s in seeds:
        x = clip(s, seconds)
        clips.append((x, hashlib.sha256(x.tobytes()).hexdigest()))
    return omni.expand_audio(loaded.vision, loaded.tokenizer, ids, mm, clips)


def reference(loaded, ids: list[int], mm, n: int) -> list[int]:
    """Greedy tokens of mlx-vlm's own `generate_step` on the same inputs."""
    from mlx_vlm.generate import generate_step

    kw = {}
    if mm is not None:
        names = mm.images[0].arrays.keys()
        kw = {k: mx.array(np.concatenate([c.arrays[k] for c in mm.images])) for k in names}
    x = mx.array([ids])
    steps = generate_step(
        x, loaded.vision.vlm, None, mx.ones_like(x), max_tokens=n, temperature=0.0, **kw
    )
    return [int(t) for t, _ in steps]


def test_model_takes_audio(model) -> None:
    assert model.vision.audio_token_id is not None
    assert not model.vision.takes_images


def test_audio_content_changes_the_answer(model) -> None:
    a = reference(model, *prompt(model, "What is said?", [1]), GEN)
    b = reference(model, *prompt(model, "What is said?", [6]), GEN)
    assert a != b


def test_greedy_matches_mlx_vlm_alone_and_batched(model) -> None:
    reqs = {
        "a1": prompt(model, "What is said in this clip?", [1]),
        "a2": prompt(model, "Compare the two.", [2, 3]),
        "long": prompt(model, "And this longer one?", [4], seconds=1.1),
        "text": prompt(model, "Hello, how are you today? Write a short poem.", []),
    }
    assert reqs["a1"][1] is not None and reqs["a1"][1].images[0].num_tokens == 13
    refs = {k: reference(model, ids, mm, GEN) for k, (ids, mm) in reqs.items()}
    # Alone, then all at once with chunks smaller than the prompts (the clip's span cut).
    for budget in (2048, 7):
        core = EngineCore(model, engine_config(max_num_batched_tokens=budget))
        for k, (ids, mm) in reqs.items():
            core.add_request(
                k, ids, SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, mm=mm)
            )
        got = run_to_end(core)
        for k in reqs:
            assert got[k]["ids"][0] == refs[k], (budget, k)


def test_same_clip_is_a_prefix_hit_and_different_clips_never_share(model) -> None:
    core = EngineCore(model, engine_config(block_size=4))
    first = prompt(model, "What is said?", [1])
    same = prompt(model, "What is said? Say more.", [1])
    other = prompt(model, "What is said? Say more.", [5])
    clip_in = first[1].images[0]
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    core.add_request("first", first[0], SamplingParams(**params, mm=first[1]))
    run_to_end(core)
    encoded = core.vision.images_encoded
    core.add_request("other", other[0], SamplingParams(**params, mm=other[1]))
    got = run_to_end(core)
    # The blocks before the clip are shared; none from the clip on.
    assert got["other"]["cached"] == clip_in.start // 4 * 4
    assert core.vision.images_encoded == encoded + 1
    assert got["other"]["ids"][0] == reference(model, *other, 4)
    core.add_request("same", same[0], SamplingParams(**params, mm=same[1]))
    got = run_to_end(core)
    assert got["same"]["cached"] >= clip_in.end // 4 * 4
    assert core.vision.images_encoded == encoded + 1  # nothing encoded again
    assert got["same"]["ids"][0] == reference(model, *same, 4)
