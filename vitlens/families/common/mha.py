"""``nn.MultiheadAttention`` blocks (torchvision's and open_clip's own ViTs) and pools (SigLIP's MAP head, CoCa's
attentional pooler): the additive mask of a call, q, k and v from the module's packed in-projection, the
capture of blocks that call their module with ``need_weights=False`` (``MultiheadAttentionViT``), and of a MAP head
whose probe queries the tokens through one ``nn.MultiheadAttention`` (``probe_attention``, ``install_probe_pool``:
SigLIP's, Siglip2's and Phi-4-multimodal's heads).
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ...core.attention import attention_probs, mha_mask
from ..base import CaptureRequest, Family, Handles


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
    return tuple(z.reshape(b, t, heads, e // heads).transpose(1, 2) for z in (q, k, v))


class MultiheadAttentionViT(Family):
    """A ViT whose blocks call an ``nn.MultiheadAttention`` (batch-first, packed in-projection) with
    ``need_weights=False`` (the fused path). Side capture takes the block's input from a pre-hook and forms q and k
    with the module's own packed in-projection, then softmax(q / sqrt(head_dim) @ k^T), as the module computes the
    weights it returns with ``need_weights=True, average_attn_weights=False``; the block's own output is untouched.
    Inline capture computes each block's attention on that non-fused path (the same formula, then the output
    projection) and returns it in place of the module's own output, so the block's output is computed from the
    captured weights. A subclass says where the modules are (``attention_modules``)."""

    def attention_modules(self, model: nn.Module) -> Sequence[nn.MultiheadAttention]:
        raise NotImplementedError

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, mha in enumerate(self.attention_modules(model)):
            install_block_side(mha, layer, capture, handles)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, mha in enumerate(self.attention_modules(model)):
            install_block_inline(mha, layer, capture, handles)


def _query(mod: nn.MultiheadAttention, args: tuple, kwargs: dict) -> torch.Tensor:
    """The call's query as [B, T, E]: a sequence-first module's (``batch_first=False``: Hugging Face BridgeTower's,
    open_clip's older towers) [T, B, E] transposed."""
    x = args[0] if args else kwargs["query"]
    return x if mod.batch_first or x.dim() != 3 else x.transpose(0, 1)


def install_block_side(mha: nn.MultiheadAttention, layer: int, capture: CaptureRequest, handles: Handles,
                       check: Callable[[torch.Tensor], None] | None = None) -> None:
    """Side capture of one block's self-attention ``nn.MultiheadAttention`` (called with ``need_weights=False``):
    a pre-hook forms q and k from the call's input with the module's own packed in-projection, then
    ``capture(layer, softmax(q / sqrt(head_dim) @ k^T + mask))``, what the module returns with
    ``need_weights=True, average_attn_weights=False``; the call and its output are untouched.

    Args:
        mha: the block's module.
        layer: the block's index.
        capture: where the probabilities go.
        handles: where the hook is undone.
        check: called with each map before it is handed over (the generic capture's token checks), or None.
    """
    def pre_hook(mod: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
        x = _query(mod, args, kwargs)
        with torch.no_grad():
            q, k, _v = heads_qkv(mod, x)
            with torch.autocast(device_type=x.device.type, enabled=False):
                probs = attention_probs(q, k, math.sqrt(1.0 / q.shape[-1]), call_mask(mod, q, k, args, kwargs))
        if check is not None:
            check(probs)
        capture(layer, probs)

    handles.hook(mha.register_forward_pre_hook(pre_hook, with_kwargs=True))


def install_block_inline(mha: nn.MultiheadAttention, layer: int, capture: CaptureRequest, handles: Handles,
                         check: Callable[[torch.Tensor], None] | None = None) -> None:
    """Inline capture of one block's self-attention ``nn.MultiheadAttention``: its attention computed on the
    non-fused path (``install_block_side``'s formula, then the output projection), handed over (detached unless
    ``capture.detach`` is False) and returned in place of the module's own output, so the block's output is computed
    from the captured weights (sequence-first again for a ``batch_first=False`` module)."""
    def recompute(mod: nn.MultiheadAttention, args: tuple, kwargs: dict, _out: tuple) -> tuple:
        x = _query(mod, args, kwargs)
        q, k, v = heads_qkv(mod, x)
        scores = (q * math.sqrt(1.0 / q.shape[-1])) @ k.transpose(-2, -1)
        mask = call_mask(mod, q, k, args, kwargs)
        probs = (scores if mask is None else scores + mask.to(scores.dtype)).softmax(dim=-1)
        if check is not None:
            check(probs)
        capture(layer, probs.detach() if capture.detach else probs)
        b, h, t, d = q.shape
        out = F.linear((probs @ v).transpose(1, 2).reshape(b, t, h * d), mod.out_proj.weight, mod.out_proj.bias)
        return (out if mod.batch_first else out.transpose(0, 1)), probs

    handles.hook(mha.register_forward_hook(recompute, with_kwargs=True))


def probe_attention(head: object) -> nn.MultiheadAttention | None:
    """The ``nn.MultiheadAttention`` of a MAP head that queries the tokens with a learned ``probe`` through it
    (batch-first, packed in-projection), or None when ``head`` is not one."""
    mha = getattr(head, "attention", None)
    if isinstance(mha, nn.MultiheadAttention) and hasattr(head, "probe") and mha._qkv_same_embed_dim \
            and mha.batch_first:
        return mha
    return None


def install_probe_pool(mha: nn.MultiheadAttention, capture: CaptureRequest, handles: Handles) -> None:
    """Side capture of a MAP head's ``nn.MultiheadAttention`` (``probe_attention``): ``capture(0, probs)``, probs
    [B, heads, queries, T] = softmax(q / sqrt(d) @ k^T + mask) per head from the module's own in-projection of the
    call's query and key (positional or keyword) and its masks with the module's semantics: what it returns with
    ``need_weights=True, average_attn_weights=False``. The call and the output are untouched."""

    def pre_hook(mod: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        e, h = mod.embed_dim, mod.num_heads
        w, b = mod.in_proj_weight, mod.in_proj_bias
        with torch.no_grad():
            q = F.linear(query, w[:e], None if b is None else b[:e])
            k = F.linear(key, w[e:2 * e], None if b is None else b[e:2 * e])
            q = q.unflatten(-1, (h, e // h)).transpose(1, 2)
            k = k.unflatten(-1, (h, e // h)).transpose(1, 2)
            mask = call_mask(mod, q, k, args, kwargs)  # attn_mask / key_padding_mask (bool True = masked)
            with torch.autocast(device_type=q.device.type, enabled=False):
                probs = attention_probs(q, k, (e // h) ** -0.5, mask)
        capture(0, probs)

    handles.hook(mha.register_forward_pre_hook(pre_hook, with_kwargs=True))


__all__ = ["MultiheadAttentionViT", "call_mask", "heads_qkv", "install_block_inline", "install_block_side",
           "install_probe_pool", "probe_attention"]
