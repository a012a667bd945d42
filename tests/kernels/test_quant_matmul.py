"""The W4A16 / W8A16 tensor-core product (`kernels.quant_matmul`) against MLX's own
`quantized_matmul`, on CUDA, for every plan the kernel picks (1, 2 and 4 row tiles, 4
column tiles, 1-8 warps on K), every packing it takes and both activation dtypes; and
where it declines a layer (off CUDA the layers keep MLX's product: `test_dense_quant`)."""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from pippin.kernels import quant_matmul, quant_matvec

Packed = tuple[mx.array, mx.array, mx.array | None]


def _case(
    n: int, k: int, bits: int, gs: int, dtype: mx.Dtype, seed: int = 0, mode: str = "affine"
) -> Packed:
    """(weights, scales, biases) of a random [n, k] weight; MXFP4 has no biases (None)."""
    key = mx.random.key(seed)
    w = (mx.random.normal((n, k), key=key) * 0.05).astype(dtype)
    wq, s, *b = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
    return wq, s, (b[0] if b else None)


def _exact(wq: mx.array, s: mx.array, b: mx.array | None, gs: int, bits: int) -> mx.array:
    """The quantised weights in float32, unrounded (MXFP4: uint8 exponents for scales)."""
    if s.dtype == mx.uint8:
        return mx.dequantize(wq, s, None, gs, bits, mode="mxfp4", dtype=mx.float32)
    return mx.dequantize(wq, s.astype(mx.float32), b.astype(mx.float32), gs, bits)  # type: ignore[union-attr]


def _check(
    m: int,
    n: int,
    k: int,
    bits: int,
    gs: int,
    dtype: mx.Dtype,
    product=quant_matmul.qmm,  # type: ignore[no-untyped-def]
    mode: str = "affine",
) -> None:
    """`product` (`qmm`'s arguments) against the exact product of the same quantised
    weights, no further off than twice MLX's own error plus 1% of the largest output."""
    wq, s, b = _case(n, k, bits, gs, dtype, mode=mode)
    x = mx.random.normal((m, k), key=mx.random.key(m)).astype(dtype)
    got = product(x, wq, s, b, gs, bits).astype(mx.float32)
    ref = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=gs, bits=bits, mode=mode)
    # The exact product of the same quantised weights, in float32.
    w32 = _exact(wq, s, b, gs, bits)
    exact = np.array(x.astype(mx.float32) @ w32.T)
    err = np.abs(np.array(got) - exact).max()
    mlx_err = np.abs(np.array(ref.astype(mx.float32)) - exact).max()
    scale = np.abs(exact).max()
    assert got.shape == (m, n)
    assert err <= 2 * mlx_err + 0.01 * scale, (m, n, k, bits, gs, dtype, err, mlx_err, scale)


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 3, 16, 17, 32, 40, 64, 100, 256])
@pytest.mark.parametrize("bits,gs", [(4, 64), (8, 64)])
def test_every_row_plan(m: int, bits: int, gs: int) -> None:
    _check(m, 200, 1024, bits, gs, mx.bfloat16)  # 200 columns: a partial column tile


STAGED = [(4, 4, 1), (2, 4, 2), (1, 4, 4), (1, 2, 2)]  # tilings with x staged that fit


@pytest.mark.cuda
@pytest.mark.parametrize("tiles", STAGED)
@pytest.mark.parametrize("bits", [4, 8])
def test_activations_staged_in_shared_memory(tiles: tuple[int, int, int], bits: int) -> None:
    """x copied into shared memory a stage ahead (`staged`, as `--sweep --staged` times
    it): rows past the tile's, a partial column tile, K ending mid-iteration (2,880 at 4
    bits, 2,848 at 8), fp16 too."""
    staged = partial(quant_matmul.qmm, tiles=tiles, staged=True)
    k = 2880 if bits == 4 else 2848
    assert quant_matmul.fits(tiles, k, bits, staged=True)
    for m in (1, 17, 40, 64):
        _check(m, 200, 1024, bits, 64, mx.bfloat16, staged)
    _check(24, 96, k, bits, 32, mx.bfloat16, staged)
    _check(33, 96, 512, bits, 64, mx.float16, staged)
    if bits == 4:
        _check(24, 96, 512, 4, 32, mx.bfloat16, staged, mode="mxfp4")


