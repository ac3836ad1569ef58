"""timm's DaViT (``davit_*``; Florence-2's vision encoder is one, ``davit_base_fl``): a 7x7 stride-4 stem, stages
that start with a strided convolution (kernel 2, or 3 in Florence-2's), and dual-attention blocks: a *spatial*
block (window attention within non-overlapping windows, padded bottom and right, no shift, no position bias)
then a *channel* block (a softmax over the channels of each head's features, [heads, d, d]: every token's output
mixes its own channels, no token attends another). Each block begins (and its attention ends) with a 3x3
depthwise convolutional position encoding (``ConvPosEnc``).

Channel attention is not a token attention: it is never captured or drawn, and the spec says so
(``ModelSpec.not_drawn``, shown with the model and in the rollout's source). vitlens's blocks are the spatial
blocks alone.

Capture. Each spatial block's ``WindowAttention`` computes softmax(q k^T * scale) over its windows, [B * windows,
heads, N, N]: its non-fused path's probabilities as its ``softmax`` module returns them (the model's own), a fused
module's one ``scaled_dot_product_attention`` call from its arguments under side capture (the real output kept);
inline capture turns the non-fused path on.

Geometry. Each spatial block's windows are read by running its own ``forward`` on a stand-in whose ``attn`` is a
recorder and whose position encoding and norm are the identity (``common.windows.record_windows``). Tokens sit at
(r + 0.5) x their stage's stride (4, 8, 16, 32 px), except behind a kernel-2 stage start, whose coarse tokens sit
at the mean of the tokens they merge, as Swin's (inside the image where an odd grid's border cuts a 2x2 block).

Stated transports (rollout). A stage's strided convolution: kernel 2 (its bottom and right padded to whole
kernels), each coarse token the mean of the 2x2 tokens it covers (``merge_transport``, as Swin's merging); kernel 3
(padding 1), the mean of the tokens its kernel covers inside the grid (``stage_from``). The channel blocks mix no
tokens, so the rollout crosses them as the identity; the depthwise position encodings are not transported (a
rollout follows attention and the residual only). Source: the mean over the last stage's tokens (the head's pool).

Size. DaViT reads any size; it is read at its ``pretrained_cfg``'s input size (another:
``pretrained_cfg_overlay=dict(input_size=(3, H, W))``), another refused in one line.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry
from ..errors import UnsupportedModelError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.blocks import StagedFamily
from .common.readers import read_fused_or_own
from .common.timm import timm_data_config
from .common.windows import StandIn, identity, pooling_module_transport, record_windows, token_centres

MODULE = "timm.models.davit"
#: what the spec says of the channel blocks (``ModelSpec.not_drawn``)
CHANNEL_ATTENTION = ("channel attention (each ChannelBlock: a softmax over channels, not tokens) is not a token "
                     "attention; it is not captured or drawn, and the rollout crosses it as the identity")


def _own_softmax(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """A DaViT ``WindowAttention``'s non-fused path: what its ``softmax`` module returns, applied to the values."""
    def hook(_mod: nn.Module, _args: tuple, probs: torch.Tensor) -> None:
        capture(layer, probs.detach().float() if capture.detach else probs)

    handles.hook(attn.softmax.register_forward_hook(hook))


