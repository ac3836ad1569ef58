"""timm's Swin Transformer (``swin_*``): windowed attention (W-MSA), shifted windows (SW-MSA) with their mask,
a relative-position bias inside each window, and patch merging between stages.

Capture. Each block's ``WindowAttention`` attends within windows: its probabilities are
[B * windows, heads, N, N] (N = window_h * window_w), batch-major as timm partitions them. Where the module
runs its non-fused path (timm's default for Swin), the probabilities are read as they enter ``attn_drop``:
the model's own, so side and inline capture are the same and the outputs are untouched. Where it runs
``F.scaled_dot_product_attention`` (``fused_attn``), side capture reads that one call (generic call-level
capture: softmax(q k^T * scale + bias + mask) from its very arguments, the real output kept) and inline
capture turns the non-fused path on for the session.

Geometry (``windows``). Which stage token each position of each window holds is found by running each
block's own ``_attn`` (cyclic shift, padding, window partition) on a grid of token numbers, with a recorder
in place of its attention, on a stand-in that leaves the model as it is: the shift is undone and padding
found by the model's own code, never re-derived. The recorder also reads the mask the block hands its
attention, which says which keys a query of a shifted window may attend.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..core.attention import attention_probs, conv_filters
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry
from ..errors import UnsupportedModelError
from .base import CaptureAbilities, CaptureRequest, Family, Handles, refuse_other_size, register
from .sdpa_calls import CallMode, sdpa_arguments
from .timm_vit import timm_data_config


class _Stand_in:
    """A block seen through a stand-in: every attribute the block's, but ``attn`` replaced (nothing is set on the
    block, so a forward of another thread is not touched)."""

    def __init__(self, block: nn.Module, attn: Callable[..., torch.Tensor]) -> None:
        self._block, self.attn = block, attn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._block, name)


def block_windows(block: nn.Module, grid: tuple[int, int], stage: int, stride: tuple[int, int]) -> WindowGeometry:
    """One Swin block's windows on its stage grid, read through the block's own ``_attn`` (module docstring).

    Args:
        block: a timm ``SwinTransformerBlock``.
        grid: (H_s, W_s) its stage's token grid.
        stage: the stage's number.
        stride: (sy, sx) pixels between the stage's tokens.

    Returns:
        The ``WindowGeometry`` of the block.
    """
    seen: dict[str, Any] = {}

    def recorder(x_windows: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        seen["windows"], seen["mask"] = x_windows[..., 0].clone(), mask
        return x_windows

    h, w = grid
    numbers = torch.arange(1, h * w + 1, dtype=torch.float64).reshape(1, h, w, 1)  # 0 is the padding
    with torch.no_grad():
        type(block)._attn(_Stand_in(block, recorder), numbers)
    index = seen["windows"].round().long().numpy() - 1  # [windows, N], -1 where padded
    mask = seen["mask"]
    valid = index >= 0
    allowed = np.broadcast_to(valid[:, None, :], (*index.shape, index.shape[1])).copy()
    if mask is not None:  # timm's 0 / -100 mask of the shifted windows: attend where 0
        allowed &= mask.detach().cpu().numpy() > -1.0
    shifted = any(int(s) for s in block.shift_size)
    kind = "shifted window" if shifted else ("global" if index.shape[0] == 1 and valid.all() else "window")
    return WindowGeometry(stage=stage, grid=(int(h), int(w)), stride_px=(int(stride[0]), int(stride[1])),
                          index=index, allowed=allowed, kind=kind)


class TimmSwin(Family):
    """timm ``SwinTransformer``: read block by block through its windows (module docstring)."""

    name = "timm-swin"
    reads = ("timm Swin Transformer (swin_*): windowed and shifted-window attention with relative-position bias, "
             "patch merging; attention distance in image pixels per stage and rollout through the stages")
    names = ("timm names: swin_tiny_patch4_window7_224, swin_base_patch4_window12_384 (timm.list_models('swin_*'))",)
    capture = CaptureAbilities(view_mode="side")  # side reads the model's own probabilities on its non-fused path
    attention_inputs = ("norm1",)

    def matches(self, model: nn.Module) -> bool:
        from timm.models.swin_transformer import SwinTransformer

        return isinstance(model, SwinTransformer)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.layers import PatchEmbed
        from timm.models.swin_transformer import PatchMerging, SwinTransformerBlock, WindowAttention

        if not isinstance(model.patch_embed, PatchEmbed) or str(getattr(model.patch_embed, "output_fmt", "")) not in (
                "Format.NHWC", "NHWC"):
            raise UnsupportedModelError(f"{name!r}: its patch embedding is a {type(model.patch_embed).__name__} that "
                                        "does not hand the stages an NHWC grid; vitlens reads timm's Swin layout.")
        for s, stage in enumerate(model.layers):
            if not isinstance(stage.downsample, (nn.Identity, PatchMerging)):
                raise UnsupportedModelError(f"{name!r}: stage {s} downsamples with {type(stage.downsample).__name__}; "
                                            "vitlens reads timm's PatchMerging (2x2 tokens into one).")
            for i, block in enumerate(stage.blocks):
                if type(block) is not SwinTransformerBlock or type(block.attn) is not WindowAttention:
                    raise UnsupportedModelError(
                        f"{name!r}: stage {s} block {i} is a {type(block).__name__} with "
                        f"{type(getattr(block, 'attn', None)).__name__}; vitlens reads timm's SwinTransformerBlock with "
                        "WindowAttention exactly and refuses others.")
                if getattr(block, "dynamic_mask", False):
                    raise UnsupportedModelError(f"{name!r}: stage {s} block {i} builds its mask at every forward "
                                                "(dynamic_mask); vitlens reads Swin at its built size.")

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(stage, block) of every block, first to last."""
        return [(s, block) for s, stage in enumerate(model.layers) for block in stage.blocks]

    def stage_grids(self, model: nn.Module) -> list[tuple[int, int]]:
        """The token grid of every stage at the built size (each patch merging: ceil(H / 2) x ceil(W / 2))."""
        from timm.models.swin_transformer import PatchMerging

        h, w = (int(g) for g in model.patch_embed.grid_size)
        grids = []
        for stage in model.layers:
            if isinstance(stage.downsample, PatchMerging):
                h, w = -(-h // 2), -(-w // 2)
            grids.append((h, w))
        return grids

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        pe = model.patch_embed
        refuse_other_size(name, self.name, pe.img_size, input_size)
        blocks = self.blocks(model)
        return ModelSpec(
            name=name, kind="hierarchical", image_size=tuple(int(s) for s in pe.img_size),  # type: ignore[arg-type]
            grid=tuple(int(g) for g in pe.grid_size),  # type: ignore[arg-type]
            stride_px=tuple(int(p) for p in pe.patch_size),  # type: ignore[arg-type]
            num_prefix_tokens=0, num_layers=len(blocks),
            num_heads=max(int(b.attn.num_heads) for _s, b in blocks), embed_dim=int(model.embed_dim),
            has_class_token=False, has_pos_embed=getattr(model, "absolute_pos_embed", None) is not None,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        grids = self.stage_grids(model)
        patch = tuple(int(p) for p in model.patch_embed.patch_size)
        out = []
        for stage, block in self.blocks(model):
            stride = (patch[0] * 2 ** stage, patch[1] * 2 ** stage) if stage else patch
            out.append(block_windows(block, grids[stage], stage, stride))
        return out

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.attn for _s, block in self.blocks(model)]

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            if attn.fused_attn:
                _read_sdpa_call(attn, layer, capture, handles)
            else:
                _read_at_attn_drop(attn, layer, capture, handles)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            if attn.fused_attn:
                handles.set_attr(attn, "fused_attn", False)
            _read_at_attn_drop(attn, layer, capture, handles)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj  # the heads meet at the output projection

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.proj, "patch_embed.proj", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        pos = getattr(model, "absolute_pos_embed", None)
        if pos is None:
            return None
        return pos.detach().reshape(1, -1, pos.shape[-1]), spec.grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("Swin adds a learned relative-position bias inside each window instead of a learned absolute "
                "position table")

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


def _read_at_attn_drop(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """The non-fused path's own probabilities [B * windows, heads, N, N], as they enter dropout."""
    def pre_hook(_mod: nn.Module, args: tuple) -> None:
        probs = args[0]
        capture(layer, probs.detach().float() if capture.detach else probs)

    handles.hook(attn.attn_drop.register_forward_pre_hook(pre_hook))


def _read_sdpa_call(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """Side capture of a fused ``WindowAttention``: its one SDPA call's probabilities, the real output kept."""
    original = attn.forward

    def on_call(a: tuple, kw: dict) -> torch.Tensor:
        call = sdpa_arguments(a, kw)
        q, k = call["query"], call["key"]
        scale = call["scale"] if call["scale"] is not None else q.shape[-1] ** -0.5
        out = F.scaled_dot_product_attention(*a, **kw)
        with torch.no_grad(), torch.autocast(device_type=q.device.type, enabled=False):
            capture(layer, attention_probs(q, k, scale, call["attn_mask"], bool(call["is_causal"])))
        return out

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        with CallMode(on_call):
            return original(*args, **kwargs)

    handles.set_attr(attn, "forward", forward)


register(TimmSwin())
