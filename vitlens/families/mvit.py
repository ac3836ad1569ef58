"""timm's MViT v2 (``mvitv2_*``, ``timm.models.mvitv2.MultiScaleVit``): pooling attention. Each block attends
globally, but its keys (and values) are pooled to a coarser grid than its queries (``stride_kv``), and the
first block of each stage pools its queries (and its residual) by ``stride_q`` to the next stage's grid; a
decomposed relative-position term q . R_h[dy] + q . R_w[dx] (``rel_pos_type='spatial'``, offsets scaled between
the two grids) is added to the logits; the pooled q is added to the attention's output (``residual_pooling``).

Capture. timm's MViT v2 attention has no fused path: ``attn.softmax(dim=-1)`` of (q * scale) k^T plus the
relative-position term, then ``attn @ v``. Its own probabilities are read as that one ``softmax`` call returns
them, [B, heads, Nq, Nk] (a thread-local ``TorchFunctionMode`` around the attention's forward hands the call's
result on, unchanged): side and inline capture are the same reading, the model's outputs bit-for-bit untouched,
and inline with ``detach=False`` hands over the very tensor the output is computed from.

Geometry (``windows``). One "window" per block holding all its queries and keys: the queries on the block's
output grid, the keys on the pooled grid; grids are the pooling modules' own output sizes (floor((H + 2p - k) / s)
+ 1 per axis, from their kernel, stride and padding): the grids the forward computes on, which round up where a
padded pooling meets an odd grid (112 px: 28 -> 14 -> 7 -> 4; timm's ``feat_size`` says 3 by floor division).
Such a model is read on its true grids; one whose relative-position tables (sized from ``feat_size``) are too
short for them is refused, as its own forward fails at that size. Tokens are
placed in input pixels: the first stage's at (r + 0.5) x the patch stride (the stride cell's centre, as for every
other family; the 7x7 patch convolution with padding 3 is centred 1.5 px above and left of it, a shift every
centre below inherits, so no distance changes); a pooled token at the mean of the centres of the tokens its
kernel covers inside the grid (``transport_centres``). The stated transports (rollout through the pooling): the
keys, ``pool_k``'s kernel/stride/padding (``key_from``); the block's output tokens, the residual's own pooling
``shortcut_pool_attn`` (max pool, kernel s + 1, stride s, padding (s + 1) // 2; the identity at stride 1), which
in timm's configs (kernel_qkv 3x3, stride_q 2) has pool_q's kernel, stride and padding (``query_from``). Each
pooled token is the mean of the tokens its kernel covers inside the grid: exact for the footprint, a stated
approximation of the model's weights (``mode='conv'``: a depthwise convolution per head then a LayerNorm;
``'max'``: the largest; ``'avg'``: timm's AvgPool2d counts the zero padding). The queries' own 3x3 pooling at
stride 1 and the pooled-q residual inside the attention are part of the attention branch, not transported.

Refused, in one line each: the class-token variants (``mvitv2_*_cls``, ``use_cls_token=True``: a prefix token
outside every token grid, which the windowed views do not place), and timm's ``MultiScaleAttentionPoolFirst``
(``pool_first=True``, used by no timm config: its forward multiplies q by untransposed keys and does not run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry, transport_centres
from ..errors import UnsupportedModelError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.blocks import StagedFamily
from .common.readers import read_softmax
from .common.timm import timm_data_config
from .common.windows import pair, pooled_grid, pooling_module_transport, pooling_of, token_centres

#: the pooling modes timm's MViT v2 builds (a depthwise Conv2d per head or over all channels, MaxPool2d, AvgPool2d)
MODES = ("conv", "conv_unshared", "max", "avg")


@dataclass(frozen=True)
class BlockLayout:
    """One MViT v2 block's grids: the stage, the input grid, the queries' (= the output's) and the keys' grid, the
    pixel stride of the query grid, and the pooling modules (None: not pooled) that make them."""

    stage: int
    input_grid: tuple[int, int]
    query_grid: tuple[int, int]
    key_grid: tuple[int, int]
    stride_px: tuple[int, int]
    pool_q: nn.Module | None
    pool_k: nn.Module | None
    pool_skip: nn.Module | None


class TimmMViTv2(StagedFamily):
    """timm ``MultiScaleVit`` (MViT v2): pooling attention read block by block (module docstring)."""

    name = "timm-mvitv2"
    summary = "timm MViT v2 (mvitv2_*)"
    reads = ("timm MViT v2 (mvitv2_*, timm.models.mvitv2): pooling attention (keys and values pooled to a coarser "
             "grid, queries pooled at each stage's first block) with the decomposed relative-position term and "
             "residual pooling; distance in image pixels beside the uniform distance over the pooled keys, rollout "
             "through the poolings with a stated transport (class-token variants refused)")
    names = ("timm names: mvitv2_tiny, mvitv2_small, mvitv2_base, mvitv2_large (timm.list_models('mvitv2_*'); the "
             "*_cls variants refused)",)
    capture = CaptureAbilities(view_mode="side")  # both modes read the model's own softmax
    attention_inputs = ("norm1",)

    def matches(self, model: nn.Module) -> bool:
        from timm.models.mvitv2 import MultiScaleVit

        return isinstance(model, MultiScaleVit)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.models.mvitv2 import MultiScaleAttention, MultiScaleAttentionPoolFirst, MultiScaleBlock, PatchEmbed

        if getattr(model, "cls_token", None) is not None:
            raise UnsupportedModelError(
                f"{name!r}: MViT v2 with a class token (use_cls_token=True, the mvitv2_*_cls models) is refused: the "
                "class token is a prefix token outside every token grid, which vitlens's windowed views do not place; "
                "the mvitv2_* models without it are read.")
        if type(model.patch_embed) is not PatchEmbed or not isinstance(model.patch_embed.proj, nn.Conv2d):
            raise UnsupportedModelError(f"{name!r}: its patch embedding is a {type(model.patch_embed).__name__}; "
                                        "vitlens reads timm.models.mvitv2's PatchEmbed (one convolution).")
        for s, stage in enumerate(model.stages):
            for i, block in enumerate(stage.blocks):
                attn = getattr(block, "attn", None)
                if type(attn) is MultiScaleAttentionPoolFirst:
                    raise UnsupportedModelError(
                        f"{name!r}: stage {s} block {i} is timm's MViT v2 MultiScaleAttentionPoolFirst (pool_first="
                        "True, used by no timm config), whose forward multiplies q by untransposed keys and does not "
                        "run; vitlens reads MultiScaleAttention (pool_first=False).")
                if type(block) is not MultiScaleBlock or type(attn) is not MultiScaleAttention:
                    raise UnsupportedModelError(
                        f"{name!r}: stage {s} block {i} is a {type(block).__name__} with {type(attn).__name__}; "
                        "vitlens reads timm.models.mvitv2's MultiScaleBlock with MultiScaleAttention exactly and "
                        "refuses others.")
                if attn.mode not in MODES:
                    raise UnsupportedModelError(f"{name!r}: stage {s} block {i} pools with mode {attn.mode!r}; vitlens "
                                                f"reads {', '.join(MODES)}.")
        self.layout(model, self.image_size(model), name)  # the grids agree with the stages' (or a refusal)

    # --- geometry -----------------------------------------------------------------------------------------------

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return [(s, block) for s, stage in enumerate(model.stages) for block in stage.blocks]

    def patch_grid(self, model: nn.Module, input_hw: Sequence[int]) -> tuple[int, int]:
        """The patch convolution's output grid for an input of ``input_hw`` pixels."""
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return pooled_grid(tuple(int(s) for s in input_hw), model.patch_embed.proj)  # type: ignore[arg-type]

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        """The size the model was built for: its first stage's grid (the patch grid, img_size // patch stride,
        where the first stage does not pool its queries: every timm config) times the patch stride. MViT v2 keeps
        no image size; its relative-position tables and stages' grids are built for this one."""
        stride = pair(model.patch_embed.proj.stride)
        first = model.stages[0].blocks[0]
        q_stride = pooling_of(first.shortcut_pool_attn)[1] if first.shortcut_pool_attn is not None else (1, 1)
        grid = tuple(int(g) * q for g, q in zip(model.stages[0].feat_size, q_stride))
        return (grid[0] * stride[0], grid[1] * stride[1])

    def layout(self, model: nn.Module, input_hw: Sequence[int], name: str = "") -> list[BlockLayout]:
        """Every block's grids at an input of ``input_hw`` pixels, from the pooling modules' own kernels, strides
        and paddings: the grids the model's forward computes on (it takes each grid from the pooled tensor). Where a
        padded pooling rounds up (112 px: 28 -> 14 -> 7 -> 4 tokens), these differ from timm's ``stage.feat_size``
        (floor division: 3) and are the true ones; the relative-position tables, sized from ``feat_size``, are
        checked to cover the offsets these grids index.

        Raises:
            UnsupportedModelError: a block's queries and residual pooled to different grids, or a relative-position
                table too short for the grids (the model's own forward fails at that size).
        """
        grid = self.patch_grid(model, input_hw)
        stride = pair(model.patch_embed.proj.stride)
        out = []
        for s, stage in enumerate(model.stages):
            for i, block in enumerate(stage.blocks):
                attn, skip = block.attn, block.shortcut_pool_attn
                q_grid, k_grid = pooled_grid(grid, attn.pool_q), pooled_grid(grid, attn.pool_k)
                if pooled_grid(grid, skip) != q_grid or pooled_grid(grid, attn.pool_v) != k_grid:
                    raise UnsupportedModelError(
                        f"{name or type(model).__name__!r}: stage {s} block {i} pools its queries to {q_grid} but its "
                        f"residual to {pooled_grid(grid, skip)} (or its values to another grid than its keys); "
                        "vitlens reads blocks whose outputs are one grid.")
                if skip is not None:
                    # the ignore below: 2 ints (mypy: tuple[int, ...])
                    stride = tuple(a * b for a, b in zip(stride, pooling_of(skip)[1]))  # type: ignore[assignment]
                rows = _rel_pos_rows_needed(attn, q_grid, k_grid)
                if rows is not None and rows > int(attn.rel_pos_h.shape[0]):
                    raise UnsupportedModelError(
                        f"{name or type(model).__name__!r}: at {input_hw[0]}x{input_hw[1]} pixels the model's own "
                        f"forward fails: stage {s} block {i} attends {q_grid[0]}x{q_grid[1]} queries over "
                        f"{k_grid[0]}x{k_grid[1]} keys (its padded poolings round up), but its relative-position table "
                        f"has {int(attn.rel_pos_h.shape[0])} rows, sized by timm for the {stage.feat_size[0]}x"
                        f"{stage.feat_size[1]} grid floor division gives, and these grids index {rows}; build it at a "
                        "size whose poolings divide evenly.")
                out.append(BlockLayout(s, grid, q_grid, k_grid, stride, attn.pool_q, attn.pool_k, skip))
                grid = q_grid
        return out

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        """Every block's geometry: one window of all its queries (its output grid) and all its keys (the pooled
        grid), their centres in input pixels and the stated transports (module docstring)."""
        layout = self.layout(model, input_hw)
        first = layout[0]
        centres = token_centres(first.input_grid, pair(model.patch_embed.proj.stride))  # updated block by block
        out = []
        for b in layout:
            query_from = pooling_module_transport(b.input_grid, b.pool_skip, b.query_grid)
            query_centres = centres if query_from is None else transport_centres(query_from, centres)
            key_from = pooling_module_transport(b.input_grid, b.pool_k, b.key_grid)
            key_centres = centres if key_from is None else transport_centres(key_from, centres)
            nq, nk = b.query_grid[0] * b.query_grid[1], b.key_grid[0] * b.key_grid[1]
            pooled = b.pool_q is not None or b.pool_k is not None
            out.append(WindowGeometry(
                stage=b.stage, grid=b.query_grid, stride_px=b.stride_px, index=np.arange(nq, dtype=np.int64)[None],
                allowed=np.ones((1, nq, nk), dtype=bool), kind="pooled" if pooled else "global",
                key_index=np.arange(nk, dtype=np.int64)[None], key_grid=b.key_grid, query_centres=query_centres,
                key_centres=key_centres, input_grid=b.input_grid, key_from=key_from, query_from=query_from))
            centres = query_centres
        return out

    # --- spec and capture ---------------------------------------------------------------------------------------

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        image = self.image_size(model)
        refuse_other_size(name, self.name, image, input_size)
        blocks = self.blocks(model)
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=image, grid=self.patch_grid(model, image),
            stride_px=pair(model.patch_embed.proj.stride), num_prefix_tokens=0, num_layers=len(blocks),
            num_heads=max(int(b.attn.num_heads) for _s, b in blocks),
            embed_dim=int(model.patch_embed.proj.out_channels),
            has_class_token=False, has_pos_embed=model.pos_embed is not None,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            _read_softmax(attn, layer, capture, handles, detach=True)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            _read_softmax(attn, layer, capture, handles, detach=capture.detach)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj  # the heads (attention output plus pooled q) meet at the output projection

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.proj, "patch_embed.proj", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        if model.pos_embed is None:
            return None
        return model.pos_embed.detach(), spec.grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("MViT v2 adds a decomposed relative-position term (q . R_h + q . R_w) to each block's logits instead "
                "of a learned absolute position table (use_abs_pos=False)")

    def no_relative_bias_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("its relative-position term is q . R_h[dy] + q . R_w[dx], which depends on each query, not a bias "
                "table over offsets")

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


def _rel_pos_rows_needed(attn: nn.Module, q_grid: tuple[int, int], k_grid: tuple[int, int]) -> int | None:
    """The rows of the relative-position tables timm's ``cal_rel_pos_type`` indexes for these query and key grids
    (its own offsets: i * max(k/q, 1) - j * max(q/k, 1) + (k - 1) * max(q/k, 1), truncated), or None where the block
    adds no spatial relative-position term."""
    if getattr(attn, "rel_pos_type", "") != "spatial":
        return None
    need = 0
    for q, k in zip(q_grid, k_grid):
        q_ratio, k_ratio = max(k / q, 1.0), max(q / k, 1.0)
        dist = (torch.arange(q).unsqueeze(-1) * q_ratio - torch.arange(k).unsqueeze(0) * k_ratio) + (k - 1) * k_ratio
        need = max(need, int(dist.long().max().item()) + 1)
    return need


def _read_softmax(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles, detach: bool) -> None:
    """The attention's own probabilities [B, heads, Nq, Nk] as its one softmax call returns them (``read_softmax``);
    detached in float32 unless ``detach`` is False."""
    read_softmax(attn, layer, capture, handles, detach,
                 lambda n: f"MViT v2 block {layer}: its attention made {n} softmax calls; vitlens reads the one of "
                           "timm's MultiScaleAttention.")


register(TimmMViTv2())
