"""timm's SAM / ViTDet image encoder (``samvit_*``, ``VisionTransformerSAM``): one grid of patch tokens, most blocks
attending within non-overlapping windows (padded to whole windows, no shift) and a few globally, with a
decomposed relative-position bias (or RoPE), an absolute position table, and a convolutional neck.

Read as the windowed models are (``vitlens.families.swin``, ``vitlens.families.common.windows``): each block's windows
come from its own code (its
``forward`` on a stand-in whose norm is the identity and whose attention is a recorder, so ``window_partition``
and the padding are the model's), a global block is one window over the whole grid. Side capture reads the
model's own probabilities at ``attn_drop`` on its non-fused path, or its fused call's (made a second time beside
it), reshaped from timm's [B * windows * heads, N, N] to [B * windows, heads, N, N]. Inline capture, the views'
(``sam_inline``), runs each block's attention as vitlens's own non-fused path: timm's q, k, v projection, q/k norms
and RoPE or decomposed relative-position bias (the bias added to the scores from its two small tables, never a
[B * windows, heads, N, N] map of it), the probabilities made once (``attention_output_in_rows``) and handed on
whole as [B * windows, heads, N, N] before the output is computed from them; where nothing the capture keeps holds
the maps (the views' stream), each block's map is made in the session's workspace, reused block after block. The
views are the windowed ones (one stage): attention distance in image pixels beside each window's uniform
distance, rollout through the windows from the mean of the tokens (the neck's convolutions, which mix
neighbouring tokens after the last block, are not rolled out).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..core.attention import QKV_BUFFER, attention_output_in_rows, conv_filters, linear_in
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
    # the views' capture: the probabilities made once by vitlens's own path (``sam_inline``), whole maps (the windowed
    # views read whole window maps); side capture makes them a second time beside the fused call (issue 67)
    capture = CaptureAbilities(view_mode="inline")
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
        sam_inline(self.attention_modules(model), capture, handles)

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


class DecomposedBias:
    """SAM's decomposed relative-position bias (MViTv2's, Li et al. 2022) of one block's queries, as a ``RowBias``:
    score[q, k] += q . R_h[q_y - k_y] + q . R_w[q_x - k_x], from the unscaled queries as timm adds it
    (``get_decomposed_rel_pos_bias``, with timm's ``get_rel_pos`` tables), kept as its two tables [B, heads, N, k_h]
    and [B, heads, N, k_w] and broadcast over the keys' grid of each block of query rows: no [B, heads, N, N] map
    of the bias is made (timm's is 0.8 GB per global block at 1024 px)."""

    def __init__(self, attn: nn.Module, q: torch.Tensor, size: tuple[int, int]) -> None:
        from timm.models.vision_transformer_sam import get_rel_pos

        h, w = size
        rh = get_rel_pos(h, h, attn.rel_pos_h).float()  # [q_h, k_h, head_dim]
        rw = get_rel_pos(w, w, attn.rel_pos_w).float()
        grid = q.float().reshape(*q.shape[:2], h, w, q.shape[-1])
        self.rel_h = torch.einsum("bnyxc,ykc->bnyxk", grid, rh).reshape(*q.shape[:2], h * w, h)
        self.rel_w = torch.einsum("bnyxc,xkc->bnyxk", grid, rw).reshape(*q.shape[:2], h * w, w)
        self.keys = (h, w)

    def __call__(self, scores: torch.Tensor, rows: slice | None) -> torch.Tensor:
        rel_h = self.rel_h if rows is None else self.rel_h[..., rows, :]
        rel_w = self.rel_w if rows is None else self.rel_w[..., rows, :]
        on_grid = scores.view(*scores.shape[:-1], *self.keys)  # [B, heads, rows, k_h, k_w] (the keys are contiguous)
        if scores.requires_grad:
            return (on_grid + rel_h[..., :, None] + rel_w[..., None, :]).reshape(scores.shape)
        on_grid.add_(rel_h[..., :, None]).add_(rel_w[..., None, :])
        return scores


def sam_inline(modules: Sequence[nn.Module], capture: CaptureRequest, handles: Handles) -> None:
    """Inline capture of timm's SAM ``Attention``: each module's forward, for the session, is its non-fused path
    computed by vitlens (``attention_output_in_rows``): the q, k, v projection (``linear_in``), q/k norms, RoPE or
    the decomposed relative-position bias (``DecomposedBias``), the probabilities softmax(q k^T * scale + bias) made
    once and handed to the capture whole, [B * windows, heads, N, N] (the windowed views read whole window maps),
    before the output is computed from them, then the output projection; the output is the non-fused path's up to
    float rounding (the bias's two tables added one after the other). Where the request lets maps be reused
    (``CaptureRequest.reuse_maps``, detached), every block's map, q, k, v and output are made in one workspace for
    the session (no fresh 0.8 GB map per global block at 1024 px); otherwise each map is a fresh tensor the capture
    may keep. Under autocast the probabilities are float32 and the product with v runs in v's dtype."""
    from timm.layers import apply_rot_embed_cat

    workspace: dict | None = {} if capture.reuse_maps and capture.detach else None
    for layer, attn in enumerate(modules):
        def forward(x: torch.Tensor, attn: nn.Module = attn, layer: int = layer,
                    taps: Callable[[slice, tuple], Any] | None = capture.taps_for(layer)) -> torch.Tensor:
            def on_probs(probs: torch.Tensor, _rows: slice | None) -> None:
                capture(layer, probs.detach() if capture.detach else probs)  # whole: one block of every row

            b, h, w, _ = x.shape
            n = h * w
            qkv = linear_in(workspace, QKV_BUFFER, attn.qkv, x.reshape(b, n, -1))
            q, k, v = qkv.view(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # [B_, heads, N, d]
            q, k = attn.q_norm(q), attn.k_norm(k)
            biases: tuple = ()
            if attn.use_rel_pos:
                biases = (DecomposedBias(attn, q, (h, w)),)
            elif attn.rope is not None:
                rope = attn.rope.get_embed()
                q, k = apply_rot_embed_cat(q, rope).type_as(v), apply_rot_embed_cat(k, rope).type_as(v)
            with torch.autocast(device_type=x.device.type, enabled=False):
                out = attention_output_in_rows(q, k, v, attn.scale, n if workspace is not None else None, on_probs,
                                               drop=attn.attn_drop, workspace=workspace, taps=taps, biases=biases)
            out = out.transpose(1, 2).reshape(b, n, -1)
            return attn.proj_drop(attn.proj(out)).view(b, h, w, -1)

        handles.set_attr(attn, "forward", forward)


register(TimmSam())
