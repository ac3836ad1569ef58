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

The output is ``encode_image`` (the projected image embedding; CoCa's is normalised): a feature model,
no classifier. Blocks open_clip builds with its own ``Attention`` (``CustomResidualAttentionBlock``:
qk-norm, head-scale, inner-norm options; no built-in config uses them for images) are refused here with
``AttentionClassUnknown`` and read by the generic call-level capture (``vitlens.families.common.layouts``'s
``OpenClipLayout``) at their one ``scaled_dot_product_attention`` call; scaled-cosine attention (an
explicit softmax) is refused there in one line.

CoCa's attentional pooler (``attn_pool``: learned queries over every token, an ``nn.MultiheadAttention``)
is read as the tower's pool attention (``install_attentional_pool``, what ``capture_pool_attention`` shows),
beside the untouched forward: [B, heads, queries, T]. In open_clip's original CoCa setup the image
embedding is the output of query 0 (the other queries are the tokens the text decoder reads); in the
'parallel' setup it is ``attn_pool_contrastive``'s one query, which is then the pool read. The 'cascade'
setup's contrastive pool reads the first pool's outputs, not the image's tokens, and is refused as a pool.

open_clip is an optional dependency (``pip install 'vitlens[openclip]'``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry
from ..kinds import VIT
from .base import (Adapter, AttentionClassUnknown, CaptureAbilities, CaptureRequest, Family, Handles, family_of,
                   refuse_other_size, register)
from ..core.attention import conv_filters
from .common.mha import MultiheadAttentionViT
from .common.openclip import (encode_image, install_attentional_pool, is_open_clip, is_sincos, open_clip_data_config,
                              visual_of)


class OpenClipViT(MultiheadAttentionViT):
    """open_clip's own ``VisionTransformer``: nn.MultiheadAttention blocks, captured as torchvision's."""

    name = "openclip-vit"
    summary = "OpenCLIP image towers of nn.MultiheadAttention blocks"
    reads = ("OpenCLIP image towers built on open_clip's own VisionTransformer (CLIP ViT-B/L/H..., CoCa with its "
             "attentional pooler read as the pool attention); needs open_clip_torch")
    names = ("open_clip:ARCH (random init, e.g. open_clip:ViT-B-32) or open_clip:ARCH/TAG (the tag's weights, from "
             "the local cache only)",)
    capture = CaptureAbilities(view_mode="side")
    attention_inputs = ("ln_1",)

    def matches(self, model: nn.Module) -> bool:
        if not is_open_clip(model):
            return False
        from open_clip.transformer import VisionTransformer

        return isinstance(visual_of(model), VisionTransformer)

    def check(self, model: nn.Module, name: str) -> None:
        from open_clip.transformer import ResidualAttentionBlock


        visual = visual_of(model)
        for i, block in enumerate(visual.transformer.resblocks):
            if type(block) is not ResidualAttentionBlock:  # the generic call-level capture may read it
                raise AttentionClassUnknown(
                    f"{name!r}: image block {i} is a {type(block).__name__} (open_clip's own Attention, with qk-norm, "
                    "scaled-cosine or head-scale options); vitlens reads open_clip's ResidualAttentionBlock with "
                    "nn.MultiheadAttention, and open_clip's Attention at its scaled_dot_product_attention call.")
            mha = block.attn
            if hasattr(block, "ln_1_kv") or not (mha.batch_first and mha._qkv_same_embed_dim
                                                 and mha.in_proj_weight is not None):
                raise UnsupportedModelError(f"{name!r}: image block {i}'s attention is not batch-first self-attention "
                                            "with a packed in-projection.")

    def attention_modules(self, model: nn.Module) -> Sequence[nn.MultiheadAttention]:
        return [block.attn for block in visual_of(model).transformer.resblocks]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        visual = visual_of(model)
        size = tuple(int(s) for s in visual.image_size)
        refuse_other_size(name, self.name, size, input_size)
        patch = tuple(int(p) for p in visual.patch_size)
        grid = (size[0] // patch[0], size[1] // patch[1])
        blocks = visual.transformer.resblocks
        return ModelSpec(
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            name=name, kind=VIT.name, image_size=size, grid=grid, stride_px=patch,  # type: ignore[arg-type]
            num_prefix_tokens=1, num_layers=len(blocks), num_heads=int(blocks[0].attn.num_heads),
            embed_dim=int(visual.transformer.width), has_class_token=True,
            has_pos_embed=not is_sincos(visual, grid), pos_embed_prefix=1, num_classes=0,
            num_params=sum(p.numel() for p in model.parameters()), family=self.name, prefix_labels=("class",))

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        prefix = "visual." if visual_of(model) is not model else ""
        return conv_filters(visual_of(model).conv1, f"{prefix}conv1", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        visual = visual_of(model)
        if is_sincos(visual, spec.grid):
            return None
        return visual.positional_embedding.detach()[1:].unsqueeze(0), spec.grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("this open_clip tower adds a fixed 2-D sin-cos position table (pos_embed_type='sin_cos_2d'), not a "
                "learned one")

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return open_clip_data_config(model, spec)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return encode_image(model, x)

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        """CoCa's attentional pooler (``install_attentional_pool``)."""
        install_attentional_pool(model, capture, handles)


class OpenClipTimm(Adapter):
    """An open_clip model whose image tower wraps a timm trunk (``TimmModel``): the trunk's own timm family
    reads it (an ``Adapter``: capture, abilities, position table, grid are the trunk family's, exact as
    there); open_clip gives the spec's name, the preprocessing and the output."""

    name = "openclip-timm"
    summary = "OpenCLIP image towers on a timm trunk"
    reads = "OpenCLIP image towers on a timm trunk (SigLIP, PE-Core, EVA configs), read by the trunk's timm family"
    names = ("open_clip:ARCH, e.g. open_clip:ViT-B-16-SigLIP, open_clip:PE-Core-T-16-384",)

    def inner(self, model: nn.Module) -> tuple[nn.Module, Family]:
        trunk = visual_of(model).trunk
        return trunk, family_of(trunk, type(trunk).__name__)

    def matches(self, model: nn.Module) -> bool:
        if not is_open_clip(model):
            return False
        from open_clip.timm_model import TimmModel

        return isinstance(visual_of(model), TimmModel) and not _windowed_trunk(model)

    def check(self, model: nn.Module, name: str) -> None:
        trunk = visual_of(model).trunk
        try:
            family_of(trunk, name)
        except UnsupportedModelError as e:
            raise UnsupportedModelError(f"{name!r}: open_clip's image tower is the timm model "
                                        f"{type(trunk).__name__}, which vitlens refuses: {e}") from e

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        trunk, inner = self.inner(model)
        spec = inner.spec(trunk, name, input_size)
        return dataclasses.replace(spec, family=f"{self.name}:{inner.name}", num_classes=0,
                                   num_params=sum(p.numel() for p in model.parameters()))

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return None  # a feature model: no classifier whose logit a head could lower

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        trunk, inner = self.inner(model)
        w, where, what = inner.pixel_filters(trunk, spec)
        return w, f"visual.trunk.{where}", what.replace(where, f"visual.trunk.{where}", 1)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return open_clip_data_config(model, spec)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return encode_image(model, x)


def _windowed_trunk(model: nn.Module) -> bool:
    """Whether an open_clip tower's timm trunk is read by a family whose blocks attend in windows (a timm Swin)."""
    try:
        return family_of(visual_of(model).trunk).windows is not None
    except UnsupportedModelError:
        return False


class OpenClipTimmWindowed(OpenClipTimm):
    """An open_clip tower on a windowed timm trunk (``swin_base_patch4_window7_224``): as ``OpenClipTimm``, and the
    windowed views follow the trunk (its family's windows and stage grids, on the trunk's tokens, which are the
    tokens the capture reads)."""

    name = "openclip-timm-windowed"
    summary = "OpenCLIP image towers on a windowed timm trunk"
    reads = ("OpenCLIP image towers on a windowed timm trunk (a timm Swin), read by the trunk's timm family with its "
             "windows: distance in image pixels per stage, rollout through the windows and patch mergings")
    names = ("open_clip:ARCH of a timm Swin tower, e.g. open_clip:swin_base_patch4_window7_224",)

    def matches(self, model: nn.Module) -> bool:
        if not is_open_clip(model):
            return False
        from open_clip.timm_model import TimmModel

        return isinstance(visual_of(model), TimmModel) and _windowed_trunk(model)

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        trunk, inner = self.inner(model)
        if inner.windows is None:  # (matches() takes only a trunk whose family has windows)
            raise UnsupportedModelError(f"{type(trunk).__name__} no longer attends in windows.")
        return inner.windows(trunk, input_hw)

    def stage_layout(self, model: nn.Module) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        trunk, inner = self.inner(model)
        if inner.stage_layout is not None:
            return inner.stage_layout(trunk)
        spec = inner.spec(trunk, type(trunk).__name__)  # one stage: the spec's one grid
        return [(spec.grid, spec.stride_px)]


register(OpenClipViT())
register(OpenClipTimm())
register(OpenClipTimmWindowed())
