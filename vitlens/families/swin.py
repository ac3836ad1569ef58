"""timm's Swin Transformers: ``swin_*`` (v1), ``swinv2_*`` (v2) and ``swinv2_cr_*`` (v2, Christoph Reich's
implementation): windowed attention (W-MSA), shifted windows (SW-MSA) with their mask, a position bias inside
each window, and patch merging between stages. v1 adds a learned relative-position bias to q k^T / sqrt(d);
both v2s use scaled cosine attention (cos(q, k) times a learned, clamped logit scale per head) and a
continuous position bias, an MLP of log-spaced relative coordinates (``swinv2_*``: 16 sigmoid(MLP), offsets
scaled to the window; ``swinv2_cr_*``: the MLP's output itself). The three share everything vitlens reads
(the window machinery, ``vitlens.families.common.windows``, serves the Hugging Face Swins and the other windowed
families too).

Capture. Each block's window attention attends within windows: its probabilities are
[B * windows, heads, N, N] (N = window_h * window_w), batch-major as the model partitions them. Where the
module runs its non-fused path (timm's default for Swin v1; the only path of both v2s), the probabilities
are read as they enter ``attn_drop``: the model's own, so side and inline capture are the same and the
outputs are untouched. Where a v1 module runs ``F.scaled_dot_product_attention`` (``fused_attn``), side
capture reads that one call (generic call-level capture: softmax(q k^T * scale + bias + mask) from its very
arguments, the real output kept) and inline capture turns the non-fused path on for the session.

Geometry (``windows``). Which stage token each position of each window holds is found by running the
block's own window code (``_attn``; v2 CR: ``_shifted_window_attn``: cyclic shift, padding, window
partition) on a grid of token numbers, with a recorder in place of its attention, on a stand-in that leaves
the model as it is (``common.windows.StandIn``, ``record_windows``): the shift is undone and padding found by the
model's own code, never
re-derived. The recorder also reads the mask the block hands its attention, which says which keys a query
of a shifted window may attend.
"""
from __future__ import annotations

import importlib
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
from .common.readers import read_fused_or_own
from .common.timm import timm_data_config
from .common.windows import StandIn, record_windows
from .common.relative_bias import RelativeBias

if TYPE_CHECKING:
    from .common.relative_bias import RelativeBias


def block_windows(block: nn.Module, grid: tuple[int, int], stage: int, stride: tuple[int, int],
                  method: str = "_attn") -> WindowGeometry:
    """One timm Swin block's windows on its stage grid, read through the block's own ``method`` (``_attn``;
    v2 CR: ``_shifted_window_attn``) on a stand-in whose ``attn`` is a recorder (``record_windows``).

    Args:
        block: a timm ``SwinTransformerBlock`` / ``SwinTransformerV2Block`` / ``SwinTransformerV2CrBlock``.
        grid: (H_s, W_s) its stage's token grid.
        stage: the stage's number.
        stride: (sy, sx) pixels between the stage's tokens.
        method: the block's method that shifts, pads, partitions and calls its attention, on [B, H, W, C].

    Returns:
        The ``WindowGeometry`` of the block.
    """
    code = getattr(type(block), method)

    def run(numbers: torch.Tensor, recorder: Callable[..., Any]) -> Any:
        return code(StandIn(block, attn=recorder), numbers[None, :, :, None])

    return record_windows(run, grid, stage, stride, f"stage {stage} {type(block).__name__}")


