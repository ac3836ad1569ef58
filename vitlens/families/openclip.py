"""OpenCLIP (``open_clip``): the image tower of a CLIP model, its text tower left as it is.

Two kinds of image tower:

- open_clip's own ``VisionTransformer`` (``ViT-B-32``, ``ViT-L-14``, ...): a class token, a learned
  position table, blocks of ``ResidualAttentionBlock`` whose ``nn.MultiheadAttention`` is called with
  ``need_weights=False`` (the fused path). Capture is torchvision's (the same module, called the
  same way): side capture forms q and k from the block's input with the module's own packed
  in-projection and computes softmax(q / sqrt(head_dim) @ k^T), as the module returns with
  ``need_weights=True, average_attn_weights=False``; inline capture recomputes each block's
  attention on that non-fused path and returns it in place of the module's output.
- a timm trunk (``TimmModel``: the SigLIP, PE-Core, EVA and other ``timm_model_name`` configs): read
  by the trunk's own timm family (exact as there), with open_clip's preprocessing and output.

The output is ``encode_image`` (the projected image embedding, not normalised): a feature model,
no classifier. Blocks open_clip builds with its own ``Attention`` (``CustomResidualAttentionBlock``:
qk-norm, scaled-cosine or head-scale options; no built-in config uses them for images) and
attentional poolers over the tokens (CoCa) are refused, naming what would be wrong.

open_clip is an optional dependency (``pip install 'vitlens[openclip]'``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..core.spec import ModelSpec
from .base import Emit, Family, Handles, refuse_other_size, register
from ..core.attention import conv_filters
from .torchvision_vit import TorchvisionViT

#: open_clip's resize modes -> timm's crop modes
_RESIZE_MODES = {"shortest": "center", "squash": "squash", "longest": "border"}


def is_open_clip(model: nn.Module) -> bool:
    return type(model).__module__.startswith("open_clip.")


def visual_of(model: nn.Module) -> nn.Module:
    """The image tower: ``model.visual`` of a CLIP model, or the tower itself."""
    visual = getattr(model, "visual", None)
    return visual if isinstance(visual, nn.Module) else model


def open_clip_data_config(model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
    """timm-style preprocessing from the tower's ``preprocess_cfg`` (set by ``create_model``), else CLIP's."""
    from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

    pp = dict(getattr(visual_of(model), "preprocess_cfg", None) or {})
    return {"input_size": (3, *spec.image_size), "interpolation": pp.get("interpolation", "bicubic"),
            "mean": tuple(pp.get("mean", OPENAI_DATASET_MEAN)), "std": tuple(pp.get("std", OPENAI_DATASET_STD)),
            "crop_pct": 1.0, "crop_mode": _RESIZE_MODES.get(pp.get("resize_mode", "shortest"), "center")}


def encode_image(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    encode = getattr(model, "encode_image", None)
    return encode(x) if encode is not None else model(x)


class OpenClipViT(TorchvisionViT):
    """open_clip's own ``VisionTransformer``: nn.MultiheadAttention blocks, captured as torchvision's."""

    name = "openclip-vit"
    reads = "OpenCLIP image towers built on open_clip's own VisionTransformer (CLIP ViT-B/L/H...); needs open_clip_torch"
    names = ("open_clip:ARCH (random init, e.g. open_clip:ViT-B-32) or open_clip:ARCH/TAG (the tag's weights, from "
             "the local cache only)",)
    view_mode = "side"

    def matches(self, model: nn.Module) -> bool:
        if not is_open_clip(model):
            return False
        from open_clip.transformer import VisionTransformer

        return isinstance(visual_of(model), VisionTransformer)

    def check(self, model: nn.Module, name: str) -> None:
        from open_clip.transformer import ResidualAttentionBlock

        visual = visual_of(model)
        for i, block in enumerate(visual.transformer.resblocks):
            if type(block) is not ResidualAttentionBlock:
                raise UnsupportedModelError(
                    f"{name!r}: image block {i} is a {type(block).__name__} (open_clip's own Attention, with qk-norm, "
                    "scaled-cosine or head-scale options); vitlens reads open_clip's ResidualAttentionBlock with "
                    "nn.MultiheadAttention only.")
            mha = block.attn
            if hasattr(block, "ln_1_kv") or not (mha.batch_first and mha._qkv_same_embed_dim
                                                 and mha.in_proj_weight is not None):
                raise UnsupportedModelError(f"{name!r}: image block {i}'s attention is not batch-first self-attention "
                                            "with a packed in-projection.")
        if getattr(visual, "attn_pool", None) is not None:
            raise UnsupportedModelError(
                f"{name!r}: its image tower pools through an attentional pooler (CoCa) whose queries replace the "
                "tokens; vitlens reads towers that pool the class token or the mean.")

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.attn for block in visual_of(model).transformer.resblocks]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        visual = visual_of(model)
        size = tuple(int(s) for s in visual.image_size)
        refuse_other_size(name, self.name, size, input_size)
        patch = tuple(int(p) for p in visual.patch_size)
        grid = (size[0] // patch[0], size[1] // patch[1])
        blocks = visual.transformer.resblocks
        return ModelSpec(
            name=name, kind="vit", image_size=size, grid=grid, stride_px=patch,  # type: ignore[arg-type]
            num_prefix_tokens=1, num_layers=len(blocks), num_heads=int(blocks[0].attn.num_heads),
            embed_dim=int(visual.transformer.width), has_class_token=True,
            has_pos_embed=not _is_sincos(visual, grid), pos_embed_prefix=1, num_classes=0,
            num_params=sum(p.numel() for p in model.parameters()), family=self.name, prefix_labels=("class",))

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        prefix = "visual." if visual_of(model) is not model else ""
        return conv_filters(visual_of(model).conv1, f"{prefix}conv1", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        visual = visual_of(model)
        if _is_sincos(visual, spec.grid):
            return None
        return visual.positional_embedding.detach()[1:].unsqueeze(0), spec.grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("this open_clip tower adds a fixed 2-D sin-cos position table (pos_embed_type='sin_cos_2d'), not a "
                "learned one")

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return open_clip_data_config(model, spec)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return encode_image(model, x)


def _is_sincos(visual: nn.Module, grid: tuple[int, int]) -> bool:
    """Whether the tower's position table is open_clip's fixed 2-D sin-cos one."""
    from open_clip.pos_embed import get_2d_sincos_pos_embed

    if grid[0] != grid[1]:
        return False
    table = torch.from_numpy(get_2d_sincos_pos_embed(int(visual.positional_embedding.shape[1]), grid[0],
                                                     cls_token=True)).float()
    return torch.equal(visual.positional_embedding.detach().cpu().float(), table)


class OpenClipTimm(Family):
    """An open_clip model whose image tower wraps a timm trunk (``TimmModel``): the trunk's own timm family
    captures it (every timm family captures inline at its non-fused path, the views' default); open_clip
    gives the preprocessing and the output."""

    name = "openclip-timm"
    reads = "OpenCLIP image towers on a timm trunk (SigLIP, PE-Core, EVA configs), read by the trunk's timm family"
    names = ("open_clip:ARCH, e.g. open_clip:ViT-B-16-SigLIP, open_clip:PE-Core-T-16-384",)

    @staticmethod
    def _inner(model: nn.Module) -> tuple[nn.Module, Family]:
        from .base import family_of

        trunk = visual_of(model).trunk
        return trunk, family_of(trunk, type(trunk).__name__)

    def matches(self, model: nn.Module) -> bool:
        if not is_open_clip(model):
            return False
        from open_clip.timm_model import TimmModel

        return isinstance(visual_of(model), TimmModel)

    def check(self, model: nn.Module, name: str) -> None:
        from .base import family_of

        trunk = visual_of(model).trunk
        try:
            family_of(trunk, name)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{name!r}: open_clip's image tower is the timm model "
                                        f"{type(trunk).__name__}, which vitlens refuses: {e}") from e

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        trunk, inner = self._inner(model)
        spec = inner.spec(trunk, name, input_size)
        return dataclasses.replace(spec, family=f"{self.name}:{inner.name}", num_classes=0,
                                   num_params=sum(p.numel() for p in model.parameters()))

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        trunk, inner = self._inner(model)
        return inner.attention_modules(trunk)

    def install_side(self, model: nn.Module, emit: Emit, handles: Handles) -> None:
        trunk, inner = self._inner(model)
        inner.install_side(trunk, emit, handles)

    def install_inline(self, model: nn.Module, emit: Emit, handles: Handles, detach: bool) -> None:
        trunk, inner = self._inner(model)
        inner.install_inline(trunk, emit, handles, detach)

    def install_pool(self, model: nn.Module, emit: Emit, handles: Handles) -> None:
        trunk, inner = self._inner(model)
        inner.install_pool(trunk, emit, handles)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return None  # a feature model: no classifier whose logit a head could lower

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        trunk, inner = self._inner(model)
        w, where, what = inner.pixel_filters(trunk, spec)
        return w, f"visual.trunk.{where}", what.replace(where, f"visual.trunk.{where}", 1)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        trunk, inner = self._inner(model)
        return inner.position_table(trunk, spec)

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        trunk, inner = self._inner(model)
        return inner.no_position_reason(trunk, spec)

    def relative_bias(self, model: nn.Module, spec: ModelSpec) -> Any:
        trunk, inner = self._inner(model)
        return inner.relative_bias(trunk, spec)

    def no_relative_bias_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        trunk, inner = self._inner(model)
        return inner.no_relative_bias_reason(trunk, spec)

    def grid_for(self, model: nn.Module, spec: ModelSpec, input_hw: tuple[int, int]) -> tuple[int, int]:
        trunk, inner = self._inner(model)
        return inner.grid_for(trunk, spec, input_hw)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return open_clip_data_config(model, spec)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return encode_image(model, x)


register(OpenClipViT())
register(OpenClipTimm())
