"""timm's CaiT (``cait_*``, ``timm.models.cait.Cait``, "Going deeper with Image Transformers"): the patch tokens
alone (no class token) go through ``blocks`` of self-attention with talking heads, then the class token is
appended and ``blocks_token_only`` (class-attention layers) update the class token alone; the head reads it.

Blocks, first to last (what ``attention_modules`` lists and the capture's layer numbers are):

- self-attention blocks (``LayerScaleBlock`` with ``TalkingHeadAttn``), kind "global": queries and keys the N patch
  tokens of the grid. The block computes s = q k^T * scale, mixes the heads BEFORE the softmax (``proj_l``, a
  Linear over heads), takes the softmax over the keys, mixes the heads again AFTER it (``proj_w``, a Linear with a
  bias) and multiplies v by that. vitlens reads each head's softmax output, the tensor between the two mixings:
  every row is a probability distribution over the patch tokens, which a mean distance and a rollout need. The
  weights ``proj_w`` makes are not read as attention: they are signed (``proj_w``'s weights and bias are any real
  numbers) and their rows do not sum to 1, so they are no distribution over keys. The maps are [B, heads, N, N].
- class-attention layers (``LayerScaleBlockClassAttn`` with ``ClassAttn``), kind "class-attention": one query, the
  class token, over the keys [class token, N patches]; the patches are not updated. The maps are
  [B, heads, 1, 1 + N].

Capture. A talking-heads block has one path: its softmax output enters ``proj_w`` as [B, N, N, heads] (the
permute of the model's own tensor), read there by a forward pre-hook and handed on as [B, heads, N, N], the
model's own tensor (side and inline capture are the same; the outputs are untouched). A class-attention layer's
probabilities are read as they enter ``attn_drop`` on its non-fused path; where it runs
``F.scaled_dot_product_attention`` (``fused_attn``), side capture reads that one call (softmax(q k^T * scale) from
its very arguments, the real output kept) and inline capture turns the non-fused path on for the session.

The views (``vitlens.views.class_attention``, docs/definitions.md "CaiT"): attention distance of the
self-attention blocks (the class-attention layers' one query has no position in the image, so no distance), and
rollout from the class token at the last class-attention layer back through the class-attention layers and then
the self-attention blocks to the patch grid.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..errors import UnsupportedModelError
from ..kinds import CLASS_ATTENTION
from .base import CaptureAbilities, CaptureRequest, Family, Handles, refuse_other_size, register
from .common.blocks import check_blocks
from .common.readers import read_fused_or_own
from .common.timm import timm_data_config, timm_position_table

#: the ``ModelSpec.kind`` of a ViT with class-attention layers after its self-attention blocks (CaiT)
CLASS_ATTENTION_KIND = CLASS_ATTENTION.name


def self_attention_blocks(model: nn.Module) -> int:
    """How many of a CaiT's blocks are self-attention blocks over the patches (the first ones; the
    class-attention layers follow)."""
    return len(model.blocks)


def cait_block_layout(model: nn.Module) -> list[dict[str, str]]:
    """Every block's kind and the tokens of its queries and keys, first block first (what the views and the
    results say of each block): ``{"kind": "global" | "class-attention", "queries": ..., "keys": ...}``."""
    gh, gw = (int(g) for g in model.patch_embed.grid_size)
    grid = f"{gh}x{gw} patch grid"
    return ([{"kind": "global", "queries": grid, "keys": grid} for _ in model.blocks]
            + [{"kind": "class-attention", "queries": "the class token", "keys": f"the class token + the {grid}"}
               for _ in model.blocks_token_only])


def _read_talking_heads(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """A ``TalkingHeadAttn``'s own softmax output, as it enters ``proj_w`` ([B, N, N, heads]), handed on as
    [B, heads, N, N]: each head's distribution over the keys, after ``proj_l``'s mixing and before ``proj_w``'s."""
    def pre_hook(_mod: nn.Module, args: tuple) -> None:
        probs = args[0].permute(0, 3, 1, 2)
        capture(layer, probs.detach().float() if capture.detach else probs)

    handles.hook(attn.proj_w.register_forward_pre_hook(pre_hook))


