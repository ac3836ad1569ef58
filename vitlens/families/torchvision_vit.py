"""torchvision's ``VisionTransformer`` (``vit_b_16``, ``vit_l_16``, ...): blocks of
``nn.MultiheadAttention``.

Each block calls its ``self_attention`` with ``need_weights=False`` (the fused path). Side
capture takes the block's input from a pre-hook and forms q and k with the module's own packed
in-projection, then softmax(q / sqrt(head_dim) @ k^T), as ``nn.MultiheadAttention`` computes the
weights it returns with ``need_weights=True, average_attn_weights=False``; the block's own output
is untouched. Inline capture computes each block's attention on that non-fused path (the same
formula, then the output projection) and returns it in place of the module's own output, so the
block's output is computed from the captured weights (what gradient methods need).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModelError
from ..core.spec import ModelSpec
from ..kinds import VIT
from .base import CaptureAbilities, CaptureRequest, Family, Handles, refuse_other_size, register
from ..core.attention import attention_probs, conv_filters, mha_mask

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def call_mask(mha: nn.MultiheadAttention, q: torch.Tensor, k: torch.Tensor, args: tuple,
              kwargs: dict) -> torch.Tensor | None:
    """The additive mask [B, heads, T, T] of an ``nn.MultiheadAttention`` call (its ``key_padding_mask``
    and ``attn_mask``, keyword or positional, with the module's semantics: ``mha_mask``)."""
    padding = kwargs.get("key_padding_mask", args[3] if len(args) > 3 else None)
    mask = kwargs.get("attn_mask", args[5] if len(args) > 5 else None)
    return mha_mask(mask, padding, q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def heads_qkv(mha: nn.MultiheadAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, heads, T, head_dim] from the module's packed in-projection, as it forms them."""
    b, t, e = x.shape
    heads = mha.num_heads
    proj = F.linear(x, mha.in_proj_weight, mha.in_proj_bias)
    q, k, v = proj.unflatten(-1, (3, e)).unbind(-2)
    return tuple(z.reshape(b, t, heads, e // heads).transpose(1, 2) for z in (q, k, v))  # type: ignore[return-value]


class TorchvisionViT(Family):
    name = "torchvision-vit"
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

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.self_attention for block in model.encoder.layers]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        size, patch = int(model.image_size), int(model.patch_size)
        refuse_other_size(name, self.name, (size, size), input_size)
        head = model.heads[-1] if isinstance(model.heads, nn.Sequential) else model.heads
        return ModelSpec(
            name=name, kind=VIT.name, image_size=(size, size), grid=(size // patch, size // patch), stride_px=(patch, patch),
            num_prefix_tokens=1, num_layers=len(model.encoder.layers),
            num_heads=int(model.encoder.layers[0].self_attention.num_heads), embed_dim=int(model.hidden_dim),
            has_class_token=True, has_pos_embed=True, pos_embed_prefix=1,
            num_classes=int(getattr(head, "out_features", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name, prefix_labels=("class",))

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, mha in enumerate(self.attention_modules(model)):
            def pre_hook(mod: nn.Module, args: tuple, kwargs: dict, layer: int = layer) -> None:
                x = args[0] if args else kwargs["query"]
                with torch.no_grad():
                    q, k, _v = heads_qkv(mod, x)
                    with torch.autocast(device_type=x.device.type, enabled=False):
                        probs = attention_probs(q, k, math.sqrt(1.0 / q.shape[-1]),
                                                call_mask(mod, q, k, args, kwargs))
                capture(layer, probs)

            handles.hook(mha.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, mha in enumerate(self.attention_modules(model)):
            def recompute(mod: nn.Module, args: tuple, kwargs: dict, _out: tuple, layer: int = layer) -> tuple:
                x = args[0] if args else kwargs["query"]
                q, k, v = heads_qkv(mod, x)
                scores = (q * math.sqrt(1.0 / q.shape[-1])) @ k.transpose(-2, -1)
                mask = call_mask(mod, q, k, args, kwargs)
                probs = (scores if mask is None else scores + mask.to(scores.dtype)).softmax(dim=-1)
                capture(layer, probs.detach() if capture.detach else probs)
                b, h, t, d = q.shape
                out = F.linear((probs @ v).transpose(1, 2).reshape(b, t, h * d), mod.out_proj.weight, mod.out_proj.bias)
                return out, probs

            handles.hook(mha.register_forward_hook(recompute, with_kwargs=True))

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.conv_proj, "conv_proj", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return model.encoder.pos_embedding.detach()[:, 1:], spec.grid

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        # torchvision's ImageClassification for its ViT weights: resize 256, centre crop 224, bilinear
        return {"input_size": (3, *spec.image_size), "interpolation": "bilinear", "mean": IMAGENET_MEAN,
                "std": IMAGENET_STD, "crop_pct": 224 / 256, "crop_mode": "center"}


register(TorchvisionViT())