class TimmSwin(StagedFamily):
    """timm ``SwinTransformer``: read block by block through its windows (module docstring). The v2 families
    are this one with their module's classes and names."""

    name = "timm-swin"
    summary = "timm Swin (swin_*)"
    reads = ("timm Swin Transformer (swin_*, timm.models.swin_transformer): windowed and shifted-window attention "
             "with relative-position bias, patch merging; attention distance in image pixels per stage and rollout "
             "through the stages")
    names = ("timm names: swin_tiny_patch4_window7_224, swin_base_patch4_window12_384 (timm.list_models('swin_*'))",)
    capture = CaptureAbilities(view_mode="side")  # side reads the model's own probabilities on its non-fused path
    attention_inputs: tuple[str, ...] = ("norm1",)
    #: the timm module and its classes: the model, its block, the block's attention, its patch merging
    module = "timm.models.swin_transformer"
    classes = ("SwinTransformer", "SwinTransformerBlock", "WindowAttention", "PatchMerging")
    #: the model's sequence of stages, and the block's method that partitions and calls its attention
    stages_attr = "layers"
    window_method = "_attn"
    position_reason = ("Swin adds a learned relative-position bias inside each window instead of a learned absolute "
                       "position table")

    def _class(self, i: int) -> type:
        return getattr(importlib.import_module(self.module), self.classes[i])

    def matches(self, model: nn.Module) -> bool:
        return isinstance(model, self._class(0))

    def check_embedding(self, model: nn.Module, name: str) -> None:
        """Refuse a patch embedding that does not hand the stages the NHWC grid timm's Swin reads."""
        from timm.layers import PatchEmbed

        if not isinstance(model.patch_embed, PatchEmbed) or str(getattr(model.patch_embed, "output_fmt", "")) not in (
                "Format.NHWC", "NHWC"):
            raise UnsupportedModelError(f"{name!r}: its patch embedding is a {type(model.patch_embed).__name__} that "
                                        "does not hand the stages an NHWC grid; vitlens reads timm's Swin layout.")

    def check(self, model: nn.Module, name: str) -> None:
        self.check_embedding(model, name)
        block_cls, attn_cls, merge_cls = self._class(1), self._class(2), self._class(3)
        for s, stage in enumerate(self.stages(model)):
            if not isinstance(stage.downsample, (nn.Identity, merge_cls)):
                raise UnsupportedModelError(f"{name!r}: stage {s} downsamples with {type(stage.downsample).__name__}; "
                                            f"vitlens reads {self.module}'s PatchMerging (2x2 tokens into one).")
            check_blocks(name, ((f"stage {s} block {i}", b) for i, b in enumerate(stage.blocks)), block_cls,
                         (attn_cls,), self.module)
            for i, block in enumerate(stage.blocks):
                if getattr(block, "dynamic_mask", False):
                    raise UnsupportedModelError(f"{name!r}: stage {s} block {i} builds its mask at every forward "
                                                "(dynamic_mask); vitlens reads Swin at its built size.")

    def stages(self, model: nn.Module) -> Sequence[nn.Module]:
        return getattr(model, self.stages_attr)

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return [(s, block) for s, stage in enumerate(self.stages(model)) for block in stage.blocks]

    def stage_layout(self, model: nn.Module) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(token grid, pixel stride) of every stage at the built size: a stage that starts with a patch
        merging has ceil(H / 2) x ceil(W / 2) tokens at twice the stride (the merging pads an odd side)."""
        merge_cls = self._class(3)
        h, w = (int(g) for g in model.patch_embed.grid_size)
        sy, sx = (int(p) for p in model.patch_embed.patch_size)
        out = []
        for stage in self.stages(model):
            if isinstance(stage.downsample, merge_cls):
                h, w, sy, sx = -(-h // 2), -(-w // 2), 2 * sy, 2 * sx
            out.append(((h, w), (sy, sx)))
        return out

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        pe = model.patch_embed
        refuse_other_size(name, self.name, pe.img_size, input_size)
        blocks = self.blocks(model)
        return ModelSpec(
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            name=name, kind=HIERARCHICAL.name, image_size=tuple(int(s) for s in pe.img_size),  # type: ignore[arg-type]
            grid=tuple(int(g) for g in pe.grid_size),  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            stride_px=tuple(int(p) for p in pe.patch_size),  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            num_prefix_tokens=0, num_layers=len(blocks),
            num_heads=max(int(b.attn.num_heads) for _s, b in blocks), embed_dim=int(pe.proj.out_channels),
            has_class_token=False, has_pos_embed=getattr(model, "absolute_pos_embed", None) is not None,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def cam_layer(self, model: nn.Module) -> str | None:
        """The last stage's last block (its output: the last stage's tokens [B, H, W, C], NHWC, which the final norm
        and the average pool hand the classifier)."""
        stages = self.stages(model)
        return f"{self.stages_attr}.{len(stages) - 1}.blocks.{len(stages[-1].blocks) - 1}"

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        layout = self.stage_layout(model)
        return [block_windows(block, layout[stage][0], stage, layout[stage][1], self.window_method)
                for stage, block in self.blocks(model)]

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, capture, handles, inline=False)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            read_fused_or_own(attn, layer, capture, handles, inline=True)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj  # the heads meet at the output projection

    def window_bias(self, attn: nn.Module) -> torch.Tensor:
        """One block's position bias inside its window, [heads, N, N] (query rows, key columns, window positions
        row-major), computed by the module's own code: v1's ``_get_rel_pos_bias()`` (its table looked up by
        the relative-position index)."""
        return attn._get_rel_pos_bias()[0]

    bias_source = "attn.relative_position_bias_table[relative_position_index] (its _get_rel_pos_bias())"

    def relative_bias(self, model: nn.Module, spec: ModelSpec) -> "RelativeBias":
        """Every block's position bias inside its window (the position view of Swin: the bias by offset between
        query and key inside a window, per block and head; each stage's window may differ)."""
        attns = self.attention_modules(model)
        with torch.no_grad():
            biases = tuple(self.window_bias(a).detach().float().cpu() for a in attns)
        grids = tuple(tuple(int(w) for w in a.window_size) for a in attns)
        # in words counted from 1, as the app's Block slider counts, and by the block's own module name
        names = {id(mod): name for name, mod in model.named_modules()}
        return RelativeBias(biases=biases, sources=tuple(f"stage {s + 1}, block {i + 1} ({names.get(id(b), '?')}): "
                                                         f"{self.bias_source}"
                                                         for i, (s, b) in enumerate(self.blocks(model))),
                            # the ignore below: 2 ints (mypy: tuple[int, ...])
                            grid=grids[0], num_prefix_tokens=0, grids=grids)  # type: ignore[arg-type]

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.proj, "patch_embed.proj", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        pos = getattr(model, "absolute_pos_embed", None)
        if pos is None:
            return None
        return pos.detach().reshape(1, -1, pos.shape[-1]), spec.grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return self.position_reason

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


