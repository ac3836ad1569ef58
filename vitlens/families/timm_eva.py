"""timm's EVA and EVA-02 (``timm.models.eva.Eva``): attention with rotary position embeddings.

Each block's queries and keys pass q_norm / k_norm, then the patch tokens' q and k are rotated
by the rotary embedding the model hands the block (prefix tokens are not rotated), then
softmax(q * scale @ k^T + mask). Side capture hooks ``q_norm`` and ``k_norm`` and applies the
block's own rotary embedding with timm's own function, casting back to the projection's dtype
as the block does; inline capture turns ``fused_attn`` off and reads the probabilities as they
enter ``attn_drop``. SwiGLU MLPs and the scale norms do not touch the maps. Variants without a
learned absolute position table (position only through RoPE) say so in the position view.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..loading.spec import ModelSpec
from .base import Emit, Family, Handles, prefix_labels, register
from .timm_vit import attention_probs, conv_filters, inline_at_attn_drop, timm_data_config, timm_position_table


def rotate(t: torch.Tensor, rope: torch.Tensor | None, num_prefix_tokens: int, half: bool,
           dtype: torch.dtype) -> torch.Tensor:
    """Apply the rotary embedding to the patch tokens of q or k [B, heads, T, d], as EvaAttention does."""
    if rope is None:
        return t
    from timm.layers.pos_embed_sincos import apply_rot_embed_cat

    npt = num_prefix_tokens
    return torch.cat([t[:, :, :npt, :], apply_rot_embed_cat(t[:, :, npt:, :], rope, half=half)], dim=2).to(dtype)


class TimmEva(Family):
    name = "timm-eva"

    def matches(self, model: nn.Module) -> bool:
        from timm.models.eva import Eva

        return isinstance(model, Eva)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.layers import PatchEmbed
        from timm.models.eva import EvaAttention, EvaBlock, EvaBlockPostNorm

        if not isinstance(model.patch_embed, PatchEmbed):
            raise UnsupportedModelError(f"{name!r} embeds patches with {type(model.patch_embed).__name__}; "
                                        "vitlens supports EVA with timm's PatchEmbed.")
        for i, block in enumerate(model.blocks):
            if type(block) not in (EvaBlock, EvaBlockPostNorm) or type(block.attn) is not EvaAttention:
                raise UnsupportedModelError(
                    f"{name!r}: block {i} is a {type(block).__name__} with {type(getattr(block, 'attn', None)).__name__}; "
                    "vitlens reproduces timm's EvaBlock / EvaAttention (rotary embeddings) exactly and refuses others.")
            if block.attn.q_norm is block.attn.k_norm:
                raise UnsupportedModelError(f"{name!r}: block {i} shares one module as q_norm and k_norm.")

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        pe = model.patch_embed
        grid = tuple(int(g) for g in pe.grid_size)
        pos = getattr(model, "pos_embed", None)
        return ModelSpec(
            name=name, kind="vit", image_size=tuple(int(s) for s in pe.img_size),  # type: ignore[arg-type]
            grid=grid, stride_px=tuple(int(s) for s in pe.patch_size),  # type: ignore[arg-type]
            num_prefix_tokens=int(model.num_prefix_tokens), num_layers=len(model.blocks),
            num_heads=int(model.blocks[0].attn.num_heads), embed_dim=int(model.embed_dim),
            has_class_token=getattr(model, "cls_token", None) is not None, has_pos_embed=pos is not None,
            pos_embed_prefix=0 if pos is None else int(pos.shape[1]) - grid[0] * grid[1],
            num_classes=int(getattr(model, "num_classes", 0)),
            num_params=sum(p.numel() for p in model.parameters()),
            dynamic_img_size=bool(getattr(model, "dynamic_img_size", False)), family=self.name,
            prefix_labels=prefix_labels(getattr(model, "cls_token", None) is not None,
                                        registers=int(getattr(model, "num_reg_tokens", 0) or 0)))

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.attn for block in model.blocks]

    def install_side(self, model: nn.Module, emit: Emit, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            state: dict[str, Any] = {}

            def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict, state: dict = state) -> None:
                state.clear()
                state["rope"] = kwargs.get("rope", args[1] if len(args) > 1 else None)
                state["attn_mask"] = kwargs.get("attn_mask", args[2] if len(args) > 2 else None)
                state["is_causal"] = bool(kwargs.get("is_causal", args[3] if len(args) > 3 else False))

            def q_hook(_mod: nn.Module, inp: tuple, q: torch.Tensor, state: dict = state) -> None:
                state["q"], state["dtype"] = q, inp[0].dtype  # the projection's dtype (v's), as type_as(v)

            def k_hook(_mod: nn.Module, _inp: tuple, k: torch.Tensor, state: dict = state, layer: int = layer,
                       attn: nn.Module = attn) -> None:
                rope, dtype, half = state.get("rope"), state["dtype"], bool(getattr(attn, "rotate_half", False))
                with torch.no_grad():
                    q = rotate(state.pop("q"), rope, attn.num_prefix_tokens, half, dtype)
                    k = rotate(k, rope, attn.num_prefix_tokens, half, dtype)
                    with torch.autocast(device_type=k.device.type, enabled=False):
                        probs = attention_probs(q, k, attn.scale, state.get("attn_mask"), state.get("is_causal", False))
                emit(layer, probs)

            handles.hook(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.hook(attn.q_norm.register_forward_hook(q_hook))
            handles.hook(attn.k_norm.register_forward_hook(k_hook))

    def install_inline(self, model: nn.Module, emit: Emit, handles: Handles, detach: bool) -> None:
        inline_at_attn_drop(self.attention_modules(model), emit, handles, detach)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.norm

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        return conv_filters(model.patch_embed.proj, "patch_embed.proj", "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return timm_position_table(model, spec)

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("this EVA variant encodes position only through rotary embeddings (RoPE) applied to queries and "
                "keys, and has no learned absolute position table")

    def grid_for(self, model: nn.Module, spec: ModelSpec, input_hw: tuple[int, int]) -> tuple[int, int]:
        if tuple(input_hw) == spec.image_size:
            return spec.grid
        gh, gw = model.patch_embed.dynamic_feat_size(tuple(int(s) for s in input_hw))
        return int(gh), int(gw)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return timm_data_config(model, spec)


register(TimmEva())
