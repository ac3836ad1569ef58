"""timm's MaxViT and MaxxViT (``maxvit_*``, ``maxxvit_*``, ``maxxvitv2_*``: ConvNeXt blocks and grid attention alone;
``timm.models.maxxvit``): a convolutional stem (stride 2),
then stages of ``MaxxVitBlock``s, each a convolution block (MBConv or ConvNeXt; the stage's first one strided 2),
then *block attention* (within non-overlapping P x P windows of neighbouring tokens) and *grid attention* (within a
G x G grid spread over the whole stage: window (i, j) holds the tokens (a H/G + i, b W/G + j), a dilated grid whose
tokens are H/G rows apart), each with a learned relative-position bias inside its window or grid.

Capture. Each attention module (``AttentionCl``, channels last; ``Attention2d``, NCHW) computes
softmax(q k^T * scale + bias) over its windows, [B * windows, heads, N, N]: its non-fused path's probabilities are
read as they enter ``attn_drop`` (the model's own), a fused module's one ``scaled_dot_product_attention`` call from
its arguments under side capture (the real output kept); inline capture turns the non-fused path on.

Blocks. vitlens's blocks are the attention layers, two per ``MaxxVitBlock``: its ``attn_block`` (kind "window", or
"global" for one window over the whole grid) then its ``attn_grid`` (kind "grid"), each read through its own
``_partition_attn`` on a stand-in whose ``attn`` is a recorder (``common.windows.record_windows``): which stage token
each position of each window or grid holds is the model's own partition's doing.

Distance. Every token sits at (r + 0.5) x its stage's stride (the stride cell's centre); a grid block's keys are
H/G tokens apart, so its window-uniform distance is about half the image's width at every stage (two points
of a square are 0.52 of its side apart on average), and how far a head looks within it is read in image pixels
as for any window.

Stated transports (rollout). Between stages, the first block's strided convolution block: each token of the coarser
grid the mean of the 2x2 tokens its shortcut's average pool covers (``merge_transport``, as Swin's patch merging;
the depthwise convolution's 3x3 footprint is not followed). Not transported, as a rollout follows attention and the
residual only: the MBConv / ConvNeXt blocks' depthwise convolutions inside each block. Source: the mean over the
last stage's tokens (the head's average pool).

Refused, in one line: the experimental ``ParallelMaxxVitBlock`` (``maxvit_tiny_pm``: block and grid attention side by
side on one input, their outputs concatenated: no one order of windows for a rollout to compose), CoAtNet's
convolution-only and
global-attention blocks (``coatnet_*``), a pooling shortcut other than the 2x2 average (``pool_type`` "avg2").
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry
from ..errors import UnsupportedModelError, ViewNotAvailableError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.blocks import StagedFamily
from .common.readers import read_fused_or_own
from .common.timm import timm_data_config
from .common.windows import StandIn, record_windows, token_centres
from .common.relative_bias import RelativeBias

if TYPE_CHECKING:
    from .common.relative_bias import RelativeBias

MODULE = "timm.models.maxxvit"


class TimmMaxVit(StagedFamily):
    """timm ``MaxxVit`` of ``MaxxVitBlock``s: block and grid attention read layer by layer (module docstring)."""

    name = "timm-maxvit"
    summary = "timm MaxViT / MaxxViT (maxvit_*, maxxvit_*, maxxvitv2_*)"
    reads = ("timm MaxViT and MaxxViT (maxvit_*, maxxvit_*, maxxvitv2_*, timm.models.maxxvit): block attention within "
             "local windows and grid attention over a dilated grid, with relative-position biases, after convolution "
             "blocks; distance in image pixels per stage beside the window-uniform distance (the grid blocks' keys "
             "spread over the whole image), rollout through the windows, the grids and the strided stage starts "
             "(stated transport)")
    names = ("timm names: maxvit_tiny_tf_224, maxvit_rmlp_pico_rw_256, maxxvitv2_nano_rw_256 "
             "(timm.list_models('maxvit_*'))",)
    capture = CaptureAbilities(view_mode="side")

    def matches(self, model: nn.Module) -> bool:
        return type(model).__module__ == MODULE and type(model).__name__ == "MaxxVit"

    def check(self, model: nn.Module, name: str) -> None:
        from timm.models import maxxvit as mod
        for s, stage in enumerate(model.stages):
            for i, block in enumerate(stage.blocks):
                if type(block) is mod.ParallelMaxxVitBlock:
                    raise UnsupportedModelError(
                        f"{name!r}: stage {s} block {i} is timm's ParallelMaxxVitBlock (block and grid attention "
                        "side by side on one input, concatenated), which vitlens does not compose into a rollout; "
                        "vitlens reads MaxViT / MaxxViT blocks (MaxxVitBlock: block, then grid attention).")
                if type(block) is not mod.MaxxVitBlock:
                    raise UnsupportedModelError(
                        f"{name!r}: stage {s} block {i} is a {type(block).__name__}; vitlens reads MaxViT / MaxxViT "
                        "stages of MaxxVitBlock (convolution, block attention, grid attention) only (CoAtNet's "
                        "convolution and global-attention blocks are refused).")
                layers = [p for p in (block.attn_block, block.attn_grid) if p is not None]
                for p in layers:
                    if type(p) not in (mod.PartitionAttentionCl, mod.PartitionAttention2d) or \
                            type(p.attn) not in (mod.AttentionCl, mod.Attention2d):
                        raise UnsupportedModelError(f"{name!r}: stage {s} block {i} attends with {type(p).__name__}; "
                                                    "vitlens reads timm's PartitionAttentionCl / PartitionAttention2d.")
                shortcut = getattr(block.conv, "shortcut", None)
                pool = getattr(shortcut, "pool", None)
                if isinstance(shortcut, mod.Downsample2d) and not (
                        isinstance(pool, nn.AvgPool2d) and pool.kernel_size in (2, (2, 2))
                        and pool.stride in (2, (2, 2))):
                    raise UnsupportedModelError(f"{name!r}: stage {s} downsamples with {type(pool).__name__}; vitlens "
                                                "reads the 2x2 average-pool shortcut (pool_type 'avg2').")

    # --- structure ----------------------------------------------------------------------------------------------

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(stage, partition-attention layer) of every attention layer: each MaxxVitBlock's block, then grid one."""
        return [(s, p) for s, stage in enumerate(model.stages) for block in stage.blocks
                for p in (block.attn_block, block.attn_grid) if p is not None]

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        return int(model.img_size[0]), int(model.img_size[1])

    def stage_layout(self, model: nn.Module) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(token grid, pixel stride) of every stage at the built size: the stem's stride, then each stage's first
        block strided 2 (a grid of (n - 1) // 2 + 1), as timm computes its ``feat_size``."""
        stride = int(model.stem.stride)
        h, w = (n // stride for n in self.image_size(model))
        out = []
        for _stage in model.stages:
            h, w, stride = (h - 1) // 2 + 1, (w - 1) // 2 + 1, stride * 2
            out.append(((h, w), (stride, stride)))
        return out

    def cam_layer(self, model: nn.Module) -> str | None:
        """The last stage's last block (its output: the last stage's tokens [B, C, H, W])."""
        return f"stages.{len(model.stages) - 1}.blocks.{len(model.stages[-1].blocks) - 1}"

    # --- geometry -----------------------------------------------------------------------------------------------

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        layout = self.stage_layout(model)
        return [partition_windows(p, layout[s][0], s, layout[s][1]) for s, p in self.blocks(model)]

    # --- spec and capture ---------------------------------------------------------------------------------------

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        size = self.image_size(model)
        refuse_other_size(name, self.name, size, input_size)
        grid, stride = self.stage_layout(model)[0]
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=grid, stride_px=stride, num_prefix_tokens=0,
            num_layers=len(self.blocks(model)), num_heads=max(self.block_heads(model)),
            embed_dim=int(model.feature_info[1]["num_chs"]), has_class_token=False, has_pos_embed=False,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, capture, handles, inline=False)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, capture, handles, inline=True)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj if isinstance(attn.proj, nn.Linear) else None  # Attention2d's is a 1x1 convolution

    def relative_bias(self, model: nn.Module, spec: ModelSpec) -> "RelativeBias":
        """Every layer's relative-position bias inside its window or grid, [heads, N, N], by its ``rel_pos``'s own
        ``get_bias()`` (a grid layer's offsets are counted in grid steps, H/G tokens each)."""
        layers = self.blocks(model)
        if any(p.attn.rel_pos is None for _s, p in layers):
            raise ViewNotAvailableError(f"{spec.name}: a layer adds no relative-position bias of its own (a shared one "
                                        "or none), which vitlens does not read.")
        names = {id(mod): n for n, mod in model.named_modules()}
        with torch.no_grad():
            biases = tuple(p.attn.rel_pos.get_bias().reshape(-1, *p.attn.rel_pos.get_bias().shape[-2:])
                           .detach().float().cpu() for _s, p in layers)
        grids = tuple(tuple(int(v) for v in p.partition_size) for _s, p in layers)
        sources = tuple(f"stage {s + 1}, layer {i + 1} ({names.get(id(p), '?')}): attn.rel_pos.get_bias()"
                        for i, (s, p) in enumerate(layers))
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return RelativeBias(biases=biases, sources=sources, grid=grids[0], num_prefix_tokens=0,  # type: ignore[arg-type]
                            grids=grids)  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.stem.conv1, "stem.conv1", "the stem's first convolution (3x3, stride 2)", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return None

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("MaxViT learns no absolute position table: each block and grid attention adds a learned relative-"
                "position bias inside its window (the relative-position view shows it)")

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


def partition_windows(layer: nn.Module, grid: tuple[int, int], stage: int, stride: tuple[int, int]) -> WindowGeometry:
    """One partition-attention layer's windows (block) or dilated grid, read by running its own ``_partition_attn``
    on a stand-in whose ``attn`` is a recorder (NCHW layers hand windows [windows, C, P, P], turned channels last for
    the recorder); kind "grid" for a grid layer of more than one window."""
    code = type(layer)._partition_attn  # type: ignore[attr-defined]  # timm's PartitionAttention(2d) method
    nchw = type(layer).__name__ == "PartitionAttention2d"

    def run(numbers: torch.Tensor, recorder: Callable[..., Any]) -> Any:
        if nchw:
            return code(StandIn(layer, attn=lambda xw, *a: recorder(xw.permute(0, 2, 3, 1))), numbers[None, None])
        return code(StandIn(layer, attn=recorder), numbers[None, :, :, None])

    g = record_windows(run, grid, stage, stride, f"stage {stage} {type(layer).__name__}")
    kind = "grid" if not layer.partition_block and g.kind == "window" else g.kind
    return dataclasses.replace(g, kind=kind, query_centres=token_centres(grid, stride))


register(TimmMaxVit())