class TimmDaVit(StagedFamily):
    """timm ``DaVit``: its spatial window attention read block by block; its channel attention named and never drawn
    (module docstring)."""

    name = "timm-davit"
    summary = "timm DaViT (davit_*, Florence-2's encoder; spatial windows only)"
    reads = ("timm DaViT (davit_*, timm.models.davit; Florence-2's vision encoder): the spatial blocks' window "
             "attention; distance in image pixels per stage beside the window-uniform distance, rollout through "
             "the windows and the strided stage starts (stated transport); the channel blocks' attention (a softmax "
             "over channels) is no token attention and is not drawn")
    names = ("timm names: davit_tiny, davit_base_fl (timm.list_models('davit_*'))",)
    capture = CaptureAbilities(view_mode="side")
    attention_inputs = ("norm1",)

    def matches(self, model: nn.Module) -> bool:
        return type(model).__module__ == MODULE and type(model).__name__ == "DaVit"

    def check(self, model: nn.Module, name: str) -> None:
        from timm.models import davit as mod
        for s, stage in enumerate(model.stages):
            down = stage.downsample
            if s and (type(down) is not mod.Downsample or down.conv.stride not in (2, (2, 2))):
                raise UnsupportedModelError(f"{name!r}: stage {s} starts with {type(down).__name__}; vitlens reads "
                                            "DaViT's strided Downsample convolution.")
            for i, pair in enumerate(stage.blocks):
                for block in pair:
                    if type(block) is mod.SpatialBlock:
                        if type(block.attn) is not mod.WindowAttention:
                            raise UnsupportedModelError(f"{name!r}: stage {s} block {i} attends with "
                                                        f"{type(block.attn).__name__}; vitlens reads WindowAttention.")
                    elif type(block) is not mod.ChannelBlock:
                        raise UnsupportedModelError(f"{name!r}: stage {s} block {i} holds a {type(block).__name__}; "
                                                    "vitlens reads DaViT's SpatialBlock and ChannelBlock.")

    # --- structure ----------------------------------------------------------------------------------------------

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(stage, spatial block) of every spatial block (the channel blocks are no token attention)."""
        from timm.models import davit as mod
        return [(s, block) for s, stage in enumerate(model.stages) for pair in stage.blocks for block in pair
                if type(block) is mod.SpatialBlock]

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size", (3, 224, 224))
        return int(size[-2]), int(size[-1])

    def stage_layout(self, model: nn.Module, input_hw: Sequence[int] | None = None
                     ) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(token grid, pixel stride) of every stage: the stem's ceil(H / 4) (it pads to whole strides), then each
        stage's strided convolution's ceil(H / 2) (kernel 2 padded to whole kernels, or kernel 3 with padding 1)."""
        h, w = (-(-int(n) // 4) for n in (input_hw or self.image_size(model)))
        stride, out = 4, []
        for s, _stage in enumerate(model.stages):
            if s:
                h, w, stride = -(-h // 2), -(-w // 2), stride * 2
            out.append(((h, w), (stride, stride)))
        return out

    def cam_layer(self, model: nn.Module) -> str | None:
        """The last stage's last dual block (its output: the last stage's tokens [B, C, H, W])."""
        return f"stages.{len(model.stages) - 1}.blocks.{len(model.stages[-1].blocks) - 1}"

    # --- geometry -----------------------------------------------------------------------------------------------

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        layout = self.stage_layout(model, input_hw)
        out, seen = [], set()
        for s, block in self.blocks(model):
            grid, stride = layout[s]
            g = block_windows(block, grid, s, stride)
            conv = model.stages[s].downsample.conv if s else None
            if conv is not None and conv.kernel_size not in (2, (2, 2)):  # a footprint: tokens at the stride cells
                g = dataclasses.replace(g, query_centres=token_centres(grid, stride), stage_from=None if s in seen
                                        else pooling_module_transport(layout[s - 1][0], conv, grid))
            seen.add(s)
            out.append(g)
        return out

    # --- spec and capture ---------------------------------------------------------------------------------------

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        size = self.image_size(model)
        refuse_other_size(name, self.name, size, input_size)
        grid, stride = self.stage_layout(model, size)[0]
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=grid, stride_px=stride, num_prefix_tokens=0,
            num_layers=len(self.blocks(model)), num_heads=max(self.block_heads(model)),
            embed_dim=int(model.stem.out_chs), has_class_token=False, has_pos_embed=False,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name, not_drawn=CHANNEL_ATTENTION)

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, capture, handles, inline=False, own=_own_softmax)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, capture, handles, inline=True, own=_own_softmax)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.stem.conv, "stem.conv", "the stem's patch embedding (7x7, stride 4)", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return None

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("DaViT learns no absolute position table: position comes from the 3x3 depthwise convolutional "
                "position encodings (ConvPosEnc) in every block")

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


def block_windows(block: nn.Module, grid: tuple[int, int], stage: int, stride: tuple[int, int]) -> WindowGeometry:
    """One ``SpatialBlock``'s windows, read by running its own ``forward`` on a stand-in whose ``attn`` is a recorder
    and whose ``cpe1`` and ``norm1`` are the identity."""
    code = type(block).forward

    def run(numbers: torch.Tensor, recorder: Callable[..., Any]) -> Any:
        return code(StandIn(block, attn=recorder, cpe1=identity, norm1=identity), numbers[None, None])

    return record_windows(run, grid, stage, stride, f"stage {stage} {type(block).__name__}")


register(TimmDaVit())
