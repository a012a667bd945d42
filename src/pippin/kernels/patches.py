"""Every change pippin makes to mlx-lm's model code: in this module only, behind one
switch, and undone by one call.

pippin runs mlx-lm's model classes as they ship; to make them fast on a GPU it changes
a loaded model's live objects (never mlx-lm's source), in this order:

1. `fuse_projections`: each layer's q/k/v and gate/up projections become parts of one
   matmul each (`fused_proj`): the attributes are replaced by `fused_proj.Part`s.
2. `route_attention`: the `scaled_dot_product_attention` bound in each of the model's
   mlx-lm modules is wrapped. Decode batches that opted in run `paged_attention`'s
   kernel, prompt chunks `prefill_attention`'s composed path where it applies, every
   other call mlx-lm's own function.
3. `fuse_attention`: the Llama/Qwen2/Qwen3 attention modules' class becomes a subclass
   whose ``__call__`` is `fused_attention.call` (norms, RoPE, KV write and attention in
   one kernel for decode batches that opted in, mlx-lm's own otherwise).
4. `fuse_layers`: their transformer blocks' class likewise, with `fused_layer.call`.
5. `select_head_rows`: the final norm's class becomes one that keeps only the positions
   that sample, so the LM head skips the others (`head_rows`).
6. `quantised_products`: affine `nn.QuantizedLinear`s (the fused ones too) become a
   subclass that runs inputs of many rows (prompt chunks) through the unpacked weight
   and a dense matmul, few rows (decode) on CUDA through pippin's tensor-core kernel
   (`quant_matmul`), elsewhere through MLX's quantised product (`dense_quant`); on CUDA
   mixture-of-experts MLPs (`SwitchGLU`) with such experts run them through the kernel's
   grouped form (`moe_quant`).
7. On the CPU, prompt chunks' attention (through the routing of 2.) and the `swiglu`
   bound in each of the model's mlx-lm modules run in numpy (`cpu_prefill`).
8. `route_gated_delta`: the `gated_delta_update` bound in each of the model's mlx-lm
   modules (Qwen3-Next/3.5, Kimi Linear, ...) is wrapped: on CUDA one kernel a call, on
   the CPU prompt chunks in numpy's chunked form (`gated_delta`).

`apply` makes the changes a `KernelConfig` allows; with ``enabled=False`` (`pippin serve
--no-kernels`) it makes none, and the model runs exactly as mlx-lm ships it (the paged
KV views still feed it; they are not a patch, they are the cache interface mlx-lm's
models take). `undo` takes every change back.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pippin.kernels import (
    cpu_prefill,
    dense_quant,
    device,
    fused_attention,
    fused_layer,
    fused_proj,
    gated_delta,
    head_rows,
    moe_quant,
    paged_attention,
    prefill_attention,
    quant_matmul,
    quant_matvec,
)
from pippin.kernels.config import KernelConfig

log = logging.getLogger(__name__)

# The attribute each class swap leaves on a module, and on its subclass the base class.
_PLAN_ATTRS = (
    "_pippin_fused",
    "_pippin_plan",
    dense_quant.ROWS_ATTR,
    dense_quant.KERNEL_ATTR,
    dense_quant.MATVEC_ATTR,
)
_BASE = "_pippin_base"
_ORIGINAL = "_pippin_original"  # on a wrapped function: mlx-lm's own


@dataclass
class Patched:
    """What `apply` changed, as the model runner needs to know it."""

    paged_kernel: bool = False  # decode batches may take the paged kernel
    fused_attention: bool = False
    fused_layer: bool = False
    head: head_rows.HeadRows | None = None
    dense_quant: int = 0  # quantised layers whose prompt chunks take the dense product
    quant_kernel: int = 0  # quantised layers whose decode rows take `quant_matmul`
    moe_kernel: bool = False  # quantised experts through `quant_matmul.gather_qmm`


def apply(
    model: nn.Module,
    config: KernelConfig,
    specs: dict[int, Any],
    state_sizes: dict[int, int],
    kv_bits: int | None,
) -> Patched:
    """Make the changes `config` allows to `model`, whose attention layers have the KV
    `specs` and recurrent layers `state_sizes` (the model runner's probe)."""
    out = Patched()
    if not config.enabled:
        undo(model)  # an earlier engine in this process may have changed it
        return out
    if config.fused_proj:
        fuse_projections(model)  # q/k/v and gate/up: one matmul each
    # The paged kernel reads full-precision pools only.
    out.paged_kernel = not kv_bits and paged_attention.enabled_for(
        model, specs, state_sizes, config.paged_kernel
    )
    on_host = cpu_prefill.wanted(config.cpu_prefill)
    _unroute(model)  # an earlier engine on this model may have routed it
    if out.paged_kernel or on_host or prefill_attention.wanted(config.prefill_attention):
        # False when no module calls mlx-lm's shared attention: nothing to route.
        routed = route_attention(model, config.prefill_attention, on_host)
        out.paged_kernel = routed and out.paged_kernel
    if on_host:
        route_swiglu(model)
    if config.gated_delta and (on_host or device.on_cuda()):
        route_gated_delta(model, on_host)
    if out.paged_kernel and config.fused_attention:
        out.fused_attention = fuse_attention(model)
    if out.fused_attention and config.fused_layer != "0":
        out.fused_layer = fuse_layers(model, config.fused_layer)
    if config.head_rows:
        out.head = select_head_rows(model)
    dense = dense_quant.wanted(config.dense_quant)
    kernel = config.quant_kernel != "0" and device.on_cuda()  # the kernel is CUDA's alone
    rows = config.dense_quant_rows if dense else sys.maxsize
    if dense or kernel:
        matvec = kernel and config.quant_kernel != "mma"
        out.dense_quant, out.quant_kernel = quantised_products(model, rows, kernel, matvec)
    t0 = time.perf_counter()
    if kernel:
        out.moe_kernel = config.moe_kernel == "1" and quantised_experts(model)
        if not paged_attention.force_reference:  # tests on the CPU stand in for CUDA
            # The kernel takes up to MAX_ROWS rows, fewer than the dense bound.
            warm_quantised(model, min(rows, quant_matmul.MAX_ROWS + 1))
    t1 = time.perf_counter()
    if out.fused_layer and not paged_attention.force_reference:
        fused_layer.warm(model)  # after the quantised products' rows are set
    t2 = time.perf_counter()
    if t2 - t0 > 0.5:  # what a server's start spends on the kernels' templates
        log.info(
            "kernel templates built before serving in %.1fs: quantised products %.1fs, "
            "fused layer %.1fs",
            t2 - t0,
            t1 - t0,
            t2 - t1,
        )
    return out


def undo(model: nn.Module) -> None:
    """Take back every change `apply` made to `model`: mlx-lm's classes, attributes and
    module functions again. The attention routing is per mlx-lm module, so it is taken
    back for every model of those modules in this process."""
    for _, m in model.named_modules():
        base = getattr(type(m), _BASE, None)
        if base is not None:
            m.__class__ = base
        for attr in _PLAN_ATTRS:
            if attr in m.__dict__:
                delattr(m, attr)
    for _, m in model.named_modules():
        for fused_name, names in fused_proj.GROUPS:
            parts = [getattr(m, n, None) for n in names]
            if all(isinstance(p, fused_proj.Part) for p in parts):
                for n, p in zip(names, parts):
                    setattr(m, n, p.shared.alone[p.i])
                m.pop(fused_name, None)
    _unroute(model)


# --- 1. fused projections ------------------------------------------------------


def fuse_projections(model: nn.Module) -> int:
    """Fuse every group of `fused_proj.GROUPS` in `model` that can be; how many were."""
    count = 0
    for fused_name, names in fused_proj.GROUPS:
        # The parents only: a list of every module would keep each replaced layer
        # alive until the walk ends, doubling those weights at the peak.
        parents = {
            id(m): m
            for _, m in model.named_modules()
            if all(isinstance(getattr(m, n, None), fused_proj.KINDS) for n in names)
        }
        count += sum(fused_proj.fuse(p, fused_name, names) for p in parents.values())
    return count


# --- 2. attention routing --------------------------------------------------------


def _model_modules(model: nn.Module) -> set[str]:
    names = {type(m).__module__ for _, m in model.named_modules()}
    names.add(type(model).__module__)
    for _, m in model.named_modules():  # a swapped class lives here: its base's module
        base = getattr(type(m), _BASE, None)
        if base is not None:
            names.add(base.__module__)
    return {n for n in names if n.startswith("mlx_lm.models.") and n in sys.modules}


def _wrap_bound(model: nn.Module, attr: str, wrap: Callable[[Callable], Callable]) -> bool:
    """Replace the function `attr` bound in each of `model`'s mlx-lm modules with `wrap`
    of mlx-lm's own; True when at least one module has one."""
    hooked = False
    for name in _model_modules(model):
        mod = sys.modules[name]
        fn = getattr(mod, attr, None)
        if fn is None:
            continue
        setattr(mod, attr, wrap(getattr(fn, _ORIGINAL, fn)))
        hooked = True
    return hooked


def route_attention(model: nn.Module, prefill_mode: str = "auto", on_host: bool = False) -> bool:
    """Wrap the `scaled_dot_product_attention` of `model`'s mlx-lm modules (see the
    module's docstring); `on_host`: prompt chunks through `cpu_prefill`. True when at
    least one module calls it (so that the paged kernel can be used)."""
    return _wrap_bound(
        model,
        "scaled_dot_product_attention",
        lambda original: _routed(original, prefill_mode, on_host),
    )


def route_swiglu(model: nn.Module) -> bool:
    """Wrap the `swiglu` bound in `model`'s mlx-lm modules with `cpu_prefill`'s; True
    when at least one module has one."""
    return _wrap_bound(model, "swiglu", _routed_swiglu)


@functools.cache
def _routed_swiglu(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    fn = cpu_prefill.routed_swiglu(original)
    setattr(fn, _ORIGINAL, original)
    return fn


def route_gated_delta(model: nn.Module, on_host: bool) -> bool:
    """Wrap the `gated_delta_update` bound in `model`'s mlx-lm modules with `gated_delta`'s
    (`on_host`: prompt chunks in numpy); True when at least one module has one."""
    return _wrap_bound(
        model, "gated_delta_update", lambda original: _routed_gated_delta(original, on_host)
    )


@functools.cache
def _routed_gated_delta(original: Callable[..., Any], on_host: bool) -> Callable[..., Any]:
    fn = gated_delta.routed(original, on_host)
    setattr(fn, _ORIGINAL, original)
    return fn


_ROUTED = ("scaled_dot_product_attention", "swiglu", "gated_delta_update")


def _unroute(model: nn.Module) -> None:
    for name in _model_modules(model):
        mod = sys.modules[name]
        for attr in _ROUTED:
            original = getattr(getattr(mod, attr, None), _ORIGINAL, None)
            if original is not None:
                setattr(mod, attr, original)


@functools.cache
def _routed(
    original: Callable[..., mx.array], prefill_mode: str, on_host: bool = False
) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(
        queries: mx.array,
        keys: mx.array,
        values: mx.array,
        cache: Any,
        scale: float,
        mask: Any,
        sinks: Any = None,
    ) -> mx.array:
        lay = getattr(cache, "layout", None)
        if lay is not None and getattr(lay, "paged_kernel", False):
            # The cache returned the pools themselves (the new token already written);
            # the mask is None, or a sliding window's `Window`.
            window = mask.size if isinstance(mask, paged_attention.Window) else None
            args = (queries, keys, values, lay.gather_blocks, lay.offsets, scale, lay.block_size)
            if paged_attention.force_reference:
                return paged_attention.reference_decode_attention(*args, window, sinks)
            split = getattr(lay, "paged_split", False)
            return paged_attention.paged_decode_attention(
                *args, split=split, window=window, sinks=sinks
            )
        if lay is not None and not hasattr(cache, "bits"):  # not quantised
            if on_host and cpu_prefill.applies(queries, keys, getattr(lay, "traced", False)):
                return cpu_prefill.attention(queries, keys, values, scale, mask, sinks)
            rows = prefill_attention.composed_rows(queries, keys, prefill_mode)
            if rows:
                return prefill_attention.composed_attention(
                    queries, keys, values, scale, mask, rows, sinks
                )
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _ORIGINAL, original)
    return scaled_dot_product_attention


# --- 3, 4. class swaps -------------------------------------------------------------


@functools.cache
def _subclasses(pairs: tuple[tuple[str, str], ...], call: Callable) -> dict[type, type]:
    """Each of mlx-lm's classes in `pairs` ((module, class name)), with a subclass whose
    `__call__` is `call`. Cached, so that engines built on one model share the subclasses."""
    out: dict[type, type] = {}
    for mod, name in pairs:
        base = getattr(importlib.import_module(f"mlx_lm.models.{mod}"), name)
        attrs = {"__call__": call, _BASE: base}
        out[base] = type(f"Fused{mod.capitalize()}{name}", (base,), attrs)
    return out


def _swap_in(
    model: nn.Module, classes: dict[type, type], plan: Callable[[Any, type], Any], attr: str
) -> bool:
    """Give every module of `model` whose class is a key of `classes` `plan(module, class)`
    as `attr` and the fused subclass, if every such module has a plan; True if so. Modules
    fused by an earlier engine on the same model count too (and are planned again)."""
    bases = {**{b: b for b in classes}, **{f: b for b, f in classes.items()}}
    modules = [m for _, m in model.named_modules() if type(m) in bases]
    plans = [plan(m, bases[type(m)]) for m in modules]
    if not modules or any(p is None for p in plans):
        return False
    for m, p in zip(modules, plans):
        setattr(m, attr, p)
        m.__class__ = classes[bases[type(m)]]
    return True


def fuse_attention(model: nn.Module) -> bool:
    """Swap every attention module of `model` for its fused form, if all can be; True if
    so. Needs `fuse_projections` first, and decode batches that take the paged kernel."""
    classes = _subclasses(fused_attention.CLASSES, fused_attention.call)
    return _swap_in(model, classes, lambda m, _base: fused_attention.spec(m), "_pippin_fused")


def fuse_layers(model: nn.Module, flag: str) -> bool:
    """Swap every transformer layer of `model` for its fused form, if all can be; True if
    so. Needs `fuse_attention` first; `flag`: `fused_layer.projections`'."""
    classes = _subclasses(fused_layer.CLASSES, fused_layer.call)
    return _swap_in(model, classes, lambda m, base: fused_layer.plan(m, base, flag), "_pippin_plan")


def warm_quantised(model: nn.Module, rows: int) -> None:
    """Build the quantised kernels' templates before the first request needs them."""
    kinds = dense_quant.subclass(_BASE)
    layers = [
        m
        for _, m in model.named_modules()
        if type(m) is kinds and getattr(m, dense_quant.KERNEL_ATTR, None) is not None
    ]
    quant_matmul.warm(layers, rows)
    quant_matvec.warm([m for m in layers if getattr(m, dense_quant.MATVEC_ATTR, 0)])
    args = getattr(model, "args", None)
    top_k = getattr(args, "num_experts_per_tok", None)
    if isinstance(top_k, int):
        moe_quant.warm(model, top_k)


def quantised_experts(model: nn.Module) -> bool:
    """Swap every `SwitchGLU` of `model` whose experts the kernel takes for the form that
    runs them through `quant_matmul.gather_qmm` (`moe_quant`), if all can be; True if so."""
    classes = _subclasses(moe_quant.CLASSES, moe_quant.call)
    return _swap_in(model, classes, moe_quant.plan, "_pippin_plan")


# --- 5. the LM head's rows ----------------------------------------------------------


def select_head_rows(model: nn.Module) -> head_rows.HeadRows | None:
    """Make `model`'s final norm select positions; None if the model has no known one."""
    found = head_rows.final_norm(model)
    if found is None:
        return None
    norm: nn.Module = getattr(*found)
    holder = head_rows.HeadRows()
    base = getattr(type(norm), _BASE, type(norm))

    def __call__(self: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        if holder.rows is not None and x.ndim == 3 and tuple(x.shape[:2]) == holder.shape:
            x = x[holder.rows, holder.cols][:, None, :]
        return base.__call__(self, x, *args, **kwargs)

    norm.__class__ = type(base.__name__, (base,), {"__call__": __call__, _BASE: base})
    return holder


# --- 6. quantised prompt chunks --------------------------------------------------------


def quantised_products(
    model: nn.Module, rows: int, kernel: bool, matvec: bool = True
) -> tuple[int, int]:
    """Run inputs of at least `rows` rows through every affine quantised linear layer of
    `model` as a dense product (`dense_quant`), and with `kernel` fewer rows through
    pippin's kernels where they apply (`quant_matvec` up to its rows if `matvec`, else
    `quant_matmul`); how many layers take each."""
    cls = dense_quant.subclass(_BASE)
    dense = kernels = 0
    for _, m in model.named_modules():
        if type(m) in (nn.QuantizedLinear, cls) and dense_quant.applies(m):
            setattr(m, dense_quant.ROWS_ATTR, rows)
            dtype = dense_quant.kernel_dtype(m) if kernel else None
            setattr(m, dense_quant.KERNEL_ATTR, dtype)
            setattr(m, dense_quant.MATVEC_ATTR, quant_matvec.DENSE_ROWS if matvec and dtype else 0)
            m.__class__ = cls
            dense += rows < sys.maxsize
            kernels += dtype is not None
    return dense, kernels
