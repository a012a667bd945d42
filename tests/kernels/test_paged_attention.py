"""The paged-attention decode path against the portable gather path.

The CUDA kernel itself runs only on an NVIDIA GPU (MLX's CUDA backend); on CPU and
Metal its test skips. The plumbing around it (the hook in the model modules, the
cache handing over the pools, block tables and offsets) is tested everywhere by
standing the gather-based reference in for the kernel.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from support.engine_runs import greedy_logprobs, greedy_or_skip, loaded_model

from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.kernels import device, paged_attention
from pippin.runner import paged_cache


def _case(
    B: int,
    hq: int,
    hkv: int,
    d: int,
    dtype: mx.Dtype,
    bs: int = 16,
    seed: int = 0,
    max_len: int = 300,
) -> tuple[mx.array, ...]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len, size=B)
    if max_len > 300:
        lens[-1] = max_len  # a row as long as the case allows
    lens[0] = 1 if B > 1 or max_len <= 300 else max_len  # a row whose only key is the new one
    nb = int((lens.max() + bs - 1) // bs)
    num_blocks = B * nb + 3
    perm = rng.permutation(num_blocks)  # blocks scattered over the pool
    tables = np.zeros((B, nb), dtype=np.int32)
    used = 0
    for b in range(B):
        n = (lens[b] + bs - 1) // bs
        tables[b, :n] = perm[used : used + n]
        used += n
    q = mx.array(rng.standard_normal((B, hq, 1, d)), dtype=dtype)
    k = mx.array(rng.standard_normal((hkv, num_blocks * bs, d)), dtype=dtype)
    v = mx.array(rng.standard_normal((hkv, num_blocks * bs, d)), dtype=dtype)
    return q, k, v, mx.array(tables), mx.array(lens - 1, dtype=mx.int32)


@pytest.mark.cuda
@pytest.mark.parametrize(
    "B,hq,hkv,d",
    [(1, 32, 8, 64), (7, 32, 8, 64), (33, 16, 8, 128), (5, 8, 8, 64), (3, 64, 8, 128)],
)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_kernel_matches_gather_path(B: int, hq: int, hkv: int, d: int, dtype: mx.Dtype) -> None:
    q, k, v, tables, offsets = _case(B, hq, hkv, d, dtype)
    scale = d**-0.5
    got = paged_attention.paged_decode_attention(q, k, v, tables, offsets, scale, 16)
    ref = paged_attention.reference_decode_attention(
        q.astype(mx.float32),
        k.astype(mx.float32),
        v.astype(mx.float32),
        tables,
        offsets,
        scale,
        16,
    )
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    err = mx.max(mx.abs(got.astype(mx.float32) - ref)).item()
    assert got.shape == q.shape and got.dtype == dtype
    assert err < tol, err


@pytest.mark.cuda
@pytest.mark.parametrize(
    "B,hq,hkv,d,max_len",
    [(1, 32, 8, 128, 16_384), (3, 32, 8, 128, 5_000), (2, 16, 2, 64, 70_000), (40, 8, 8, 64, 3000)],
)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_split_kernel_matches_gather_path(
    B: int, hq: int, hkv: int, d: int, max_len: int, dtype: mx.Dtype
) -> None:
    """The context split over thread blocks (flash-decoding), rows of 1 key to `max_len`:
    runs of 32-token chunks that end mid-block, and empty runs past a short row's end."""
    q, k, v, tables, offsets = _case(B, hq, hkv, d, dtype, max_len=max_len, seed=B)
    width = tables.shape[1] * 16
    assert paged_attention.split_wanted(B, width)
    assert paged_attention.num_splits(B, hkv, width) > 1
    scale = d**-0.5
    got = paged_attention.paged_decode_attention(q, k, v, tables, offsets, scale, 16, split=True)
    unsplit = paged_attention.paged_decode_attention(q, k, v, tables, offsets, scale, 16)
    f32 = [a.astype(mx.float32) for a in (q, k, v)]
    ref = paged_attention.reference_decode_attention(*f32, tables, offsets, scale, 16)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert got.shape == q.shape and got.dtype == dtype
    assert mx.max(mx.abs(got.astype(mx.float32) - ref)).item() < tol
    assert mx.max(mx.abs(unsplit.astype(mx.float32) - ref)).item() < tol


