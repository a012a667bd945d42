"""Stacking recurrent state into a call's batch (`pippin.runner.recurrent_state`)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache

from pippin.runner.recurrent_state import StateRow, as_arrays, stack, unstack


def _batch(rows: int, base: float) -> tuple[mx.array, mx.array]:
    conv = base + mx.arange(rows * 6, dtype=mx.float32).reshape(rows, 2, 3)
    ssm = -base - mx.arange(rows * 4, dtype=mx.float32).reshape(rows, 4)
    return conv, ssm


def test_the_same_batch_in_the_same_order_is_taken_as_it_is() -> None:
    conv, ssm = _batch(3, 0.0)
    rows = unstack(_cache(conv, ssm), 3)
    out = stack(list(rows), 2, [1, 1, 1])
    assert out.cache[0] is conv and out.cache[1] is ssm
    assert out.lengths is None


def test_rows_of_several_calls_own_arrays_and_none_stack_in_row_order() -> None:
    a_conv, a_ssm = _batch(4, 0.0)
    b_conv, b_ssm = _batch(2, 100.0)
    a, b = unstack(_cache(a_conv, a_ssm), 4), unstack(_cache(b_conv, b_ssm), 2)
    own = [mx.full((1, 2, 3), 7.0), mx.full((1, 4), 8.0)]
    entries = [a[2], a[0], b[1], None, own, a[3]]
    out = stack(entries, 2, [1, 3, 1, 2, 1, 1])
    want_conv = [a_conv[2], a_conv[0], b_conv[1], mx.zeros((2, 3)), own[0][0], a_conv[3]]
    want_ssm = [a_ssm[2], a_ssm[0], b_ssm[1], mx.zeros((4,)), own[1][0], a_ssm[3]]
    assert np.array_equal(np.array(out.cache[0]), np.array(mx.stack(want_conv)))
    assert np.array_equal(np.array(out.cache[1]), np.array(mx.stack(want_ssm)))
    # Right padding: each row's state stops at its own length.
    assert out.lengths.tolist() == [1, 3, 1, 2, 1, 1]


def test_fresh_rows_leave_the_state_to_the_model() -> None:
    out = stack([None, None], 2, [5, 5])
    assert out.cache == [None, None] and out.lengths is None


def test_a_row_as_arrays_of_its_own() -> None:
    conv, ssm = _batch(3, 0.0)
    row = StateRow((conv, ssm), 1)
    got = as_arrays(row)
    assert got is not None
    assert np.array_equal(np.array(got[0]), np.array(conv[1:2]))
    assert as_arrays(None) is None


def _cache(*arrays: mx.array) -> ArraysCache:
    c = ArraysCache(len(arrays))
    c.cache = list(arrays)
    return c
