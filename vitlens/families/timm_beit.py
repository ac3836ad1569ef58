"""timm's BEiT and BEiT v2 (``timm.models.beit.Beit``): attention with a relative-position bias.

Each block's scores are q * scale @ k^T + its own relative-position bias + the model's shared
one (when there is one), then softmax. The bias is read from the block's own table, exactly as
the block reads it. Side capture hooks the attention module's input and forms q and k with the
block's own weights and biases (the projection runs a second time, in the same dtype); inline
capture turns ``fused_attn`` off and reads the probabilities as they enter ``attn_drop``.
BEiT has no learned absolute position table (position lives in the relative bias), so the
position view says so.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UnsupportedModelError
from ..core.spec import ModelSpec
from .base import CaptureRequest, Handles, register
from ..core.attention import attention_probs
from .common.timm import TimmFamily, check_patch_embed


def beit_queries_keys(attn: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [B, heads, T, head_dim] of timm's BEiT ``Attention`` for input ``x``, formed as it forms them."""
    b, n, _ = x.shape
    if attn.q_bias is None:
        qkv = F.linear(x, attn.qkv.weight)
    else:
        qkv_bias = torch.cat((attn.q_bias, attn.k_bias, attn.v_bias))
        if attn.qkv_bias_separate:
            qkv = F.linear(x, attn.qkv.weight)
            qkv += qkv_bias
        else:
            qkv = F.linear(x, weight=attn.qkv.weight, bias=qkv_bias)
    qkv = qkv.reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    return qkv[0], qkv[1]


class TimmBeit(TimmFamily):
    name = "timm-beit"
    summary = "timm BEiT (beit_*, beitv2_*)"
    reads = "timm BEiT and BEiT v2 (relative-position bias)"
    names = ("timm names: beit_base_patch16_224, beitv2_base_patch16_224 (timm.list_models('beit*'))",)

    def matches(self, model: nn.Module) -> bool:
        from timm.models.beit import Beit

        return isinstance(model, Beit)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.layers import PatchEmbed
        from timm.models.beit import Attention, Block

        check_patch_embed(model, name, (PatchEmbed,))
        for i, block in enumerate(model.blocks):
            if type(block) is not Block or type(block.attn) is not Attention:
                raise UnsupportedModelError(
                    f"{name!r}: block {i} is a {type(block).__name__} with {type(block.attn).__name__}; vitlens "
                    "reproduces timm's BEiT Block and Attention (relative-position bias) exactly and refuses others.")

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            def pre_hook(mod: nn.Module, args: tuple, kwargs: dict, layer: int = layer) -> None:
                shared = kwargs.get("shared_rel_pos_bias", args[1] if len(args) > 1 else None)
                with torch.no_grad():
                    q, k = beit_queries_keys(mod, args[0])
                    biases = []
                    if mod.relative_position_bias_table is not None:
                        biases.append(mod._get_rel_pos_bias())
                    if shared is not None:
                        biases.append(shared)
                    with torch.autocast(device_type=q.device.type, enabled=False):
                        probs = attention_probs(q, k, mod.scale, biases=biases)
                capture(layer, probs)

            handles.hook(attn.register_forward_pre_hook(pre_hook, with_kwargs=True))

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj  # BEiT has no scale norm: the heads meet at the output projection

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("BEiT adds a learned relative-position bias to the attention scores instead of a learned "
                "absolute position table")


register(TimmBeit())
