"""The LM head on the sampling positions only: the same logits as the whole head."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from pippin.kernels import patches


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3_next"])
def test_selected_positions_match_full_logits(tiny_models, arch: str) -> None:
    model, _ = load(str(tiny_models(arch)))
    vocab = model.args.vocab_size
    x = mx.array(np.random.default_rng(0).integers(0, vocab, (3, 7)))
    full = model(x, cache=make_prompt_cache(model))
    params = dict(model.parameters())

    holder = patches.select_head_rows(model)
    assert holder is not None, "every tiny architecture has a final norm the head follows"
    rows, cols = [0, 2, 1], [6, 3, 0]
    with holder.select(rows, cols, (3, 7)):
        picked = model(x, cache=make_prompt_cache(model))
    assert picked.shape == (3, 1, vocab)
    want = full[mx.array(rows), mx.array(cols)]
    assert mx.allclose(picked[:, 0], want, atol=1e-4, rtol=1e-4).item()

    # Outside a selection the model is unchanged, and so are its parameters' names.
    again = model(x, cache=make_prompt_cache(model))
    assert mx.array_equal(again, full).item()
    assert dict(model.parameters()).keys() == params.keys()
