"""The sampler alone, on small arrays of logits: per-row settings, masks, penalties, seeds."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from pippin.engine.sampler import adjust, sample, shaped
from pippin.engine.sequence import Sequence
from pippin.engine.types import SamplingParams

NEG = float("-inf")
EOS = 0


def _seq(
    prompt: list[int] | None = None, output: list[int] | None = None, index: int = 0, **params
) -> Sequence:
    return Sequence(
        0, "r", index, list(prompt or [9]), SamplingParams(**params), output_ids=list(output or [])
    )


def _probs(logits: list[float]) -> mx.array:
    return mx.log(mx.array([logits], dtype=mx.float32))


def _row(x: mx.array, r: int = 0) -> list[float]:
    return x[r].tolist()


def test_greedy_rows_take_the_argmax() -> None:
    logits = mx.array([[0.1, 3.0, 0.2, -1.0], [5.0, 0.0, 0.0, 4.9]])
    seqs = [_seq(temperature=0.0), _seq(temperature=0.0)]
    for _ in range(3):
        assert sample(logits, seqs, set()).tokens.tolist() == [1, 0]


@pytest.mark.parametrize("top_p", [1.0, 0.999])  # the plain path, and the one with masks
def test_greedy_rows_stay_greedy_beside_sampled_rows(top_p: float) -> None:
    # Even rows are greedy; odd ones sample at temperature 1 from nearly uniform logits.
    logits = mx.array([[0.0, 0.0, 0.01, 0.0]] * 64)
    seqs = [_seq(temperature=float(r % 2), top_p=top_p) for r in range(64)]
    mx.random.seed(1)
    tokens = sample(logits, seqs, set()).tokens.tolist()
    assert set(tokens[::2]) == {2}
    assert len(set(tokens[1::2])) > 1  # the sampled rows do sample


@pytest.mark.parametrize("top_p", [1.0, 0.999])
def test_temperature_scales_the_distribution(top_p: float) -> None:
    """p = softmax(logits / T): with p(1) / p(0) = 3 at T = 1, at T = 2 it is sqrt(3)."""
    n = 4000
    logits = mx.broadcast_to(mx.array([0.0, math.log(3.0)]), (n, 2))
    for t, want in ((1.0, 0.75), (2.0, math.sqrt(3) / (1 + math.sqrt(3)))):
        mx.random.seed(0)
        seqs = [_seq(temperature=t, top_p=top_p) for _ in range(n)]
        share = float(np.mean(np.array(sample(logits, seqs, set()).tokens.tolist())))
        sigma = math.sqrt(want * (1 - want) / n)
        assert abs(share - want) < 5 * sigma, (t, share, want)


def test_top_k_keeps_the_k_most_likely_per_row() -> None:
    logits = mx.array([[1.0, 4.0, 3.0, 2.0]] * 2)
    x = shaped(logits, [_seq(top_k=2), _seq(top_k=0)])
    assert _row(x, 0) == [NEG, 4.0, 3.0, NEG]
    assert _row(x, 1) == [1.0, 4.0, 3.0, 2.0]  # 0: off


def test_top_p_keeps_the_smallest_set_that_reaches_p() -> None:
    probs = [0.05, 0.5, 0.15, 0.3]
    kept = {}
    for p in (0.5, 0.7, 0.9, 1.0):
        x = shaped(_probs(probs), [_seq(top_p=p)])
        kept[p] = [i for i, v in enumerate(_row(x)) if v > NEG]
    assert kept == {0.5: [1], 0.7: [1, 3], 0.9: [1, 2, 3], 1.0: [0, 1, 2, 3]}


def test_min_p_drops_tokens_below_a_share_of_the_top_one() -> None:
    x = shaped(_probs([0.05, 0.5, 0.15, 0.3]), [_seq(min_p=0.2)])  # threshold 0.1
    assert [v > NEG for v in _row(x)] == [False, True, True, True]


def test_masked_tokens_are_never_sampled() -> None:
    n = 256
    logits = mx.broadcast_to(mx.array([0.0, 0.2, 0.1, 0.3]), (n, 4))
    mx.random.seed(3)
    seqs = [_seq(top_k=2) for _ in range(n)]
    assert set(sample(logits, seqs, set()).tokens.tolist()) == {1, 3}


def test_repetition_penalty_shrinks_seen_tokens_logits_toward_less_likely() -> None:
    logits = mx.array([[2.0, -2.0, 2.0, -2.0, 1.0]])
    seq = _seq(prompt=[0], output=[1], repetition_penalty=2.0)
    x, changed = adjust(logits, [seq], set())
    # Seen in the prompt or the output: positive logits halve, negative ones double.
    assert changed and _row(x) == [1.0, -4.0, 2.0, -2.0, 1.0]


def test_presence_and_frequency_penalties_count_output_tokens_only() -> None:
    logits = mx.zeros((1, 4))
    seq = _seq(prompt=[3, 3], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    x, _ = adjust(logits, [seq], set())
    assert _row(x) == [0.0, -(0.5 + 0.25 * 2), -(0.5 + 0.25), 0.0]


def test_logit_bias_adds_and_ignores_ids_outside_the_vocabulary() -> None:
    logits = mx.zeros((2, 3))
    x, changed = adjust(logits, [_seq(logit_bias={1: 5.0, 2: -100.0, 7: 1.0}), _seq()], set())
    assert changed
    assert _row(x, 0) == [0.0, 5.0, -100.0] and _row(x, 1) == [0.0, 0.0, 0.0]
    tokens = sample(logits, [_seq(temperature=0.0, logit_bias={2: 1.0})] * 2, set()).tokens
    assert tokens.tolist() == [2, 2]


def test_min_tokens_holds_back_eos_and_stop_tokens() -> None:
    logits = mx.array([[5.0, 0.0, 4.0, 1.0]])
    early = _seq(output=[3], min_tokens=2, stop_token_ids=[2], temperature=0.0)
    x, _ = adjust(logits, [early], {EOS})
    assert _row(x) == [NEG, 0.0, NEG, 1.0]
    assert sample(logits, [early], {EOS}).tokens.tolist() == [3]
    done = _seq(output=[3, 3], min_tokens=2, stop_token_ids=[2], temperature=0.0)
    assert sample(logits, [done], {EOS}).tokens.tolist() == [EOS]


def test_the_grammar_mask_limits_each_row() -> None:
    logits = mx.array([[5.0, 1.0, 0.0], [5.0, 1.0, 0.0]])
    allowed = mx.array([[False, True, True], [True, True, True]])
    seqs = [_seq(temperature=0.0), _seq(temperature=0.0)]
    assert sample(logits, seqs, set(), allowed).tokens.tolist() == [1, 0]


def test_a_seed_repeats_its_samples() -> None:
    logits = mx.zeros((1, 1000))

    def draws(seed: int, index: int = 0) -> list[int]:
        out = []
        for step in range(8):
            s = _seq(output=[5] * step, index=index, seed=seed)
            mx.random.seed(step)  # the global generator must not matter
            out.append(sample(logits, [s], set()).tokens.item())
        return out

    first = draws(7)
    assert draws(7) == first
    assert len(set(first)) > 1  # each step draws anew
    assert draws(8) != first
    assert draws(7, index=1) != first  # the n sequences of a request differ


def test_forced_tokens_override_the_sample() -> None:
    logits = mx.array([[0.0, 9.0, 0.0], [0.0, 9.0, 0.0]])
    forced = _seq(temperature=0.0)
    forced.think.forced = [2, 0]
    assert sample(logits, [forced, _seq(temperature=0.0)], set()).tokens.tolist() == [2, 1]


def test_logprobs_are_of_the_adjusted_distribution() -> None:
    logits = mx.array([[1.0, 2.0, 3.0, 0.0]])
    seq = _seq(temperature=0.0, logprobs=True, top_logprobs=2, logit_bias={0: 5.0})
    r = sample(logits, [seq], set())
    adjusted = np.array([6.0, 2.0, 3.0, 0.0])
    want = adjusted - np.log(np.exp(adjusted).sum())
    assert r.tokens.tolist() == [0]
    assert r.logprobs is not None and r.top_ids is not None and r.top_logprobs is not None
    assert r.logprobs.tolist() == pytest.approx([want[0]], abs=1e-5)
    assert sorted(r.top_ids[0].tolist()) == [0, 2]
    top = dict(zip(r.top_ids[0].tolist(), r.top_logprobs[0].tolist()))
    assert top == pytest.approx({0: want[0], 2: want[2]}, abs=1e-5)
    assert sample(logits, [_seq(temperature=0.0)], set()).logprobs is None