@pytest.mark.cuda
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("window", [None, 1, 100, 128, 3000])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_windowed_kernel_with_sinks_matches_gather_path(
    split: bool, window: int | None, sinks: bool, dtype: mx.Dtype
) -> None:
    """gpt-oss's attention (64 query heads of 8 KV heads, d 64): sliding windows that
    start mid-chunk (100) and on a chunk's edge (128), a window of the new key alone,
    and sink logits of the scores' scale, unsplit and split over thread blocks (windows
    up to 2,048 keys are never split; 3,000 is)."""
    q, k, v, tables, offsets = _case(3, 64, 8, 64, dtype, max_len=5000, seed=4)
    rng = np.random.default_rng(5)
    s = mx.array(rng.standard_normal(64) * 3, dtype=dtype) if sinks else None
    scale = 0.125
    got = paged_attention.paged_decode_attention(
        q, k, v, tables, offsets, scale, 16, split=split, window=window, sinks=s
    )
    f32 = [a.astype(mx.float32) for a in (q, k, v)]
    s32 = None if s is None else s.astype(mx.float32)
    ref = paged_attention.reference_decode_attention(*f32, tables, offsets, scale, 16, window, s32)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert got.shape == q.shape and got.dtype == dtype
    assert mx.max(mx.abs(got.astype(mx.float32) - ref)).item() < tol


@pytest.mark.cuda
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("window", [100, 1024, 3000])
def test_windowed_kernel_at_gemma3s_head_dim(split: bool, window: int) -> None:
    """Gemma 3's local layers (8 query heads of 4 KV heads, d 256, windows of 1,024 keys, no
    sinks), which take the kernel by default: the widest head the kernel reads."""
    q, k, v, tables, offsets = _case(2, 8, 4, 256, mx.bfloat16, max_len=5000, seed=6)
    scale = 256**-0.5
    got = paged_attention.paged_decode_attention(
        q, k, v, tables, offsets, scale, 16, split=split, window=window
    )
    f32 = [a.astype(mx.float32) for a in (q, k, v)]
    ref = paged_attention.reference_decode_attention(*f32, tables, offsets, scale, 16, window)
    assert got.shape == q.shape and got.dtype == mx.bfloat16
    assert mx.max(mx.abs(got.astype(mx.float32) - ref)).item() < 2e-2