@pytest.mark.cuda
@pytest.mark.parametrize("bits,gs", [(4, 32), (4, 128), (8, 32), (8, 128)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_every_packing_and_dtype(bits: int, gs: int, dtype: mx.Dtype) -> None:
    for m in (1, 24, 80):
        _check(m, 96, 512, bits, gs, dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("product", [quant_matmul.qmm, quant_matvec.qmv])
def test_k_ending_mid_iteration(product) -> None:  # type: ignore[no-untyped-def]
    """K not a multiple of a warp's k: gpt-oss-20b's 2,880 (22.5 x 128 at 4 bits; MXFP4
    too) and 2,848 at 8 bits (44.5 x 64)."""
    for m in (1, 12):
        _check(m, 96, 2880, 4, 64, mx.bfloat16, product)
        _check(m, 96, 2880, 4, 32, mx.bfloat16, product, mode="mxfp4")
        _check(m, 96, 2848, 8, 32, mx.bfloat16, product)


@pytest.mark.cuda
def test_mxfp4() -> None:
    """gpt-oss's packing: E2M1 nibbles, a power-of-two exponent per 32, bf16 activations."""
    for m in (1, 24, 80):
        _check(m, 96, 512, 4, 32, mx.bfloat16, mode="mxfp4")


def _byte_perm(x: int, y: int, s: np.ndarray) -> np.ndarray:
    """CUDA's `__byte_perm(x, y, s)`: byte i of the result is byte (s >> 4i) & 7 of y:x."""
    pool = np.frombuffer((x | y << 32).to_bytes(8, "little"), dtype=np.uint8).astype(np.uint32)
    out = np.zeros_like(s)
    for i in range(4):
        out |= pool[(s >> (4 * i)) & 7] << (8 * i)
    return out


def test_mxfp4_lookup_gives_mlx_values() -> None:
    """`pippin_fp4_pair`'s integer steps, done here in numpy with the tables the kernel is
    built with (`FP4_LO`, `FP4_HI`), give every E2M1 nibble's value as MLX dequantises it:
    nibbles p and p + 4 of each word as the (low, high) bf16 pair, before the scale."""
    words = np.random.default_rng(0).integers(0, 2**32, size=(64, 4), dtype=np.uint32)
    one = mx.full((64, 1), 127, dtype=mx.uint8)  # each group's scale 2^0
    fp4 = mx.dequantize(mx.array(words), one, None, 32, 4, mode="mxfp4", dtype=mx.float32)
    want = np.array(fp4).reshape(-1, 8)  # a word's 8 nibbles
    words = words.reshape(-1)
    assert len(np.unique(want)) == 15  # every value (+0 and -0 alike)
    for p in range(4):
        v = (words >> (4 * p)) & 0x00070007
        bits = (
            _byte_perm(*quant_matmul.FP4_LO, v | (v >> 8))
            | _byte_perm(*quant_matmul.FP4_HI, (v << 4) | (v >> 4))
            | ((words << (12 - 4 * p)) & 0x80008000)
        )
        # A bf16 is the high half of a float32.
        assert np.array_equal(((bits & 0xFFFF) << 16).view(np.float32), want[:, p]), p
        assert np.array_equal((bits & 0xFFFF0000).view(np.float32), want[:, p + 4]), p


@pytest.mark.cuda
@pytest.mark.parametrize("n,k", [(4096, 4096), (28672, 4096), (4096, 14336), (1024, 128)])
def test_model_shapes(n: int, k: int) -> None:
    """The 8B shape's projections (many blocks: few warps on K) and a short K (one
    iteration: one warp)."""
    for m in (1, 8, 64):
        _check(m, n, k, 4, 64, mx.bfloat16)


@pytest.mark.cuda
def test_rows_of_a_batch_are_independent() -> None:
    """A row's result does not depend on the rows beside it (the tiles' padding rows read
    as zeros and are never written)."""
    wq, s, b = _case(160, 512, 4, 64, mx.bfloat16)
    x = mx.random.normal((37, 512)).astype(mx.bfloat16)
    full = np.array(quant_matmul.qmm(x, wq, s, b, 64, 4).astype(mx.float32))
    for i in (0, 16, 36):
        one = np.array(quant_matmul.qmm(x[i : i + 1], wq, s, b, 64, 4).astype(mx.float32))
        assert np.allclose(one[0], full[i], atol=1e-2), i


def test_applies_only_where_the_kernel_computes_it() -> None:
    def layer(bits: int, gs: int, k: int = 256, dtype: mx.Dtype = mx.bfloat16) -> nn.Module:
        lin = nn.Linear(k, 64, bias=False)
        lin.set_dtype(dtype)
        return nn.QuantizedLinear.from_linear(lin, group_size=gs, bits=bits)

    assert quant_matmul.applies(layer(4, 64), mx.bfloat16)
    assert quant_matmul.applies(layer(8, 32), mx.bfloat16)
    assert quant_matmul.applies(layer(4, 64, dtype=mx.float16), mx.float16)
    assert not quant_matmul.applies(layer(4, 64), mx.float16)  # scales of another dtype
    assert not quant_matmul.applies(layer(4, 64, dtype=mx.float32), mx.float32)
    assert not quant_matmul.applies(layer(3, 64), mx.bfloat16)
    assert quant_matmul.applies(layer(4, 64, k=192), mx.bfloat16)  # K ends mid-iteration
    assert not quant_matmul.applies(nn.Linear(256, 64), mx.bfloat16)
    # MXFP4: group 32, 4 bits, bf16 activations only (uint8 exponents for scales).
    lin = nn.Linear(256, 64, bias=False)
    lin.set_dtype(mx.bfloat16)
    fp4 = nn.QuantizedLinear.from_linear(lin, group_size=32, bits=4, mode="mxfp4")
    assert quant_matmul.activations(fp4) == mx.bfloat16
    assert quant_matmul.applies(fp4, mx.bfloat16)
    assert not quant_matmul.applies(fp4, mx.float16)
    fp8 = nn.QuantizedLinear.from_linear(lin, group_size=32, bits=8, mode="mxfp8")
    assert not quant_matmul.applies(fp8, mx.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("bits", [4, 8])
def test_patched_model_on_cuda_takes_the_kernel_and_stays_as_close_to_exact(
    tiny_models, bits: int
) -> None:
    """A quantised tiny Llama in bf16, decode-shaped input (5 rows of one token): the
    kernel's logits are as close to the exact (float32) ones as MLX's quantised matmul's,
    and `undo` gives MLX's back."""
    from support.engine_runs import loaded_model

    from pippin.kernels import dense_quant, patches
    from pippin.kernels.config import KernelConfig

    model = loaded_model(tiny_models("llama")).model
    nn.quantize(model, group_size=64, bits=bits)
    model.set_dtype(mx.bfloat16)
    tokens = mx.random.randint(3, model.args.vocab_size, (5, 1), key=mx.random.key(1))
    model.set_dtype(mx.float32)
    exact = np.array(model(tokens))
    model.set_dtype(mx.bfloat16)
    mlx = np.array(model(tokens).astype(mx.float32))
    patched = patches.apply(model, KernelConfig(), {}, {}, None)
    assert patched.quant_kernel > 0
    assert any(getattr(m, dense_quant.KERNEL_ATTR, None) for _, m in model.named_modules())
    ours = np.array(model(tokens).astype(mx.float32))
    patches.undo(model)
    assert np.array_equal(np.array(model(tokens).astype(mx.float32)), mlx)
    mlx_err, our_err = (np.abs(y - exact).max() for y in (mlx, ours))
    assert our_err <= 1.5 * mlx_err + 0.01 * np.abs(exact).max()
    top = exact.argmax(-1)
    assert (ours.argmax(-1) == top).mean() >= (mlx.argmax(-1) == top).mean() - 0.2


# (bits, group size, mode) of experts: MLX affine at 4 and 8 bits, gpt-oss's MXFP4.
EXPERT_PACKINGS = [(4, 64, "affine"), (8, 64, "affine"), (4, 32, "mxfp4")]


def _experts(e: int, n: int, k: int, bits: int, gs: int, mode: str) -> Packed:
    w = (mx.random.normal((e, n, k), key=mx.random.key(e)) * 0.05).astype(mx.bfloat16)
    wq, s, *b = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
    return wq, s, (b[0] if b else None)


@pytest.mark.cuda
@pytest.mark.parametrize("tokens", [1, 5, 40, 130])
@pytest.mark.parametrize("bits,gs,mode", EXPERT_PACKINGS)
@pytest.mark.parametrize("product", [quant_matmul.gather_qmm, quant_matvec.gather_qmv])
def test_grouped_product_matches_gather_qmm(
    tokens: int, bits: int, gs: int, mode: str, product
) -> None:  # type: ignore[no-untyped-def]
    """Each token's rows through its top-k experts: the token rows gathered (gate/up) and
    the pair rows scattered back (down), against `mx.gather_qmm` on the same pairs; both
    forms (the matvec one in blocks of 8 or 16 pairs of an expert)."""
    _check_grouped(tokens, bits, gs, mode, product)


@pytest.mark.cuda
@pytest.mark.parametrize("bits,gs,mode", [(4, 64, "affine"), (4, 32, "mxfp4")])
@pytest.mark.parametrize("product", [quant_matmul.gather_qmm, quant_matvec.gather_qmv])
def test_grouped_product_at_gpt_oss_width(bits: int, gs: int, mode: str, product) -> None:  # type: ignore[no-untyped-def]
    """gpt-oss-20b's experts: K = 2,880 ends halfway through a warp's 128 k."""
    for tokens in (1, 9):
        _check_grouped(tokens, bits, gs, mode, product, k=2880, mid=2880)


# (experts, hidden, expert width, top k) of the MoE models users serve.
MOE_SHAPES = {
    "gpt-oss-20b": (32, 2880, 2880, 4),
    "Qwen3-30B-A3B": (128, 2048, 768, 8),
    "Qwen3-Next-80B-A3B": (512, 2048, 512, 10),
}


@pytest.mark.parametrize("name", sorted(MOE_SHAPES))
@pytest.mark.parametrize("bits", [4, 8])
def test_a_chunk_of_cuda_default_size_fits_the_grid(name: str, bits: int) -> None:
    """A prompt chunk of 8,192 tokens (CUDA's default) runs its experts' products in the
    grouped kernel at once, its blocks within CUDA's grid, except for Qwen3-Next's 512
    experts, whose chunk runs in halves (`moe_quant.call`); `moe_quant.warm` builds the
    templates of calls to twice that size."""
    from pippin.kernels import moe_quant

    e, hidden, mid, top_k = MOE_SHAPES[name]
    for n, k in ((mid, hidden), (hidden, mid)):  # gate and up, down
        assert quant_matmul.gather_fits(4096 * top_k, e, n, k, bits, 4096)
        fits = quant_matmul.gather_fits(8192 * top_k, e, n, k, bits, 8192)
        assert fits == (e < 512), (n, k)
    assert moe_quant.WARM_TOKENS >= 2 * 8192


@pytest.mark.cuda
@pytest.mark.parametrize("bits,gs,mode", [(4, 64, "affine"), (4, 32, "mxfp4")])
def test_grouped_product_on_a_long_prompt_chunk(bits: int, gs: int, mode: str) -> None:
    """A prompt chunk of 1,100 tokens (4,400 pairs over 16 experts; an expert's pairs in up
    to 18 blocks of 64): `moe_quant` sends chunks of any size to the matmul form, no longer
    only up to 256 tokens."""
    _check_grouped(1100, bits, gs, mode, quant_matmul.gather_qmm)


def _check_grouped(  # type: ignore[no-untyped-def]
    tokens: int, bits: int, gs: int, mode: str, product, k: int = 256, mid: int = 256
) -> None:
    """`_check`'s measure for the grouped forms: k -> mid (gate/up), mid -> 128 (down)."""
    e, top_k = 16, 4
    q = {"group_size": gs, "bits": bits, "mode": mode}
    wq, s, b = _experts(e, mid, k, bits, gs, mode)
    x = mx.random.normal((tokens, k), key=mx.random.key(3)).astype(mx.bfloat16)
    # Distinct experts per token, as a router's top-k gives them (some experts idle).
    scores = mx.random.normal((tokens, e), key=mx.random.key(4))
    indices = mx.argpartition(-scores, kth=top_k - 1, axis=-1)[:, :top_k].astype(mx.uint32)
    ref = mx.gather_qmm(x[:, None, None, :], wq, s, b, rhs_indices=indices, transpose=True, **q)
    ref = np.array(ref.reshape(tokens * top_k, mid).astype(mx.float32))  # [tokens, top_k, 1, mid]
    ids, order = quant_matmul.sort_pairs(indices)
    # Gate/up: token rows in, sorted pair rows out.
    sorted_out = product(x, wq, s, b, ids, order, tokens, gs, bits, True, False)
    back = np.empty_like(ref)
    back[np.array(order)] = np.array(sorted_out.astype(mx.float32))
    scale = np.abs(ref).max()
    assert np.abs(back - ref).max() <= 0.02 * scale
    # Down: sorted pair rows in, rows in the pairs' own order out.
    pairs = mx.array(back, dtype=mx.bfloat16)[order]  # the inputs, in sorted order
    wq2, s2, b2 = _experts(e, 128, mid, bits, gs, mode)
    got = product(pairs, wq2, s2, b2, ids, order, tokens, gs, bits, False, True)
    want = mx.gather_qmm(
        mx.array(back, dtype=mx.bfloat16).reshape(tokens, top_k, 1, mid),
        wq2,
        s2,
        b2,
        rhs_indices=indices,
        transpose=True,
        **q,
    ).reshape(tokens * top_k, 128)
    want = np.array(want.astype(mx.float32))
    assert np.abs(np.array(got.astype(mx.float32)) - want).max() <= 0.02 * np.abs(want).max()


# Tiny MoE models at widths the grouped kernel takes, and how each is quantised: Qwen3-MoE
# MLX affine 4-bit; gpt-oss as mlx-community ships it (MXFP4 experts, the rest 8-bit), 320
# wide so that K ends mid-iteration as gpt-oss-20b's 2,880 does.
MOE_MODELS = {
    "qwen3_moe": ({"hidden_size": 256, "moe_intermediate_size": 128}, None),
    # The hybrid: gated-delta layers and a shared expert beside the routed ones.
    "qwen3_next": (
        {"hidden_size": 256, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128},
        None,
    ),
    "gpt_oss": ({"hidden_size": 320, "intermediate_size": 320}, "mxfp4"),
}


def quantised_moe(tiny_models, arch: str) -> nn.Module:  # type: ignore[no-untyped-def]
    """`MOE_MODELS[arch]` loaded and quantised, in bf16."""
    from support.engine_runs import loaded_model

    from pippin.bench.models import mxfp4_experts

    sizes, packing = MOE_MODELS[arch]
    model = loaded_model(tiny_models(arch, **sizes)).model
    if packing == "mxfp4":
        nn.quantize(model, class_predicate=mxfp4_experts)
    else:
        nn.quantize(model, group_size=64, bits=4)
    model.set_dtype(mx.bfloat16)
    return model


@pytest.mark.cuda
@pytest.mark.parametrize("arch", sorted(MOE_MODELS))
def test_moe_model_takes_the_grouped_kernel_and_keeps_its_logits(
    tiny_models, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A quantised tiny MoE (`MOE_MODELS`): the patched `SwitchGLU` runs, and its logits
    stay as close to the exact ones as mlx-lm's `gather_qmm`'s.

    Both references run on the CPU: on an H100 MLX's own forward of these models gave NaN
    in some runs (bf16 at 5 decode rows, even float32 over a 24-token chunk), and finite
    logits in others."""
    from pippin.kernels import patches
    from pippin.kernels.config import KernelConfig

    # Only the templates these shapes take are built: the start-up warm-up builds every
    # template for 1-256 tokens (NVRTC, on the host: it made this the slowest of the
    # `cuda_fast` set), and its launches are checked on the CPU
    # (test_cuda_kernels_compile.py, `test_warm_builds_each_quantised_template_once`).
    monkeypatch.setattr(patches, "warm_quantised", lambda model, rows: None)

    model = quantised_moe(tiny_models, arch)
    vocab = model.args.vocab_size
    for shape in ((5, 1), (1, 24)):  # a decode batch, a prompt chunk
        tokens = mx.random.randint(3, vocab, shape, key=mx.random.key(2))
        weights = model.parameters()
        with mx.stream(mx.cpu):
            model.set_dtype(mx.float32)
            exact = np.array(model(tokens))
            model.update(weights)
            mlx = np.array(model(tokens).astype(mx.float32))
        patched = patches.apply(model, KernelConfig(moe_kernel="1"), {}, {}, None)
        assert patched.moe_kernel
        ours = np.array(model(tokens).astype(mx.float32))
        patches.undo(model)
        mlx_err, our_err = (np.abs(y - exact).max() for y in (mlx, ours))
        assert our_err <= 1.5 * mlx_err + 0.01 * np.abs(exact).max(), shape


def _grouped_reference(  # type: ignore[no-untyped-def]
    x, w, scales, biases, ids, order, tokens, gs, bits, gather_x, scatter_out
) -> mx.array:
    """What `quant_matmul.gather_qmm` and `quant_matvec.gather_qmv` compute, in MLX ops:
    the CUDA kernels' stand-in on the CPU."""
    mxfp4 = scales.dtype == mx.uint8
    w = mx.dequantize(
        w,
        scales,
        None if mxfp4 else biases,
        group_size=gs,
        bits=bits,
        mode="mxfp4" if mxfp4 else "affine",
    )
    rows = x[order // (ids.size // x.shape[0])] if gather_x else x
    y = (rows[:, None, :] @ w[ids].swapaxes(-1, -2))[:, 0]
    return y[mx.argsort(order)] if scatter_out else y


@pytest.mark.parametrize("arch", sorted(MOE_MODELS))
def test_a_chunk_beyond_the_grid_runs_in_pieces(
    tiny_models, arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A prompt chunk whose grouped products would need more rows of blocks than CUDA's
    grid has (512 experts at 8,192 tokens) runs its experts in pieces that fit, each through
    the kernel, with the logits of the whole chunk run at once (the kernels' MLX stand-in
    on the CPU); one MoE block through the stand-in agrees with mlx-lm's own."""
    from pippin.kernels import patches

    model = quantised_moe(tiny_models, arch)
    calls: list[int] = []

    def reference(x, w, *args):  # type: ignore[no-untyped-def]
        calls.append(args[3].size)  # ids: the call's pairs
        return _grouped_reference(x, w, *args)

    monkeypatch.setattr(quant_matmul, "gather_qmm", reference)
    monkeypatch.setattr(quant_matvec, "gather_qmv", reference)
    assert patches.quantised_experts(model)
    tokens = mx.random.randint(3, model.args.vocab_size, (1, 150), key=mx.random.key(5))
    top_k = model.args.num_experts_per_tok
    layers = model.args.num_hidden_layers
    try:
        whole = np.array(model(tokens).astype(mx.float32))
        assert calls == [150 * top_k] * 3 * layers
        calls.clear()
        block = next(m for _, m in model.named_modules() if hasattr(m, "_pippin_plan"))
        e = block.gate_proj["weight"].shape[0]
        monkeypatch.setattr(quant_matmul, "GRID_Y", 2 * e)  # 2 chunks of an expert's pairs
        pieces = np.array(model(tokens).astype(mx.float32))
        assert len(calls) > 3 * layers and sum(calls) == 150 * top_k * 3 * layers
        x = mx.random.normal((150, quant_matmul.in_features(block.gate_proj)), key=mx.random.key(0))
        x = x.astype(mx.bfloat16)
        scores = mx.random.normal((150, e), key=mx.random.key(6))
        indices = mx.argpartition(-scores, kth=top_k - 1, axis=-1)[:, :top_k].astype(mx.uint32)
        before = len(calls)
        ours = np.array(block(x, indices).astype(mx.float32))
        assert len(calls) > before  # through the kernels' stand-in (in pieces), not mlx-lm's
        theirs = np.array(block._pippin_base.__call__(block, x, indices).astype(mx.float32))
        block.set_dtype(mx.float32)
        exact = np.array(block._pippin_base.__call__(block, x.astype(mx.float32), indices))
    finally:
        patches.undo(model)
    assert np.allclose(pieces, whole, atol=1e-2 * np.abs(whole).max())
    # Against the exact (float32) block, as close as mlx-lm's bf16 path: a misplaced row
    # would be off by its whole size.
    our_err, their_err = (np.abs(y - exact).max() for y in (ours, theirs))
    assert our_err <= 1.5 * their_err + 0.01 * np.abs(exact).max()
