"""timm's EVA and EVA-02 (``timm.models.eva.Eva``), and the other ``Eva``-built RoPE ViTs whose blocks
use timm's ``AttentionRope``: Perception Encoder (``vit_pe_*``), RoPE-ViT axial and mixed
(``vit_*_rope_224``, ``vit_*_rope_mixed_224``, ``*_ape``), the ``*_rope_reg*_gap`` models and
DINOv3 ports: attention with rotary position embeddings.

Each block's queries and keys pass q_norm / k_norm, then the patch tokens' q and k are rotated
by the rotary embedding the model hands the block (prefix tokens are not rotated), then
softmax(q * scale @ k^T + mask). Side capture hooks ``q_norm`` and ``k_norm`` and applies the
block's own rotary embedding with timm's own function, casting back to the projection's dtype
as the block does; inline capture turns ``fused_attn`` off and reads the probabilities as they
enter ``attn_drop``. ``AttentionRope`` computes its scores the same way (only its output gate,
scale norm and grouped-query key/value heads differ; the key heads are repeated to the query heads
after norm and RoPE, as the block does). Mixed RoPE hands each block its own (learned, per-head)
frequencies, which the hook reads from the block's call like any rotary embedding. SwiGLU MLPs
and the scale norms do not touch the maps. Variants without a learned absolute position table
(position only through RoPE) say so in the position view.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..core.spec import ModelSpec
from .base import CaptureAbilities, CaptureRequest, Handles, register
from .common.timm import TimmFamily, call_argument, check_patch_embed, install_qk_norm_hooks


def rotate(t: torch.Tensor, rope: torch.Tensor | None, num_prefix_tokens: int, half: bool,
           dtype: torch.dtype) -> torch.Tensor:
    """Apply the rotary embedding to the patch tokens of q or k [B, heads, T, d], as EvaAttention does."""
    if rope is None:
        return t
    from timm.layers.pos_embed_sincos import apply_rot_embed_cat

    npt = num_prefix_tokens
    return torch.cat([t[:, :, :npt, :], apply_rot_embed_cat(t[:, :, npt:, :], rope, half=half)], dim=2).to(dtype)


#: where ``EvaAttention.forward(x, rope, attn_mask, is_causal)`` takes its arguments
EVA_ARGS = {"rope": 1, "attn_mask": 2, "is_causal": 3}


def rotated(attn: nn.Module, q: torch.Tensor, k: torch.Tensor, call: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k after the block's rotary embedding, in the projection's dtype (as ``type_as(v)``)."""
    rope, half = call_argument(call, "rope", EVA_ARGS), bool(getattr(attn, "rotate_half", False))
    q = rotate(q, rope, attn.num_prefix_tokens, half, call["dtype"])
    k = rotate(k, rope, attn.num_prefix_tokens, half, call["dtype"])
    groups = int(getattr(attn, "num_kv_groups", 1) or 1)
    if groups > 1:  # AttentionRope's grouped-query attention: head h uses key head h // groups
        k = k.repeat_interleave(groups, dim=1)
    return q, k


class TimmEva(TimmFamily):
    name = "timm-eva"
    summary = "timm EVA and other RoPE models (eva02_*, vit_pe_*, *_rope_*)"
    capture = CaptureAbilities(side_rows=True)  # install_qk_norm_hooks
    reads = ("timm EVA and EVA-02, Perception Encoder and RoPE ViTs (AttentionRope: rotary position embeddings, "
             "grouped key heads)")
    names = ("timm names: eva02_tiny_patch14_224, eva02_base_patch14_224 (timm.list_models('eva*')), "
             "vit_pe_core_small_patch16_384, vit_small_patch16_rope_mixed_224",)

    def matches(self, model: nn.Module) -> bool:
        from timm.models.eva import Eva

        return isinstance(model, Eva)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.layers import AttentionRope, PatchEmbed
        from timm.models.eva import EvaAttention, EvaBlock, EvaBlockPostNorm

        check_patch_embed(model, name, (PatchEmbed,))
        for i, block in enumerate(model.blocks):
            if type(block) not in (EvaBlock, EvaBlockPostNorm) or type(block.attn) not in (EvaAttention, AttentionRope):
                raise UnsupportedModelError(
                    f"{name!r}: block {i} is a {type(block).__name__} with "
                    f"{type(getattr(block, 'attn', None)).__name__}; "
                    "vitlens reproduces timm's EvaBlock with EvaAttention or AttentionRope (rotary embeddings) exactly "
                    "and refuses others.")
            if block.attn.q_norm is block.attn.k_norm:
                raise UnsupportedModelError(f"{name!r}: block {i} shares one module as q_norm and k_norm.")

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        install_qk_norm_hooks(self.attention_modules(model), capture, handles, EVA_ARGS, rotated)

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("this EVA variant encodes position only through rotary embeddings (RoPE) applied to queries and "
                "keys, and has no learned absolute position table")

    def no_relative_bias_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        if getattr(model, "rope", None) is None:
            return super().no_relative_bias_reason(model, spec)
        return ("position enters its attention through rotary embeddings (RoPE) of queries and keys, not an additive "
                "bias" + ("; it also has a learned absolute table (the position view shows it)" if spec.has_pos_embed
                          else ""))


register(TimmEva())
