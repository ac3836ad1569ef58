"""timm's TinyViT (``tiny_vit_*``; MobileSAM's image encoder is a TinyViT): a convolutional first stage (MBConv
blocks) after a two-convolution patch embedding (3x3 stride 2, twice: stride 4), then stages that each start with a
convolutional patch merging (1x1, a 3x3 stride-2 depthwise convolution, 1x1) and attend within non-overlapping
windows (no shift), with a learned bias by offset (LeViT's ``attention_biases``) added to the scores.

Stages. The convolutional stage has no attention: vitlens's stages are the attention stages, numbered from 0 (timm's
``stages.1`` is stage 0, at stride 8); what precedes them (the patch embedding and the MBConv stage) is the stem of
the first attention stage's grid, whose tokens sit at (r + 0.5) x 8 px (the stride cell's centre, as for every
family).

Capture. Each block's ``Attention`` computes softmax(q k^T * scale + bias) over its windows, [B * windows, heads, N,
N]. Its non-fused path makes one softmax call whose result it applies to the values (no dropout module): side and
inline capture read that result (``common.readers.read_softmax``), the model's own; a fused module's one
``scaled_dot_product_attention`` call is read from its arguments under side capture (the real output kept), and
inline capture turns the non-fused path on for the session.

Geometry (``windows``). Each block's windows are read by running its own ``forward`` on a stand-in whose ``attn``
is a recorder (``common.windows.record_windows``): its padding (bottom and right, to whole windows), its partition,
and one window holding the whole grid where the grid is the window ("global").

Stated transports (rollout). Between stages, the patch merging's 3x3 stride-2 depthwise convolution: each merged
token the mean of the previous stage's tokens its kernel covers inside the grid (``stage_from``; the 1x1
convolutions mix no tokens). Not transported, as a rollout follows attention and the residual only: the 3x3
depthwise ``local_conv`` between each block's attention and its MLP. The rollout ends on the first attention
stage's grid (the convolutional stage before it is not attention). Its source: the mean over the last stage's
tokens (the classifier's average pool).

Size. TinyViT reads any input size (it pads to whole windows); it is read at its ``pretrained_cfg``'s input size
(create it with ``pretrained_cfg_overlay=dict(input_size=(3, H, W))`` for another), another size refused in one
line.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry
from ..errors import UnsupportedModelError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.blocks import StagedFamily, check_blocks
from .common.readers import read_fused_or_own, read_softmax
from .common.timm import timm_data_config
from .common.windows import StandIn, pooled_grid, pooling_module_transport, pooling_of, record_windows, token_centres
from .common.relative_bias import RelativeBias

if TYPE_CHECKING:
    from .common.relative_bias import RelativeBias

MODULE = "timm.models.tiny_vit"


def _own_softmax(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """A TinyViT ``Attention``'s non-fused path: its one softmax call's result, the tensor applied to the values."""
    read_softmax(attn, layer, capture, handles, capture.detach,
                 lambda n: f"a TinyViT Attention made {n} softmax calls in one forward; vitlens reads its one call.")


class TimmTinyVit(StagedFamily):
    """timm ``TinyVit``: windowed attention stages after a convolutional one, read block by block (module docstring)."""

    name = "timm-tinyvit"
    summary = "timm TinyViT (tiny_vit_*, MobileSAM's encoder)"
    reads = ("timm TinyViT (tiny_vit_*, timm.models.tiny_vit; MobileSAM's image encoder): window attention with a "
             "learned bias by offset after a convolutional stage, convolutional patch mergings; distance in image "
             "pixels per stage beside the window-uniform distance, rollout through the windows and the mergings "
             "(stated transport) to the first attention stage's grid")
    names = ("timm names: tiny_vit_5m_224, tiny_vit_21m_512 (timm.list_models('tiny_vit_*'))",)
    capture = CaptureAbilities(view_mode="side")

    def matches(self, model: nn.Module) -> bool:
        return type(model).__module__ == MODULE and type(model).__name__ == "TinyVit"

    def check(self, model: nn.Module, name: str) -> None:
        from timm.models import tiny_vit as mod
        if not isinstance(model.stages[0], mod.ConvLayer) or len(model.stages) < 2:
            raise UnsupportedModelError(f"{name!r}: vitlens reads TinyViTs whose first stage is timm's ConvLayer and "
                                        "that have attention stages after it.")
        for s, stage in enumerate(self.stages(model)):
            if type(stage) is not mod.TinyVitStage or type(stage.downsample) is not mod.PatchMerging:
                raise UnsupportedModelError(f"{name!r}: attention stage {s} is a {type(stage).__name__} merging with "
                                            f"{type(getattr(stage, 'downsample', None)).__name__}; vitlens reads "
                                            "timm's TinyVitStage with its PatchMerging.")
            pooling_of(stage.downsample.conv2.conv)  # refuses dilation, in one line
            check_blocks(name, ((f"stage {s} block {i}", b) for i, b in enumerate(stage.blocks)), mod.TinyVitBlock,
                         (mod.Attention,), MODULE)

    # --- structure ----------------------------------------------------------------------------------------------

    def stages(self, model: nn.Module) -> Sequence[nn.Module]:
        """The attention stages (timm's ``stages[1:]``)."""
        return list(model.stages)[1:]

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return [(s, block) for s, stage in enumerate(self.stages(model)) for block in stage.blocks]

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        """The input size of its ``pretrained_cfg`` (module docstring)."""
        size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size", (3, 224, 224))
        return int(size[-2]), int(size[-1])

    def stage_layout(self, model: nn.Module, input_hw: Sequence[int] | None = None
                     ) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(token grid, pixel stride) of every attention stage at an input of ``input_hw`` pixels (None: the size it
        is read at): the patch embedding's two convolutions, then each merging's strided depthwise convolution."""
        grid = tuple(int(s) for s in (input_hw or self.image_size(model)))
        stride = (1, 1)
        for conv in (model.patch_embed.conv1.conv, model.patch_embed.conv2.conv):
            grid = pooled_grid(grid, conv)  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            stride = tuple(a * b for a, b in zip(stride, pooling_of(conv)[1]))  # type: ignore[assignment]
        out = []
        for stage in self.stages(model):
            conv = stage.downsample.conv2.conv
            grid = pooled_grid(grid, conv)  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            stride = tuple(a * b for a, b in zip(stride, pooling_of(conv)[1]))  # type: ignore[assignment]
            out.append((grid, stride))
        return out

    def cam_layer(self, model: nn.Module) -> str | None:
        """The last stage's last block (its output: the last stage's tokens [B, H, W, C], which the head's norm and
        average pool hand the classifier)."""
        return f"stages.{len(model.stages) - 1}.blocks.{len(model.stages[-1].blocks) - 1}"

    # --- geometry -----------------------------------------------------------------------------------------------

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        """Every block's windows read through its own ``forward`` (module docstring), each stage's first block with
        the merging's stated transport from the previous stage."""
        layout = self.stage_layout(model, input_hw)
        out = []
        for s, stage in enumerate(self.stages(model)):
            grid, stride = layout[s]
            stage_from = None if s == 0 else pooling_module_transport(layout[s - 1][0], stage.downsample.conv2.conv,
                                                                       grid)
            for i, block in enumerate(stage.blocks):
                g = block_windows(block, grid, s, stride)
                if i == 0 and stage_from is not None:
                    g = _with(g, stage_from=stage_from)
                out.append(g)
        return out

    # --- spec and capture ---------------------------------------------------------------------------------------

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        size = self.image_size(model)
        refuse_other_size(name, self.name, size, input_size)
        (grid, stride), blocks = self.stage_layout(model, size)[0], self.blocks(model)
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=grid, stride_px=stride, num_prefix_tokens=0,
            num_layers=len(blocks), num_heads=max(self.block_heads(model)),
            embed_dim=int(self.stages(model)[0].out_dim), has_class_token=False, has_pos_embed=False,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, capture, handles, inline=False, own=_own_softmax)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, capture, handles, inline=True, own=_own_softmax)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj  # the heads meet at the output projection

    def relative_bias(self, model: nn.Module, spec: ModelSpec) -> "RelativeBias":
        """Every block's learned bias by offset inside its window, [heads, N, N]: its ``attention_biases`` looked up
        by its ``attention_bias_idxs`` (the module's own ``get_attention_biases`` in training mode's form)."""
        attns = self.attention_modules(model)
        names = {id(mod): n for n, mod in model.named_modules()}
        biases = tuple(a.attention_biases[:, a.attention_bias_idxs].detach().float().cpu() for a in attns)
        grids = tuple(tuple(int(r) for r in a.resolution) for a in attns)
        sources = tuple(f"stage {s + 1}, block {i + 1} ({names.get(id(b), '?')}): "
                        "attn.attention_biases[:, attn.attention_bias_idxs]"
                        for i, (s, b) in enumerate(self.blocks(model)))
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return RelativeBias(biases=biases, sources=sources, grid=grids[0], num_prefix_tokens=0,  # type: ignore[arg-type]
                            grids=grids)  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.conv1.conv, "patch_embed.conv1.conv",
                            "the first convolution of the patch embedding (3x3, stride 2)", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return None

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("TinyViT learns no absolute position table: it adds a learned bias by offset inside each window "
                "(the relative-position view shows it) and its convolutions' zero padding places tokens")

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


def block_windows(block: nn.Module, grid: tuple[int, int], stage: int, stride: tuple[int, int]) -> WindowGeometry:
    """One ``TinyVitBlock``'s windows, read by running its own ``forward`` on a stand-in whose ``attn`` is a recorder
    (``record_windows``), with its query centres at (r + 0.5) x the stage's stride."""
    code = type(block).forward

    def run(numbers: torch.Tensor, recorder: Callable[..., Any]) -> Any:
        return code(StandIn(block, attn=recorder), numbers[None, :, :, None])

    g = record_windows(run, grid, stage, stride, f"stage {stage} {type(block).__name__}")
    return _with(g, query_centres=token_centres(grid, stride))


def _with(g: WindowGeometry, **changes: Any) -> WindowGeometry:
    import dataclasses

    return dataclasses.replace(g, **changes)


register(TimmTinyVit())
