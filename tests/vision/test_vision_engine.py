"""Tiny random-weight VLMs in pippin's engine against mlx-vlm's own generation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402
from support.engine_runs import engine_config, run_to_end  # noqa: E402
from support.tiny_vlms import FAMILIES, get_tiny_vlm  # noqa: E402

from pippin.engine.core import EngineCore  # noqa: E402
from pippin.engine.types import SamplingParams  # noqa: E402
from pippin.store.loader import load_model  # noqa: E402
from pippin.vision import prompt as vprompt  # noqa: E402

GEN = 12


def picture(seed: int, size: tuple[int, int] = (56, 56)) -> tuple[Image.Image, str]:
    import hashlib

    arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    img = Image.fromarray(arr)
    return img, hashlib.sha256(arr.tobytes()).hexdigest()


def messages(n_images: int, text: str) -> list[dict]:
    parts = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


def reference(loaded, ids: list[int], mm, n: int) -> list[int]:
    """Greedy tokens of mlx-vlm's own `generate_step` on the same inputs."""
    from mlx_vlm.generate import generate_step

    vlm = loaded.vision.vlm
    kw = {}
    if mm is not None:
        names = mm.images[0].arrays.keys()
        arrays = {k: mx.array(np.concatenate([im.arrays[k] for im in mm.images])) for k in names}
        kw = {"pixel_values": arrays.pop("pixel_values"), **arrays}
    else:
        kw = {"pixel_values": None}
    if hasattr(vlm.language_model, "_position_ids"):
        vlm.language_model._position_ids = None
        vlm.language_model._rope_deltas = None
    out = []
    pv = kw.pop("pixel_values")
    x = mx.array([ids])
    steps = generate_step(x, vlm, pv, mx.ones_like(x), max_tokens=n, temperature=0.0, **kw)
    for tok, _ in steps:
        out.append(int(tok))
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def vlm(request, tmp_path_factory):
    path = get_tiny_vlm(request.param, tmp_path_factory.mktemp("vlm"))
    return load_model(str(path))


def prompt(loaded, n_images: int, text: str, seeds: list[int]):
    tok = loaded.vision.processor.tokenizer
    rendered = tok.apply_chat_template(
        messages(n_images, text), add_generation_prompt=True, tokenize=False
    )
    return vprompt.build(loaded.vision, loaded.tokenizer, rendered, [picture(s) for s in seeds])


def test_greedy_matches_mlx_vlm_alone_and_batched(vlm) -> None:
    reqs = {
        "img1": prompt(vlm, 1, "What is in this picture?", [1]),
        "img2": prompt(vlm, 2, "Compare these two.", [2, 3]),
        "text": prompt(vlm, 0, "Hello, how are you today? Write a short poem.", []),
    }
    refs = {k: reference(vlm, ids, mm, GEN) for k, (ids, mm) in reqs.items()}
    # Alone, then all at once with chunks smaller than the prompts (the image's span cut).
    for budget in (2048, 7):
        core = EngineCore(vlm, engine_config(max_num_batched_tokens=budget))
        for k, (ids, mm) in reqs.items():
            core.add_request(
                k, ids, SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True, mm=mm)
            )
        got = run_to_end(core)
        for k in reqs:
            assert got[k]["ids"][0] == refs[k], (budget, k)


def test_image_content_changes_the_answer(vlm) -> None:
    """The pixels reach the language model: another picture, another answer."""
    a = reference(vlm, *prompt(vlm, 1, "What is in this picture?", [1]), GEN)
    b = reference(vlm, *prompt(vlm, 1, "What is in this picture?", [5]), GEN)
    assert a != b


def test_same_image_is_a_prefix_hit_and_different_images_never_share(vlm) -> None:
    core = EngineCore(vlm, engine_config(block_size=4))
    first = prompt(vlm, 1, "What is in this picture?", [1])
    same = prompt(vlm, 1, "What is in this picture? Say more.", [1])
    other = prompt(vlm, 1, "What is in this picture? Say more.", [4])
    im = first[1].images[0]
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    core.add_request("first", first[0], SamplingParams(**params, mm=first[1]))
    run_to_end(core)
    encoded = core.vision.images_encoded
    core.add_request("other", other[0], SamplingParams(**params, mm=other[1]))
    got = run_to_end(core)
    # The blocks before the image are shared; none from the image on.
    assert got["other"]["cached"] == im.start // 4 * 4
    assert core.vision.images_encoded == encoded + 1
    core.add_request("same", same[0], SamplingParams(**params, mm=same[1]))
    got = run_to_end(core)
    # Every full block through the image (and the text after it that both share).
    assert got["same"]["cached"] >= im.end // 4 * 4
    assert core.vision.images_encoded == encoded + 1  # nothing encoded again
    assert got["same"]["ids"][0] == reference(vlm, *same, 4)


def test_preempted_image_requests_recompute_to_the_same_tokens(vlm) -> None:
    """A pool too small for every sequence at once: the newest are preempted, freed and
    recomputed (their images from the encoder cache), with the same greedy tokens."""
    n = 2 * GEN
    reqs = {f"r{i}": prompt(vlm, 1, "Describe the picture in detail.", [20 + i]) for i in range(6)}
    refs = {k: reference(vlm, ids, mm, n) for k, (ids, mm) in reqs.items()}
    prompt_len = max(len(ids) for ids, _ in reqs.values())
    # Room for two prompts (and one whole sequence), not for two whole sequences.
    blocks = max(2 * (prompt_len // 4 + 1) + 2, (prompt_len + n) // 4 + 2)
    assert blocks < 2 * ((prompt_len + n) // 4)
    core = EngineCore(vlm, engine_config(block_size=4, num_blocks=blocks))
    for k, (ids, mm) in reqs.items():
        core.add_request(
            k, ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, mm=mm)
        )
    got = run_to_end(core)
    assert core.scheduler.num_preemptions > 0
    for k in reqs:
        assert got[k]["ids"][0] == refs[k], k


def test_encoder_cache_serves_the_same_image_at_another_position(vlm) -> None:
    core = EngineCore(vlm, engine_config(block_size=4))
    a = prompt(vlm, 1, "What is in this picture?", [30])
    # Another message first: the image sits elsewhere, so no block is shared with `a`.
    tok = vlm.vision.processor.tokenizer
    msgs = [{"role": "system", "content": "Be brief and exact."}, *messages(1, "And this?")]
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    b = vprompt.build(vlm.vision, vlm.tokenizer, rendered, [picture(30)])
    assert b[1].images[0].start != a[1].images[0].start
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    core.add_request("a", a[0], SamplingParams(**params, mm=a[1]))
    run_to_end(core)
    assert core.vision.images_encoded == 1
    core.add_request("b", b[0], SamplingParams(**params, mm=b[1]))
    got = run_to_end(core)
    assert core.vision.images_encoded == 1 and core.vision.cache.hits == 1
    assert got["b"]["ids"][0] == reference(vlm, *b, 4)


@pytest.mark.parametrize(("text_model", "served"), [("mistral", True), ("ministral3", False)])
def test_mistral3_with_a_position_scaled_text_model_is_not_served_as_a_vlm(
    tmp_path, text_model: str, served: bool
) -> None:
    """Ministral 3's attention scale follows the position, which mlx-vlm takes from the
    first row for a whole batch: such a checkpoint is not served through the vision path."""
    import json

    from pippin.vision.load import is_vlm_folder

    config = {
        "model_type": "mistral3",
        "vision_config": {},
        "text_config": {"model_type": text_model},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert is_vlm_folder(tmp_path) is served