class TimmCait(Family):
    """timm ``Cait``: talking-heads self-attention blocks over the patches, then class-attention layers (module
    docstring)."""

    name = "timm-cait"
    summary = "timm CaiT (cait_*)"
    reads = ("timm CaiT (cait_*, timm.models.cait): talking-heads self-attention over the patches (each head's "
             "softmax, between the two head mixings), then class-attention layers (the class token's one query "
             "over the class token and the patches); distance of the self-attention blocks, rollout from the class "
             "token through both")
    names = ("timm names: cait_xxs24_224, cait_s24_384 (timm.list_models('cait_*'))",)
    capture = CaptureAbilities(view_mode="side")  # the talking heads' own softmax; a fused class-attention call read
    attention_inputs = ("norm1",)

    def matches(self, model: nn.Module) -> bool:
        from timm.models.cait import Cait

        return isinstance(model, Cait)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.layers import PatchEmbed
        from timm.models.cait import ClassAttn, LayerScaleBlock, LayerScaleBlockClassAttn, TalkingHeadAttn

        if not isinstance(model.patch_embed, PatchEmbed):
            raise UnsupportedModelError(f"{name!r} embeds patches with {type(model.patch_embed).__name__}; vitlens "
                                        "reads timm's PatchEmbed, whose grid and stride it knows.")
        if getattr(model, "blocks_token_only", None) is None or getattr(model, "cls_token", None) is None:
            raise UnsupportedModelError(f"{name!r} has no class token or class-attention layers (pruned by "
                                        "prune_intermediate_layers); vitlens reads a whole CaiT.")
        if model.global_pool not in ("token", "avg", ""):
            raise UnsupportedModelError(f"{name!r} pools with {model.global_pool!r}; vitlens reads CaiT's 'token', "
                                        "'avg' or '' pooling.")
        check_blocks(name, ((f"block {i}", b) for i, b in enumerate(model.blocks)), LayerScaleBlock,
                     (TalkingHeadAttn,), "timm")
        check_blocks(name, ((f"class-attention layer {i}", b) for i, b in enumerate(model.blocks_token_only)),
                     LayerScaleBlockClassAttn, (ClassAttn,), "timm")

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        pe = model.patch_embed
        refuse_other_size(name, self.name, pe.img_size, input_size)
        return ModelSpec(
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            name=name, kind=CLASS_ATTENTION_KIND, image_size=tuple(int(s) for s in pe.img_size),  # type: ignore[arg-type]
            grid=tuple(int(g) for g in pe.grid_size),  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            stride_px=tuple(int(p) for p in pe.patch_size),  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            num_prefix_tokens=1, num_layers=len(model.blocks) + len(model.blocks_token_only),
            num_heads=int(model.blocks[0].attn.num_heads), embed_dim=int(model.embed_dim), has_class_token=True,
            has_pos_embed=getattr(model, "pos_embed", None) is not None, pos_embed_prefix=0,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name, prefix_labels=("class",))

    def block_layout(self, model: nn.Module) -> list[dict[str, str]]:
        """Every block's kind and the tokens of its queries and keys (``cait_block_layout``)."""
        return cait_block_layout(model)

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.attn for block in model.blocks] + [block.attn for block in model.blocks_token_only]

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        self._install(model, capture, handles, inline=False)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        self._install(model, capture, handles, inline=True)

    def _install(self, model: nn.Module, capture: CaptureRequest, handles: Handles, inline: bool) -> None:
        """The talking heads' own softmax (side and inline alike); a class-attention layer's fused call or its own
        probabilities (``read_fused_or_own``)."""
        depth = self_attention_blocks(model)
        for layer, attn in enumerate(self.attention_modules(model)):
            if layer < depth:
                _read_talking_heads(attn, layer, capture, handles)
            else:
                read_fused_or_own(attn, layer, capture, handles, inline)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj  # the heads' outputs side by side, before the output projection

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.proj, "patch_embed.proj", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return timm_position_table(model, spec)  # over the patches only (the class token joins after the blocks)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


register(TimmCait())
