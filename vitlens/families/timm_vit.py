"""timm's ``VisionTransformer``: plain ViTs, DeiT (distillation token), register models, GAP/MAP
heads without a class token, R50 and other hybrids, non-square and dynamic input sizes, and
ViT-22B-style parallel blocks (``ParallelScalingBlock``, e.g. ``vit_base_patch16_xp_224``).

Attention of timm's ``Attention`` is ``softmax(q_norm(q) * scale @ k_norm(k)^T + mask)``. Side
capture hooks ``q_norm`` and ``k_norm``, whose outputs are the very queries and keys the fused
kernel receives; inline capture turns ``fused_attn`` off and reads the probabilities as they
enter ``attn_drop``.

A ``ParallelScalingBlock`` has no attention module: one fused ``in_proj`` makes the MLP input
and q, k, v together, and the block itself computes the same softmax(q_norm(q) * scale @
k_norm(k)^T + mask). Its ``q_norm`` / ``k_norm`` act on [B, T, heads, head_dim] before the
transpose to [B, heads, T, head_dim], so side capture hooks them there and transposes as the
block does; inline capture turns the block's ``fused_attn`` off and reads its ``attn_drop`` input.
The block's ``attn_drop`` stands for its attention module (its parent is the block), and the heads
meet at the input of ``attn_out_proj`` (none when the block fuses the attention and MLP output
projections into one ``out_proj``: head ablation is then refused).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import UnsupportedModelError, ViewNotAvailableError
from ..core.attention import (PROBS_BUFFER, QKV_BUFFER, attention_output_in_rows, conv_filters, linear_in,
                              unobserved)
from ..core.spec import ModelSpec
from ..kinds import HYBRID, VIT, kind_of
from .base import AttentionClassUnknown, CaptureAbilities, CaptureRequest, Handles, register
from .common.timm import (TIMM_ARGS, TimmFamily, check_patch_embed, first_conv, inline_at_attn_drop,
                          install_qk_norm_hooks)


def inline_in_rows(modules: Sequence[nn.Module], capture: CaptureRequest, handles: Handles) -> dict:
    """Inline capture by query rows for timm's standard ``Attention``: each module's forward is, for
    the session, timm's non-fused path computed ``capture.query_rows`` queries at a time
    (``attention_output_in_rows``), every block of probabilities emitted as it is made and then
    multiplied by v. No [B, heads, T, T] map exists and the probabilities are computed once (side
    capture computes them a second time beside the fused kernel). The output is the non-fused
    path's up to float rounding; under autocast the probabilities are float32 and the product
    with v runs in v's dtype. The block's q, k, v projection is made in the session's workspace (``linear_in``:
    the same product as ``attn.qkv(x)``, into memory reused by every block rather than fresh pages). Returns that
    workspace (the session's; ``mlp_in_workspace`` makes the MLPs' activations in it too)."""
    rows, detach = capture.query_rows, capture.detach
    workspace: dict = {}  # the probabilities' buffer, shared by every block for the session
    for layer, attn in enumerate(modules):
        def forward(x: torch.Tensor, attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                    attn: nn.Module = attn, layer: int = layer,
                    taps: Callable[[slice, tuple], Any] | None = capture.taps_for(layer)) -> torch.Tensor:
            def on_probs(probs: torch.Tensor, block: slice | None) -> None:
                capture(layer, probs.detach() if detach else probs, block)

            b, n, _ = x.shape
            gate = attn.gate(x).sigmoid() if getattr(attn, "gate", None) is not None else None
            qkv = linear_in(workspace, QKV_BUFFER, attn.qkv, x).reshape(b, n, 3, attn.num_heads, attn.head_dim)
            qkv = qkv.permute(2, 0, 3, 1, 4)
            q, k, v = qkv.unbind(0)
            q, k = attn.q_norm(q), attn.k_norm(k)
            with torch.autocast(device_type=x.device.type, enabled=False):
                out = attention_output_in_rows(q, k, v, attn.scale, rows, on_probs, attn_mask, is_causal,
                                               attn.attn_drop, workspace, taps=taps)
            out = attn.norm(out.transpose(1, 2).reshape(b, n, attn.num_heads * attn.head_dim))
            if gate is not None:
                out = out * gate
            return attn.proj_drop(attn.proj(out))

        handles.set_attr(attn, "forward", forward)
    return workspace


def mlp_in_workspace(blocks: Sequence[nn.Module], workspace: dict, handles: Handles) -> None:
    """Each block's timm ``Mlp`` (fc1, GELU, fc2; no norm) computed, for an inline capture session by rows (the forward
    every attention view of Fig. 6, 7 and 11 runs), in the session's workspace on the CPU: ``fc1`` by ``linear_in``
    into the probabilities' buffer (``PROBS_BUFFER``, free between two layers' attention), GELU in place there,
    ``fc2`` by ``linear_in`` into the q, k, v projection's buffer (``QKV_BUFFER``, free once the attention's output
    is made). The same products and the same GELU as the module's own forward, bit for bit (tested), into memory
    every block reuses instead of a fresh hidden activation [B, T, 4 D] and a fresh GELU output each block: page
    faults every block on the CPU, where the plain forward pays them too. The output is valid until the next block's
    q, k, v projection (the block adds it to its residual stream at once). Anything else runs the module's own
    forward: another MLP or activation, another device or dtype, dropout in training, and whatever ``unobserved``
    refuses (gradients, autocast, a hook on any module of the block or a global one: a hook may keep what it sees)."""
    from timm.layers import Mlp

    for block in blocks:
        mlp = getattr(block, "mlp", None)
        if (type(mlp) is not Mlp or type(mlp.act) is not nn.GELU or type(mlp.norm) is not nn.Identity
                or type(mlp.fc1) is not nn.Linear or type(mlp.fc2) is not nn.Linear
                or any(type(d) not in (nn.Dropout, nn.Identity) for d in (mlp.drop1, mlp.drop2))):
            continue
        watched = [mod for mod in block.modules() if mod is not block]
        dropping = [d for d in (mlp.drop1, mlp.drop2) if isinstance(d, nn.Dropout) and d.p > 0]

        def forward(x: torch.Tensor, mlp: nn.Module = mlp, previous: Callable = mlp.forward,
                    watched: list = watched, dropping: list = dropping) -> torch.Tensor:
            if (x.device.type != "cpu" or x.dtype != torch.float32 or any(d.training for d in dropping)
                    or not unobserved(x, watched)):
                return previous(x)
            hidden = linear_in(workspace, PROBS_BUFFER, mlp.fc1, x)
            torch.ops.aten.gelu_(hidden, approximate=mlp.act.approximate)
            return linear_in(workspace, QKV_BUFFER, mlp.fc2, hidden)

        handles.set_attr(mlp, "forward", forward)


#: a parallel block's ``attn_drop`` (its stand-in attention module) -> where its heads meet (or None)
_PARALLEL_HEADS: "weakref.WeakKeyDictionary[nn.Module, nn.Module | None]" = weakref.WeakKeyDictionary()


def _is_parallel(block: nn.Module) -> bool:
    from timm.models.vision_transformer import ParallelScalingBlock

    return type(block) is ParallelScalingBlock


def _parallel_heads_first(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, _call: dict) -> tuple:
    """A parallel block's normalised q and k are [B, T, heads, d]: transpose them as the block does."""
    if _is_parallel(attn):
        return q.transpose(1, 2), k.transpose(1, 2)
    return q, k


