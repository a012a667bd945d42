"""pippin's custom CUDA kernels compile as the engine launches them, on any machine.

The launch code runs for real (the Python that picks each kernel's source, inputs and
template arguments), with `pippin.bench.kernel_compile.Recorder` in place of MLX's kernel
builder; each recorded launch is then compiled with NVRTC for sm_90. A kernel that fails
to build would otherwise show only on a GPU. Whether the kernels compute the right thing is
for the CUDA-only tests (test_paged_attention, test_fused_attention, test_fused_layer,
test_gated_delta).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_fused_attention import _attention, _kernel_path, _Layout, _runner
from test_paged_attention import _case
from test_quant_matmul import MOE_MODELS, quantised_moe

from pippin.bench.kernel_compile import Recorder, compile_launch, nvrtc
from pippin.kernels import device, fused_attention, fused_layer, gated_delta, paged_attention

NVRTC = nvrtc()
needs_nvrtc = pytest.mark.skipif(
    NVRTC is None,
    reason="needs NVIDIA's NVRTC wheels (nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12: "
    "the test extra on Linux x86-64)",
)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(device, "cuda_kernel", rec)
    return rec


def _compile_all(rec: Recorder) -> None:
    assert rec.launches
    assert NVRTC is not None
    for launch in rec.launches:
        block, grid = launch.threadgroup[0], launch.grid[0]
        assert 32 <= block <= 1024 and block % 32 == 0 and grid % block == 0, launch
        ok, log = compile_launch(*NVRTC, launch)
        assert ok, f"{launch.name} {launch.template}:\n{log}"


@needs_nvrtc
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_fused_layer_gemv_compiles(recorder: Recorder, rows: int, dtype: mx.Dtype) -> None:
    """Each projection's form: norm + q/k/v (with a bias), a residual, norm + SwiGLU."""
    k, n = 256, 96
    norm = nn.RMSNorm(k)
    norm.weight = norm.weight.astype(dtype)
    x = mx.zeros((rows, k), dtype=dtype)
    w = mx.zeros((n, k), dtype=dtype)
    fused_layer.gemv(fused_layer.Gemv(w, mx.zeros((n,), dtype=dtype), norm=norm), x)
    fused_layer.gemv(fused_layer.Gemv(w), x, res=mx.zeros((rows, n), dtype=dtype))
    fused_layer.gemv(fused_layer.Gemv(mx.zeros((2 * n, k), dtype=dtype), norm=norm, swiglu=True), x)
    assert [dict(launch.template)["MAXB"] for launch in recorder.launches] == [
        1 if rows == 1 else fused_layer.MAX_ROWS
    ] * 3
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("B,hq,hkv,d", [(3, 32, 8, 64), (2, 16, 2, 128), (2, 8, 1, 256)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_paged_attention_compiles(
    recorder: Recorder, B: int, hq: int, hkv: int, d: int, dtype: mx.Dtype
) -> None:
    q, k, v, tables, offsets = _case(B, hq, hkv, d, dtype)
    paged_attention.paged_decode_attention(q, k, v, tables, offsets, d**-0.5, 16)
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("B,hq,hkv,d", [(1, 32, 8, 128), (2, 16, 2, 64)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_split_paged_attention_compiles(
    recorder: Recorder, B: int, hq: int, hkv: int, d: int, dtype: mx.Dtype
) -> None:
    """The split kernel (grid y = the splits) and the kernel that merges the parts."""
    q, k, v, tables, offsets = _case(B, hq, hkv, d, dtype, max_len=8000)
    paged_attention.paged_decode_attention(q, k, v, tables, offsets, d**-0.5, 16, split=True)
    names = [launch.name for launch in recorder.launches]
    assert names == ["pippin_paged_decode_split", "pippin_paged_decode_combine"]
    assert recorder.launches[0].grid[1] == paged_attention.num_splits(B, hkv, 8000)
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_windowed_paged_attention_with_sinks_compiles(
    recorder: Recorder, split: bool, dtype: mx.Dtype
) -> None:
    """gpt-oss-20b's attention (a sink logit per query head) with its 128-key window,
    never split, and with a window long enough to split."""
    q, k, v, tables, offsets = _case(2, 64, 8, 64, dtype, max_len=8000)
    sinks = mx.zeros((64,), dtype=dtype)
    window = 4096 if split else 128
    paged_attention.paged_decode_attention(
        q, k, v, tables, offsets, 0.125, 16, split=True, window=window, sinks=sinks
    )
    names = [launch.name for launch in recorder.launches]
    split_names = ["pippin_paged_decode_split", "pippin_paged_decode_combine_sinks"]
    assert names == (split_names if split else ["pippin_paged_decode_sinks"])
    assert dict(recorder.launches[0].template)["WIN"] == window
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("window", [1024, 4096])
def test_gemma3s_windowed_paged_attention_compiles(recorder: Recorder, window: int) -> None:
    """Gemma 3's local layers (d 256, a 1,024-key window, no sinks), which take the kernel
    by default, and a window long enough to split."""
    q, k, v, tables, offsets = _case(2, 8, 4, 256, mx.bfloat16, max_len=8000)
    paged_attention.paged_decode_attention(
        q, k, v, tables, offsets, 256**-0.5, 16, split=True, window=window
    )
    assert dict(recorder.launches[0].template)["WIN"] == window
    assert (len(recorder.launches) == 2) == (window > 2048)  # split: blocks, then combine
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("kind", ["llama", "llama3", "traditional", "qwen3"])
@pytest.mark.parametrize("B,hq,hkv,d", [(3, 32, 8, 64), (2, 16, 2, 128)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_fused_attention_compiles(
    recorder: Recorder, kind: str, B: int, hq: int, hkv: int, d: int, dtype: mx.Dtype
) -> None:
    """Every prologue: q/k norms or none, Llama 3's RoPE frequencies, traditional RoPE."""
    attn = _attention(kind, hq, hkv, d, dtype)
    _, k, v, tables, offsets = _case(B, hq, hkv, d, dtype)
    qkv = mx.array(np.zeros((B, 1, (hq + 2 * hkv) * d)), dtype=dtype)
    fused_attention.fused_decode_attention(attn, qkv, [k, v], _Layout(tables, offsets, 16))
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("kind", ["llama3", "qwen3"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_split_fused_attention_compiles(recorder: Recorder, kind: str, dtype: mx.Dtype) -> None:
    """Split over a long context: the fused kernel writing parts, then the merge."""
    B, hq, hkv, d = 1, 32, 8, 128
    attn = _attention(kind, hq, hkv, d, dtype)
    _, k, v, tables, offsets = _case(B, hq, hkv, d, dtype, max_len=8000)
    qkv = mx.array(np.zeros((B, 1, (hq + 2 * hkv) * d)), dtype=dtype)
    lay = _Layout(tables, offsets, 16, split=True)
    fused_attention.fused_decode_attention(attn, qkv, [k, v], lay)
    names = [launch.name for launch in recorder.launches]
    assert names == ["pippin_fused_decode_attention_split", "pippin_paged_decode_combine"]
    _compile_all(recorder)


@needs_nvrtc
def test_warm_builds_every_projection_for_one_row_and_several(
    tiny_models, recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `fused_layer.warm` launches at engine start on CUDA: every projection of every
    layer for one row and for two (MLX builds each distinct template once), and those
    builds compile."""
    _kernel_path(monkeypatch)
    monkeypatch.setenv("PIPPIN_FUSED_LAYER", "all")
    model = _runner(tiny_models("llama", head_dim=32)).model
    fused_layer.warm(model)
    layers = len(model.model.layers)
    assert len(recorder.launches) == layers * 4 * 2  # each projection, one row and two
    forms = {(x.source, tuple(x.template)): x for x in recorder.launches}
    assert {dict(t)["MAXB"] for _, t in forms} == {1, fused_layer.MAX_ROWS}
    recorder.launches = list(forms.values())  # each distinct build compiled once
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("heads", [(16, 32, 128, 128), (2, 4, 64, 32)])
@pytest.mark.parametrize("gates", ["scalar", "vector"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_gated_delta_compiles(
    recorder: Recorder, heads: tuple[int, ...], gates: str, masked: bool, dtype: mx.Dtype
) -> None:
    """The recurrence kernel (`heads`: Hk, Hv, Dk, Dv): scalar gates or a gate per key dim,
    with a padding mask or without, bfloat16 or float32 inputs (the gates and the state
    float32, as mlx-lm makes them)."""
    (hk, hv, dk, dv), B, T = heads, 2, 5
    q = mx.zeros((B, T, hk, dk), dtype=dtype)
    g = mx.ones((B, T, hv, dk) if gates == "vector" else (B, T, hv), dtype=mx.float32)
    mask = mx.ones((B, T), dtype=mx.bool_) if masked else None
    y, state = gated_delta.cuda_recurrence(
        q, q, mx.zeros((B, T, hv, dv), dtype=dtype), g, mx.zeros((B, T, hv), dtype=dtype),
        mx.zeros((B, hv, dv, dk)), mask,
    )  # fmt: skip
    assert y.shape == (B, T, hv, dv) and y.dtype == dtype and state.shape == (B, hv, dv, dk)
    assert ("mask" in recorder.launches[0].input_names) == masked
    _compile_all(recorder)


@needs_nvrtc
def test_a_broken_kernel_does_not_compile(recorder: Recorder) -> None:
    """The check can fail: a source with an undefined name is refused, with NVRTC's log."""
    assert NVRTC is not None
    x = mx.zeros((1, 64), dtype=mx.bfloat16)
    fused_layer.gemv(fused_layer.Gemv(mx.zeros((32, 64), dtype=mx.bfloat16)), x)
    launch = recorder.launches[0]
    launch.source = launch.source.replace("acc[r][b] = 0.f", "acc[r][b] = zero")
    ok, log = compile_launch(*NVRTC, launch)
    assert not ok and '"zero" is undefined' in log


@needs_nvrtc
@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 32), (4, 128), (8, 64)])
@pytest.mark.parametrize("rows", [1, 20, 100])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_quant_matmul_compiles(
    recorder: Recorder, bits: int, group_size: int, rows: int, dtype: mx.Dtype
) -> None:
    """The W4A16 / W8A16 tensor-core product for each row-tile plan (1, 2 and 4 tiles of
    16 rows a block), each packing and each activation dtype."""
    from pippin.kernels import quant_matmul

    k, n = 512, 96
    w, s, b = mx.quantize(mx.zeros((n, k), dtype=dtype), group_size=group_size, bits=bits)
    quant_matmul.qmm(mx.zeros((rows, k), dtype=dtype), w, s, b, group_size, bits)
    (launch,) = recorder.launches
    plan = dict(launch.template)
    assert (plan["MT"], plan["BITS"], plan["GS"]) == (
        1 if rows <= 16 else 2 if rows <= 32 else 4,
        bits,
        group_size,
    )
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("tiles", [(4, 4, 1), (2, 4, 2), (1, 4, 4)])
@pytest.mark.parametrize("bits,mode", [(4, "affine"), (8, "affine"), (4, "mxfp4")])
def test_quant_matmul_with_staged_activations_compiles(
    recorder: Recorder, tiles: tuple[int, int, int], bits: int, mode: str
) -> None:
    """The product with x copied into shared memory a stage ahead (`cp.async`), as
    `bench/gpu/quant_matmul.py --sweep --staged` times it: within the 48 KiB `fits` counts."""
    from pippin.kernels import quant_matmul

    k, n, gs = 2880, 96, 32
    w, s, *b = mx.quantize(mx.zeros((n, k), dtype=mx.bfloat16), group_size=gs, bits=bits, mode=mode)
    assert quant_matmul.fits(tiles, k, bits, staged=True)
    quant_matmul.qmm(
        mx.zeros((40, k), dtype=mx.bfloat16), w, s, b[0] if b else None, gs, bits, tiles, True
    )
    (launch,) = recorder.launches
    assert dict(launch.template)["XS"] is True
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("bits,group_size", [(4, 64), (4, 32), (4, 128), (8, 64), (8, 128)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_quant_matvec_compiles(
    recorder: Recorder, bits: int, group_size: int, dtype: mx.Dtype
) -> None:
    """The 1-16 row product (weights as the MMA's A) for each packing, activation dtype and
    split of K (one warp; several, summed through shared memory)."""
    from pippin.kernels import quant_matvec

    k, n = 1024, 200
    w, s, b = mx.quantize(mx.zeros((n, k), dtype=dtype), group_size=group_size, bits=bits)
    for rows, tiles in ((1, None), (8, (1, 3, 1)), (3, (4, 2, 4)), (12, None), (16, (2, 2, 2))):
        quant_matvec.qmv(mx.zeros((rows, k), dtype=dtype), w, s, b, group_size, bits, tiles)
    plans = [dict(x.template) for x in recorder.launches]
    assert [(p["WK"], p["CT"], p["NB"]) for p in plans][1:] == [
        (1, 1, 1),
        (4, 4, 1),
        (plans[3]["WK"], plans[3]["CT"], 2),
        (2, 2, 2),
    ]
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("bits,group_size", [(4, 64), (8, 64), (4, 32)])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_fused_quant_matvec_compiles(
    recorder: Recorder, bits: int, group_size: int, dtype: mx.Dtype
) -> None:
    """A quantised fused layer's four projections (`quant_matvec.fused`): norm + q/k/v
    (with a bias), o + residual, norm + gate/up + SwiGLU, down + residual."""
    from pippin.kernels import quant_matvec

    k, n = 1024, 200
    eps = mx.array([1e-5], dtype=mx.float32)
    for rows in (1, 8):
        x = mx.zeros((rows, k), dtype=dtype)
        lin = nn.QuantizedLinear(k, n, bias=True, group_size=group_size, bits=bits)
        lin.set_dtype(dtype)
        quant_matvec.fused(x, lin, eps, norm_weight=mx.ones((k,), dtype=dtype))
        quant_matvec.fused(x, lin, eps, res=mx.zeros((rows, n), dtype=dtype))
        quant_matvec.fused(x, lin, eps, norm_weight=mx.ones((k,), dtype=dtype), swiglu=True)
    # Rows too many for shared memory: the norm inside the loop.
    wide = nn.QuantizedLinear(4096, 64, group_size=group_size, bits=bits)
    wide.set_dtype(dtype)
    x = mx.zeros((8, 4096), dtype=dtype)
    quant_matvec.fused(x, wide, eps, norm_weight=mx.ones((4096,), dtype=dtype), swiglu=True)
    plans = [dict(x.template) for x in recorder.launches]
    assert [(p["NORM"], p["SWIGLU"], p["BIAS"], p["RES"]) for p in plans[:3]] == [
        (True, False, True, False),
        (False, False, True, True),
        (True, True, False, False),
    ]
    assert [p["XS"] for p in plans] == [k, 0, k, 8 * k, 0, 8 * k, 0]
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("tokens", [1, 64, 200])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("form", ["gather_qmm", "gather_qmv"])
def test_grouped_quant_matmul_compiles(
    recorder: Recorder, tokens: int, bits: int, form: str
) -> None:
    """The experts' forms (matmul, matvec): token rows gathered (gate/up), pair rows
    scattered (down)."""
    from pippin.kernels import quant_matmul, quant_matvec

    product = getattr(quant_matmul if form == "gather_qmm" else quant_matvec, form)

    e, top_k, k, n = 8, 2, 256, 128
    w, s, b = mx.quantize(mx.zeros((e, n, k), dtype=mx.bfloat16), group_size=64, bits=bits)
    indices = mx.zeros((tokens, top_k), dtype=mx.uint32)
    ids, order = quant_matmul.sort_pairs(indices)
    x = mx.zeros((tokens, k), dtype=mx.bfloat16)
    product(x, w, s, b, ids, order, tokens, 64, bits, True, False)
    pairs = mx.zeros((tokens * top_k, k), dtype=mx.bfloat16)
    product(pairs, w, s, b, ids, order, tokens, 64, bits, False, True)
    assert [dict(x.template)["XG"] for x in recorder.launches] == [True, False]
    assert all(x.grid[1] % e == 0 for x in recorder.launches)
    _compile_all(recorder)


@needs_nvrtc
def test_mxfp4_products_compile(recorder: Recorder) -> None:
    """MXFP4 weights (uint8 exponents, no biases; bf16 activations) in every form: the
    matmul at 1-4 row tiles, the matvec at one and two 8-row operands, both grouped forms
    gathering token rows and scattering pair rows."""
    from pippin.kernels import quant_matmul, quant_matvec

    k, n = 512, 96
    w, s = mx.quantize(mx.zeros((n, k), dtype=mx.bfloat16), group_size=32, bits=4, mode="mxfp4")
    for rows in (1, 20, 100):
        quant_matmul.qmm(mx.zeros((rows, k), dtype=mx.bfloat16), w, s, None, 32, 4)
    for rows in (1, 12):
        quant_matvec.qmv(mx.zeros((rows, k), dtype=mx.bfloat16), w, s, None, 32, 4)
    e, top_k, tokens = 8, 2, 5
    we, se = mx.quantize(
        mx.zeros((e, n, k), dtype=mx.bfloat16), group_size=32, bits=4, mode="mxfp4"
    )
    ids, order = quant_matmul.sort_pairs(mx.zeros((tokens, top_k), dtype=mx.uint32))
    for product in (quant_matmul.gather_qmm, quant_matvec.gather_qmv):
        x = mx.zeros((tokens, k), dtype=mx.bfloat16)
        product(x, we, se, None, ids, order, tokens, 32, 4, True, False)
        pairs = mx.zeros((tokens * top_k, k), dtype=mx.bfloat16)
        product(pairs, we, se, None, ids, order, tokens, 32, 4, False, True)
    assert len(recorder.launches) == 9
    assert all(dict(x.template)["MX"] for x in recorder.launches)
    # No biases: the scales' uint8 stands in.
    assert all(x.input_dtypes[2:4] == [mx.uint8, mx.uint8] for x in recorder.launches)
    _compile_all(recorder)


@needs_nvrtc
@pytest.mark.parametrize("arch", sorted(MOE_MODELS))
def test_warm_builds_each_quantised_template_once(
    tiny_models, recorder: Recorder, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """What `patches.warm_quantised` launches at engine start on CUDA for a quantised MoE
    model (`MOE_MODELS`: affine 4-bit Qwen3-MoE and Qwen3-Next; gpt-oss's MXFP4 experts):
    each distinct template of its dense layers and of its experts, once, for every row
    count below the dense path's bound; every build compiles."""
    from pippin.kernels import patches, quant_matmul

    monkeypatch.setattr(device, "on_cuda", lambda: True)
    model = quantised_moe(tiny_models, arch)
    swapped = patches.quantised_experts(model)
    assert swapped
    patches.quantised_products(model, 64, kernel=True)
    patches.warm_quantised(model, 64)
    names = {x.name for x in recorder.launches}
    assert names == {
        "pippin_quant_matmul",
        "pippin_quant_matvec",
        "pippin_gather_quant_matmul",
        "pippin_gather_quant_matvec",
    }
    templates = [(x.name, tuple(x.template)) for x in recorder.launches]
    assert len(set(templates)) == len(templates)  # none built twice
    dense = [dict(x.template) for x in recorder.launches if x.name == "pippin_quant_matmul"]
    assert {t["MT"] for t in dense} == {1, 2, 4}  # 1-16, 17-32 and 33-63 rows
    assert quant_matmul.MAX_ROWS >= 64
    grouped = [dict(x.template) for x in recorder.launches if "gather" in x.name]
    assert {t["MX"] for t in grouped} == {MOE_MODELS[arch][1] == "mxfp4"}
    patches.undo(model)
    _compile_all(recorder)


@pytest.mark.parametrize("arch", sorted(MOE_MODELS))
def test_a_long_prompt_chunk_takes_the_grouped_kernel_with_warmed_templates(
    tiny_models, recorder: Recorder, monkeypatch: pytest.MonkeyPatch, arch: str
) -> None:
    """A prompt chunk of 1,000 tokens (once past the kernel's 256-token bound) runs its
    experts through the grouped kernel, not MLX's `gather_qmm` (about 1,000 prompt tokens/s
    for gpt-oss-20b on an H100), with templates the warm-up has already built."""
    from pippin.kernels import moe_quant, patches

    monkeypatch.setattr(device, "on_cuda", lambda: True)
    model = quantised_moe(tiny_models, arch)
    assert patches.quantised_experts(model)
    moe_quant.warm(model, model.args.num_experts_per_tok)
    warmed = {(x.name, tuple(x.template)) for x in recorder.launches}
    recorder.launches.clear()
    monkeypatch.setattr(mx, "gather_qmm", None)  # any call of it fails
    tokens = mx.random.randint(3, model.args.vocab_size, (1, 1000), key=mx.random.key(0))
    mx.eval(model(tokens))
    grouped = [x for x in recorder.launches if x.name == "pippin_gather_quant_matmul"]
    assert len(grouped) == 3 * model.args.num_hidden_layers  # gate, up, down
    assert {(x.name, tuple(x.template)) for x in grouped} <= warmed
    patches.undo(model)


def test_a_grid_beyond_cuda_limit_is_refused() -> None:
    """512 experts (Qwen3-Next) and a chunk of 8,192 tokens would need 65,536 rows of
    blocks, one past CUDA's grid (`moe_quant.call` then runs the chunk in pieces)."""
    from pippin.kernels import quant_matmul

    assert quant_matmul.gather_fits(8192 * 10, 512, 512, 2048, 4, 4096)
    assert not quant_matmul.gather_fits(8192 * 10, 512, 512, 2048, 4, 8192)
