"""A checkpoint's multi-token-prediction (MTP) head as an mlx-lm-like model, which a
`ModelRunner` of its own runs over a paged KV pool (`pippin.engine.mtp`).

One step of it, at position t (vLLM's computation, and the reference's):
`x = fc(concat(norm_e(embed(tok[t + 1])), norm_h(h[t])))`, then a decoder layer (its
attention over the head's own earlier positions), then `norm`, then the LM head: logits
for tok[t + 2]. `h[t]` is the target's last hidden state at t after its final norm (what
the runner keeps with `keep_hidden`). The embedding and LM head are the target's own
modules, called, not held as children: they are neither copied, counted twice nor
changed by the head runner's patches.

The decoder layer is mlx-lm's own class of the family, full attention, so pippin's
kernels and paged KV apply to it as to the target's layers; its weights come from the
checkpoint (`pippin.store.mtp_weights`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from pippin.kernels.head_rows import final_norm
from pippin.store import mtp_weights
from pippin.store.loaded import ModelLoadError

# The families whose checkpoints may ship MTP layers, by mlx-lm model type: Qwen's
# (`mtp.*`), and those with DeepSeek-V3's layer N (their decoder layer's class, and
# whether its attention takes only array masks).
QWEN = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
DEEPSEEK = {"deepseek_v3": ("DeepseekV3DecoderLayer", True), "glm4_moe": ("DecoderLayer", False)}


class MtpBody(nn.Module):
    """The head's own weights (named as `pippin.store.mtp_weights` gives them)."""

    def __init__(self, hidden_size: int, eps: float, layer: nn.Module, mask_array: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden_size, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden_size, eps=eps)
        self.layers = [layer]
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        self.mask_array = mask_array  # the layer's attention takes only array masks

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: Any = None) -> mx.array:
        x = mx.concatenate(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
        )
        x = self.fc(x)
        c = cache[0] if cache is not None else None
        mask = create_attention_mask(x, c, return_array=self.mask_array)
        return self.norm(self.layers[0](x, mask, c))


class MtpHead(nn.Module):
    def __init__(
        self,
        body: MtpBody,
        embed: Callable[[mx.array], mx.array],
        logits: Callable[[mx.array], mx.array],
    ) -> None:
        super().__init__()
        self.model = body  # `model.norm`: the final norm the runner's patches find
        self._embed = embed
        self._logits = logits

    def __call__(
        self, inputs: mx.array, cache: Any = None, hidden: mx.array | None = None
    ) -> mx.array:
        embeds = self._embed(inputs)
        if hidden is None:  # the runner's probe: any input does
            hidden = mx.zeros_like(embeds)
        return self._logits(self.model(embeds, hidden.astype(embeds.dtype), cache))

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    def make_cache(self) -> list[Any]:
        return [KVCache()]

    def step_inputs(self, items: list[Any], tokens: mx.array) -> dict[str, mx.array]:
        """Each row's hidden states (`it.hidden`, [length, H]), right-padded to the call's
        length: the runner's hook for inputs beside the tokens."""
        L = tokens.shape[1]
        rows = []
        for it in items:
            h = it.hidden
            rows.append(mx.pad(h, [(0, L - h.shape[0]), (0, 0)]) if h.shape[0] < L else h)
        return {"hidden": mx.stack(rows)}


def family(model: nn.Module) -> str:
    return str(getattr(model, "model_type", "") or getattr(model.args, "model_type", ""))


def _shared(target: nn.Module) -> tuple[Callable, Callable]:
    """The target's embedding and LM head, as calls (functions: not children; looked
    up at each call, so a class the target's patches swap in applies)."""
    owner = target.language_model if "language_model" in target else target
    embed = owner.model.embed_tokens
    head = owner.get("lm_head")
    if head is None:  # tied
        return lambda x: embed(x), lambda h: embed.as_linear(h)
    return lambda x: embed(x), lambda h: head(h)


def _qwen_layer(target: nn.Module, moe: bool) -> tuple[nn.Module, Any, int]:
    """A full-attention decoder layer of the family's own class, its args, its index."""
    if family(target) == "qwen3_next":
        from mlx_lm.models import qwen3_next as m

        args = target.args
        idx = args.full_attention_interval - 1
        layer = m.Qwen3NextDecoderLayer(args, idx)
    else:
        from mlx_lm.models import qwen3_5 as m5
        from mlx_lm.models import qwen3_next as m

        args = target.language_model.args
        idx = args.full_attention_interval - 1
        layer = m5.DecoderLayer(args, idx)
    # The MLP as the checkpoint has it (vLLM builds the MTP layer as layer 0 would be).
    if moe != isinstance(layer.mlp, m.Qwen3NextSparseMoeBlock):
        layer.mlp = (
            m.Qwen3NextSparseMoeBlock(args)
            if moe
            else m.Qwen3NextMLP(args.hidden_size, args.intermediate_size)
        )
    return layer, args, idx


def load(target: nn.Module, folder: Path, config: dict[str, Any]) -> MtpHead:
    """The MTP head of the checkpoint in `folder` whose target mlx-lm loaded (`config`:
    its config.json); `ModelLoadError` if it has none or pippin cannot run it."""
    kind = family(target)
    found = final_norm(target)
    if found is None or (kind not in QWEN and kind not in DEEPSEEK):
        raise ModelLoadError(
            "--speculative-config method 'mtp' runs the MTP layers of "
            f"{', '.join((*QWEN, *DEEPSEEK))} checkpoints; this model is a "
            f"{kind or type(target).__name__}"
        )
    norm = getattr(*found)
    if kind in QWEN:
        layout = mtp_weights.qwen_layout()
        files = mtp_weights.tensor_files(folder)
        moe = any(".mlp.experts" in k or ".mlp.switch_mlp" in k for k in files if "mtp." in k)
        layer, args, idx = _qwen_layer(target, moe)
        mask_array = False
    else:
        n = int(config.get("num_nextn_predict_layers") or 0)
        if n < 1:
            raise mtp_weights.NoMtpWeightsError(
                f"{folder.name} has no MTP layers (num_nextn_predict_layers is {n}), which "
                "--speculative-config method 'mtp' needs"
            )
        args = target.args
        layout = mtp_weights.deepseek_layout(args.num_hidden_layers)
        name, mask_array = DEEPSEEK[kind]
        cls = getattr(importlib.import_module(f"mlx_lm.models.{kind}"), name)
        layer = cls(args, args.num_hidden_layers)  # as the checkpoint's layer N
        idx = args.num_hidden_layers - 1
    weights = mtp_weights.read(
        folder,
        layout,
        sanitize=target.sanitize,
        layer_name=f"model.layers.{idx}.",
        final_norm=norm.weight,
        dtype=norm.weight.dtype,
    )
    body = MtpBody(args.hidden_size, args.rms_norm_eps, layer, mask_array)
    try:
        body.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"{folder.name}: its MTP weights do not fit the head: {e}") from e
    mx.eval(body.parameters())
    return MtpHead(body, *_shared(target))