class TimmSwinV2(TimmSwin):
    """timm ``SwinTransformerV2`` (``swinv2_*``): as v1, with scaled cosine attention and a continuous position
    bias (16 sigmoid of an MLP of log-spaced offsets); res-post-norm blocks (the attention reads the block's
    input; ``norm1`` follows it). Its attention has no fused path: the probabilities are read at ``attn_drop``."""

    name = "timm-swinv2"
    summary = "timm Swin V2 (swinv2_*)"
    reads = ("timm Swin Transformer V2 (swinv2_*, timm.models.swin_transformer_v2): scaled cosine window attention "
             "with a continuous position bias, shifted windows, patch merging; the windowed views as for Swin")
    names = ("timm names: swinv2_tiny_window8_256, swinv2_base_window12to24_192to384 (timm.list_models('swinv2_*'))",)
    attention_inputs = ()  # res-post-norm: the attention reads the block's input, no child's output
    module = "timm.models.swin_transformer_v2"
    classes = ("SwinTransformerV2", "SwinTransformerV2Block", "WindowAttention", "PatchMerging")
    position_reason = ("Swin V2 adds a continuous relative-position bias (an MLP of log-spaced offsets) inside each "
                       "window instead of a learned absolute position table")
    bias_source = "16 sigmoid(attn.cpb_mlp(relative_coords_table))[relative_position_index]"

    def window_bias(self, attn: nn.Module) -> torch.Tensor:
        """v2's continuous position bias as its forward adds it: 16 sigmoid of its MLP of the log-spaced offset
        table, looked up by the relative-position index (timm computes it inside ``forward``; these are its steps)."""
        table = attn.cpb_mlp(attn.relative_coords_table).view(-1, attn.num_heads)
        n = attn.window_size[0] * attn.window_size[1]
        bias = table[attn.relative_position_index.view(-1)].view(n, n, -1).permute(2, 0, 1)
        return 16 * torch.sigmoid(bias)


class TimmSwinV2Cr(TimmSwin):
    """timm ``SwinTransformerV2Cr`` (``swinv2_cr_*``): scaled cosine attention with a continuous position bias
    (an MLP of log-spaced offsets, no sigmoid); its stages (``stages``) start with the patch merging, its blocks
    partition in ``_shifted_window_attn``, its patch embedding hands the stages NCHW (each stage turns it to NHWC)."""

    name = "timm-swinv2-cr"
    summary = "timm Swin V2 CR (swinv2_cr_*)"
    reads = ("timm Swin Transformer V2 CR (swinv2_cr_*, timm.models.swin_transformer_v2_cr): scaled cosine window "
             "attention with a log-spaced continuous position bias, shifted windows, patch merging; the windowed "
             "views as for Swin")
    names = ("timm names: swinv2_cr_tiny_224, swinv2_cr_small_ns_224 (timm.list_models('swinv2_cr_*'))",)
    attention_inputs = ()
    module = "timm.models.swin_transformer_v2_cr"
    classes = ("SwinTransformerV2Cr", "SwinTransformerV2CrBlock", "WindowMultiHeadAttention", "PatchMerging")
    stages_attr = "stages"
    window_method = "_shifted_window_attn"
    position_reason = TimmSwinV2.position_reason
    bias_source = "attn._relative_positional_encodings() (its MLP of log-spaced offsets)"

    def window_bias(self, attn: nn.Module) -> torch.Tensor:
        return attn._relative_positional_encodings()[0]

    def check_embedding(self, model: nn.Module, name: str) -> None:
        embed = importlib.import_module(self.module).PatchEmbed
        if type(model.patch_embed) is not embed:
            raise UnsupportedModelError(f"{name!r}: its patch embedding is a {type(model.patch_embed).__name__}; "
                                        f"vitlens reads {self.module}'s PatchEmbed.")


register(TimmSwin())
register(TimmSwinV2())
register(TimmSwinV2Cr())