@pytest.mark.parametrize("window", [None, 1, 20])
def test_reference_with_window_and_sinks_is_the_softmax(window: int | None) -> None:
    """The gather path, which the kernel's test holds it to, against attention written
    out in numpy: each row sees its last `window` keys, and each head's softmax has its
    sink logit as one more term."""
    q, k, v, tables, offsets = _case(3, 4, 2, 32, mx.float32, max_len=60, seed=2)
    sinks = np.random.default_rng(1).standard_normal(4).astype(np.float32) * 3
    got = paged_attention.reference_decode_attention(
        q, k, v, tables, offsets, 0.3, 16, window, mx.array(sinks)
    )
    qn, kn, vn, tn = (np.array(a) for a in (q, k, v, tables))
    for b, off in enumerate(np.array(offsets)):
        slots = np.array([tn[b, t // 16] * 16 + t % 16 for t in range(off + 1)])
        lo = 0 if window is None else max(0, off + 1 - window)
        for h in range(4):
            keys, vals = kn[h // 2, slots[lo:]], vn[h // 2, slots[lo:]]
            scores = np.append(keys @ qn[b, h, 0] * 0.3, sinks[h])
            p = np.exp(scores - scores.max())
            want = (p[:-1] / p.sum()) @ vals
            assert np.allclose(np.array(got[b, h, 0]), want, atol=1e-5), (b, h)


def test_split_choice() -> None:
    """Few rows over a long context split it; many rows or short contexts do not, and the
    split count depends on shapes alone (one compiled trace per shape)."""
    assert paged_attention.worth_it(1, 16_384) and paged_attention.split_wanted(1, 16_384)
    assert not paged_attention.worth_it(1, 16_384, split=False)
    assert not paged_attention.split_wanted(1, 1024)
    assert not paged_attention.split_wanted(256, 16_384)
    assert paged_attention.num_splits(1, 8, 16_384) == 64
    assert paged_attention.num_splits(1, 8, 65_536) == 64
    assert paged_attention.num_splits(1, 8, 2304) == 9
    assert paged_attention.num_splits(32, 8, 4096) == 2


@pytest.mark.parametrize("compiled", ["1", "0"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "gemma3", "gpt_oss"])
def test_engine_decode_through_paged_path_matches_gather(
    tiny_models, arch: str, compiled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both with the decode step compiled (`decode_graph`) and built op by op. gemma3
    and gpt_oss have sliding windows (8 keys, shorter than most prompts), gpt_oss
    attention sinks: they take the kernel when it is forced on."""
    monkeypatch.setenv("PIPPIN_COMPILE", compiled)
    loaded = loaded_model(tiny_models(arch, head_dim=32))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 40))] for _ in range(6)]
    forced = "1" if arch in ("gemma3", "gpt_oss") else "auto"

    monkeypatch.setenv("PIPPIN_PAGED_KERNEL", "0")
    monkeypatch.setattr(paged_attention, "force_reference", False)
    monkeypatch.setenv("PIPPIN_FUSED_ATTENTION", "0")  # its own tests: test_fused_attention
    base = greedy_logprobs(loaded, prompts)

    if not device.on_cuda():
        monkeypatch.setattr(paged_attention, "force_reference", True)  # the plumbing only
        name = "reference_decode_attention"
    else:
        name = "paged_decode_attention"
    monkeypatch.setenv("PIPPIN_PAGED_KERNEL", forced)
    calls = 0
    real = getattr(paged_attention, name)

    def counting(*args, **kwargs) -> mx.array:
        nonlocal calls
        calls += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_attention, name, counting)
    paged = greedy_logprobs(loaded, prompts)
    assert calls > 0
    for rid, ref in base.items():
        got = paged[rid]
        assert len(got) == len(ref)
        for (t1, l1), (t2, l2) in zip(got, ref):
            assert t1 == t2 and abs(l1 - l2) < 5e-3, (rid, got, ref)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_next", "gpt_oss"])
def test_kernel_for_windows_by_default_never_for_recurrent_layers(
    tiny_models, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sliding windows and sinks take the kernel by default, as plain KV does, and never
    when it is turned off; recurrent layers never."""
    monkeypatch.setattr(paged_attention, "force_reference", True)
    loaded = loaded_model(tiny_models(arch, head_dim=32))
    taken = {}
    for flag in ("auto", "1", "0"):
        monkeypatch.setenv("PIPPIN_PAGED_KERNEL", flag)
        core = EngineCore(loaded, EngineConfig(num_blocks=64, block_size=4, max_model_len=128))
        taken[flag] = core.runner.paged_kernel
    windowed = arch != "qwen3_next"
    assert taken == {"auto": windowed, "1": windowed, "0": False}


@pytest.mark.parametrize(
    "arch,config",
    [
        ("llama", {}),
        ("gemma3", {}),
        ("llama", {"kv_bits": 8, "kv_group_size": 32}),
        ("gpt_oss", {}),
    ],
)
def test_fresh_prefill_matches_reading_the_pool(
    tiny_models, arch: str, config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fresh prompts (no cached prefix) of different lengths, prefilled together, attend to
    their own keys as computed: the same tokens and logprobs as reading them back from the
    pool. gemma3 and gpt_oss have sliding-window layers, gpt_oss attention sinks; 8-bit KV
    attends to the quantised keys."""
    windowed = arch in ("gemma3", "gpt_oss")
    loaded = loaded_model(tiny_models(arch) if windowed else tiny_models(arch, head_dim=32))
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 200) for _ in range(rng.randrange(2, 40))] for _ in range(6)]
    config = {"max_num_batched_tokens": 512, **config}
    fast = greedy_or_skip(loaded, prompts, **config)
    monkeypatch.setattr(paged_cache, "FRESH_PREFILL", False)
    slow = greedy_logprobs(loaded, prompts, **config)
    assert fast.keys() == slow.keys() == {str(i) for i in range(len(prompts))}
    for rid in fast:
        assert [t for t, _ in fast[rid]] == [t for t, _ in slow[rid]], rid
        assert np.allclose([lp for _, lp in fast[rid]], [lp for _, lp in slow[rid]], atol=2e-3)
