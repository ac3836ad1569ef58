"""timm's SAM / ViTDet image encoder (``samvit_*``, ``VisionTransformerSAM``): one grid of patch tokens, most blocks
attending within non-overlapping windows (padded to whole windows, no shift) and a few globally, with a
decomposed relative-position bias (or RoPE), an absolute position table, and a convolutional neck.

Read as the windowed models are (``vitlens.families.swin``, ``vitlens.families.common.windows``): each block's windows
come from its own code (its
``forward`` on a stand-in whose norm is the identity and whose attention is a recorder, so ``window_partition``
and the padding are the model's), a global block is one window over the whole grid; the probabilities are the
model's own at ``attn_drop`` on its non-fused path, or its fused call's, reshaped from timm's
[B * windows * heads, N, N] to [B * windows, heads, N, N]. The views are the windowed ones (one stage): attention
distance in image pixels beside each window's uniform distance, rollout through the windows from the mean of
the tokens (the neck's convolutions, which mix neighbouring tokens after the last block, are not rolled out).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry
from ..errors import UnsupportedModelError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.blocks import StagedFamily, check_blocks
from .common.readers import read_fused_or_own
from .common.timm import timm_data_config
from .common.windows import StandIn, record_windows


class TimmSam(StagedFamily):
    """timm ``VisionTransformerSAM`` (SAM's and ViTDet's image encoder): windowed and global blocks on one grid."""

    name = "timm-sam"
    summary = "timm SAM / ViTDet image encoders (samvit_*)"
    reads = ("timm SAM / ViTDet image encoders (samvit_*): windowed blocks (padded, no shift) and global blocks on "
             "one grid, decomposed relative-position bias; distance in image pixels beside each window's uniform "
             "distance, rollout through the windows")
    names = ("timm names: samvit_base_patch16, samvit_base_patch16_224 (timm.list_models('samvit_*'))",)
    capture = CaptureAbilities(view_mode="side")  # side reads the model's own probabilities, or its fused call's
    attention_inputs = ("norm1",)

    def matches(self, model: nn.Module) -> bool:
        from timm.models.vision_transformer_sam import VisionTransformerSAM

        return isinstance(model, VisionTransformerSAM)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.layers import PatchEmbed
        from timm.models.vision_transformer_sam import Attention, Block

        if not isinstance(model.patch_embed, PatchEmbed):
            raise UnsupportedModelError(f"{name!r} embeds patches with {type(model.patch_embed).__name__}; vitlens "
                                        "reads timm's PatchEmbed, whose grid and stride it knows.")
        check_blocks(name, ((f"block {i}", b) for i, b in enumerate(model.blocks)), Block, (Attention,),
                     "timm.models.vision_transformer_sam")

    def grid(self, model: nn.Module) -> tuple[int, int]:
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(g) for g in model.patch_embed.grid_size)  # type: ignore[return-value]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        pe = model.patch_embed
        refuse_other_size(name, self.name, pe.img_size, input_size)
        return ModelSpec(
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            name=name, kind=HIERARCHICAL.name, image_size=tuple(int(s) for s in pe.img_size),  # type: ignore[arg-type]
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            grid=self.grid(model), stride_px=tuple(int(p) for p in pe.patch_size),  # type: ignore[arg-type]
            num_prefix_tokens=0, num_layers=len(model.blocks), num_heads=int(model.blocks[0].attn.num_heads),
            embed_dim=int(model.embed_dim), has_class_token=False, has_pos_embed=model.pos_embed is not None,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def cam_layer(self, model: nn.Module) -> str | None:
        """The last block (its output: the grid's tokens [B, H, W, C], NHWC, before the neck)."""
        return f"blocks.{len(model.blocks) - 1}"

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        stride = (int(model.patch_embed.patch_size[0]), int(model.patch_embed.patch_size[1]))
        out = []
        for i, block in enumerate(model.blocks):
            def run(numbers: torch.Tensor, recorder: Callable[..., Any], block: nn.Module = block) -> Any:
                # the block's own forward: its window partition (and padding) of the grid, the norm the identity
                return type(block).forward(StandIn(block, attn=recorder, norm1=nn.Identity()),
                                           numbers[None, :, :, None])

            out.append(record_windows(run, self.grid(model), 0, stride, f"block {i} ({type(block).__name__})"))
        return out

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return [(0, block) for block in model.blocks]  # one stage

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            by_heads = capture.sending_to(_heads_apart(capture, int(attn.num_heads)))
            read_fused_or_own(attn, layer, by_heads, handles, inline=False)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            by_heads = capture.sending_to(_heads_apart(capture, int(attn.num_heads)))
            read_fused_or_own(attn, layer, by_heads, handles, inline=True)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.proj, "patch_embed.proj", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        if model.pos_embed is None:
            return None
        pos = model.pos_embed.detach()  # [1, gh, gw, D]
        return pos.reshape(1, -1, pos.shape[-1]), (int(pos.shape[1]), int(pos.shape[2]))

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return "this SAM encoder was built without an absolute position table (use_abs_pos=False)"

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


def _heads_apart(capture: CaptureRequest, heads: int) -> Callable[..., None]:
    """timm's SAM attention keeps heads in the batch, [B * windows * heads, N, N]: handed on as
    [B * windows, heads, N, N]."""
    def emit(layer: int, probs: torch.Tensor, rows: slice | None = None) -> None:
        capture(layer, probs.reshape(-1, heads, *probs.shape[-2:]), rows)
    return emit


register(TimmSam())
