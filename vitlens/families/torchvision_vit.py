"""torchvision's ``VisionTransformer`` (``vit_b_16``, ``vit_l_16``, ...): blocks of
``nn.MultiheadAttention``.

Each block calls its ``self_attention`` with ``need_weights=False`` (the fused path), captured as every such block
is (``vitlens.families.common.mha.MultiheadAttentionViT``): side capture forms q and k with the module's own packed
in-projection beside the untouched output; inline capture computes each block's attention on the non-fused path
and returns it in place of the module's own output, so the block's output is computed from the captured weights
(what gradient methods need).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..core.spec import ModelSpec
from ..kinds import VIT
from .base import CaptureAbilities, refuse_other_size, register
from ..core.attention import conv_filters
from .common.hf import IMAGENET_MEAN, IMAGENET_STD
from .common.mha import MultiheadAttentionViT


class TorchvisionViT(MultiheadAttentionViT):
    name = "torchvision-vit"
    summary = "torchvision ViTs (vit_b_16, ...)"
    reads = "torchvision VisionTransformer (vit_b_16, vit_l_16, ...)"
    names = ("torchvision:vit_b_16, torchvision:vit_l_32, ... (torchvision's ViTs)",)
    capture = CaptureAbilities(view_mode="side")  # inline recomputes the attention on top of the module's own
    attention_inputs = ("ln_1",)

    def matches(self, model: nn.Module) -> bool:
        if not type(model).__module__.startswith("torchvision."):
            return False
        from torchvision.models.vision_transformer import VisionTransformer

        return isinstance(model, VisionTransformer)

    def check(self, model: nn.Module, name: str) -> None:
        from torchvision.models.vision_transformer import EncoderBlock

        for i, block in enumerate(model.encoder.layers):
            mha = getattr(block, "self_attention", None)
            if type(block) is not EncoderBlock or not isinstance(mha, nn.MultiheadAttention):
                raise UnsupportedModelError(f"{name!r}: block {i} is a {type(block).__name__}; vitlens reads "
                                            "torchvision's EncoderBlock with nn.MultiheadAttention.")
            if not (mha.batch_first and mha._qkv_same_embed_dim and mha.in_proj_weight is not None):
                raise UnsupportedModelError(f"{name!r}: block {i}'s attention is not batch-first self-attention "
                                            "with a packed in-projection.")

    def attention_modules(self, model: nn.Module) -> Sequence[nn.MultiheadAttention]:
        return [block.self_attention for block in model.encoder.layers]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        size, patch = int(model.image_size), int(model.patch_size)
        refuse_other_size(name, self.name, (size, size), input_size)
        head = model.heads[-1] if isinstance(model.heads, nn.Sequential) else model.heads
        return ModelSpec(
            name=name, kind=VIT.name, image_size=(size, size), grid=(size // patch, size // patch),
            stride_px=(patch, patch),
            num_prefix_tokens=1, num_layers=len(model.encoder.layers),
            num_heads=int(model.encoder.layers[0].self_attention.num_heads), embed_dim=int(model.hidden_dim),
            has_class_token=True, has_pos_embed=True, pos_embed_prefix=1,
            num_classes=int(getattr(head, "out_features", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name, prefix_labels=("class",))

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.conv_proj, "conv_proj", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return model.encoder.pos_embedding.detach()[:, 1:], spec.grid

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        # torchvision's ImageClassification for its ViT weights: resize 256, centre crop 224, bilinear
        return {"input_size": (3, *spec.image_size), "interpolation": "bilinear", "mean": IMAGENET_MEAN,
                "std": IMAGENET_STD, "crop_pct": 224 / 256, "crop_mode": "center"}


register(TorchvisionViT())