class TimmViT(TimmFamily):
    name = "timm-vit"
    summary = "timm VisionTransformer (vit_*, deit_*, registers, GAP/MAP heads, hybrids, parallel blocks)"
    capture = CaptureAbilities(side_rows=True)  # install_qk_norm_hooks
    reads = ("timm VisionTransformer: plain ViTs, DeiT (distillation token), register tokens, GAP/MAP heads, "
             "R50 and other hybrids, parallel blocks (vit_*_xp_*), DINOv3, SigLIP and CLIP towers")
    names = ("timm names: vit_base_patch16_224, vit_base_patch16_224.augreg2_in21k_ft_in1k (a pretrained tag), "
             "deit_small_patch16_224, vit_base_r50_s16_224 (hybrid), vit_small_patch14_reg4_dinov2 (registers); "
             "timm.list_models('vit_*')",
             "the embedded pair: ref-vit, ref-hybrid (offline, trained on shapes)")

    def matches(self, model: nn.Module) -> bool:
        from timm.models.vision_transformer import VisionTransformer

        return isinstance(model, VisionTransformer)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.layers import HybridEmbed, PatchEmbed
        from timm.layers.attention import Attention
        from timm.models.vision_transformer import Block, ParallelScalingBlock, ResPostBlock

        check_patch_embed(model, name, (PatchEmbed, HybridEmbed))
        for i, block in enumerate(model.blocks):
            if type(block) is ParallelScalingBlock:
                if block.q_norm is block.k_norm:
                    raise UnsupportedModelError(f"{name!r}: block {i} shares one module as q_norm and k_norm.")
                continue
            if type(block) not in (Block, ResPostBlock):
                raise UnsupportedModelError(
                    f"{name!r}: block {i} is a {type(block).__name__}, which computes attention its own way; "
                    "vitlens captures the attention of timm's Block/ResPostBlock/ParallelScalingBlock only.")
            if type(block.attn) is not Attention:
                raise AttentionClassUnknown(
                    f"{name!r}: block {i} uses {type(block.attn).__name__}; vitlens reproduces timm's standard "
                    "Attention (softmax(q k^T * scale + mask)) exactly and refuses other attention variants.")
            if block.attn.q_norm is block.attn.k_norm:
                raise UnsupportedModelError(
                    f"{name!r}: block {i} shares one module as q_norm and k_norm, so queries cannot be told from "
                    "keys.")

    def kind(self, model: nn.Module) -> str:
        from timm.layers import HybridEmbed

        return HYBRID.name if isinstance(model.patch_embed, HybridEmbed) else VIT.name

    def stride(self, model: nn.Module) -> tuple[int, int]:
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(s) for s in model.patch_embed.feat_ratio(as_scalar=False))  # type: ignore[return-value]

    @staticmethod
    def _computing(model: nn.Module) -> list[nn.Module]:
        """Per block, the module that computes its attention: ``block.attn``, or the parallel block itself."""
        return [block if _is_parallel(block) else block.attn for block in model.blocks]

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        out = []
        for block in model.blocks:
            if _is_parallel(block):
                _PARALLEL_HEADS[block.attn_drop] = block.attn_out_proj  # None when out_proj is fused
                out.append(block.attn_drop)
            else:
                out.append(block.attn)
        return out

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        if attn in _PARALLEL_HEADS:
            return _PARALLEL_HEADS[attn]
        return super().head_outputs(attn)

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        install_qk_norm_hooks(self._computing(model), capture, handles, TIMM_ARGS, _parallel_heads_first)

    def abilities(self, model: nn.Module) -> CaptureAbilities:
        # inline by query rows: timm's standard Attention only (a parallel block computes its own way)
        return CaptureAbilities(side_rows=True, inline_rows=not any(_is_parallel(b) for b in model.blocks))

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        if capture.query_rows and self.abilities(model).inline_rows:
            workspace = inline_in_rows(self._computing(model), capture, handles)
            mlp_in_workspace(model.blocks, workspace, handles)
        else:
            inline_at_attn_drop(self._computing(model), capture, handles)

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        if not kind_of(spec).cnn_stem:
            return super().pixel_filters(model, spec)
        found = first_conv(model.patch_embed.backbone, "patch_embed.backbone")
        if found is None:
            raise ViewNotAvailableError(f"{spec.name}: the hybrid's CNN has no convolution to show.")
        return conv_filters(found[1], found[0], "the CNN's first convolution; the hybrid's own patch embedding "
                            "acts on CNN channels, not pixels", spec.name)


register(TimmViT())
