"""An open_clip model's image tower (``visual_of``), its preprocessing (``open_clip_data_config``), its output
(``encode_image``), whether its position table is the fixed 2-D sin-cos one (``is_sincos``) and CoCa's attentional
pooler (``install_attentional_pool``): what the ``openclip-vit`` / ``openclip-timm`` families and the generic
capture's OpenCLIP layout share.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...core.attention import attention_probs
from ...core.spec import ModelSpec
from ..base import CaptureRequest, Handles
from .mha import call_mask
from ...errors import ViewNotAvailableError

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
    """The image embedding: ``encode_image`` of a CLIP/CoCa model, the tower's pooled output of a tower alone (a
    tower built with ``output_tokens``, CoCa's, returns (pooled, tokens))."""
    encode = getattr(model, "encode_image", None)
    out = encode(x) if encode is not None else model(x)
    return out[0] if isinstance(out, tuple) else out


def install_attentional_pool(model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
    """Side capture of the attentional pooler the tower's embedding comes from (CoCa, module docstring):
    softmax(q / sqrt(head_dim) @ k^T) per head of its ``nn.MultiheadAttention``, q and k from the module's own
    in-projection (packed, or separate when the pooler's width is not the tokens'), as the module returns it with
    ``need_weights=True, average_attn_weights=False``: ``capture(0, probs[B, heads, queries, T])``.

    Raises:
        ViewNotAvailableError: the tower has no attentional pooler over its tokens.
    """
    visual = visual_of(model)
    pool = getattr(visual, "attn_pool", None)
    kind = getattr(visual, "attn_pool_type", "")
    if pool is None:
        raise ViewNotAvailableError(f"{type(model).__name__} pools its class token or its mean, without an attention "
                                    "pool, so there is no pool attention to show.")
    if kind == "cascade":
        raise ViewNotAvailableError(
            f"{type(model).__name__}'s embedding comes from a cascade of attentional pools whose second reads the "
            "first's outputs, not the image's tokens, so no pool attention over the image is the embedding's.")
    if kind == "parallel":
        pool = visual.attn_pool_contrastive
    mha = pool.attn
    if not (isinstance(mha, nn.MultiheadAttention) and mha.batch_first):
        raise ViewNotAvailableError(f"{type(model).__name__}'s attentional pooler is not a batch-first "
                                    "nn.MultiheadAttention vitlens reads.")

    def pre_hook(mod: nn.MultiheadAttention, args: tuple, kwargs: dict) -> None:
        query = args[0] if args else kwargs["query"]
        key = args[1] if len(args) > 1 else kwargs["key"]
        e, h = mod.embed_dim, mod.num_heads
        b = mod.in_proj_bias
        if mod._qkv_same_embed_dim:
            wq, wk = mod.in_proj_weight[:e], mod.in_proj_weight[e:2 * e]
        else:
            wq, wk = mod.q_proj_weight, mod.k_proj_weight
        with torch.no_grad():
            q = F.linear(query, wq, None if b is None else b[:e]).unflatten(-1, (h, e // h)).transpose(1, 2)
            k = F.linear(key, wk, None if b is None else b[e:2 * e]).unflatten(-1, (h, e // h)).transpose(1, 2)
            mask = call_mask(mod, q, k, args, kwargs)
            with torch.autocast(device_type=q.device.type, enabled=False):
                probs = attention_probs(q, k, (e // h) ** -0.5, mask)
        capture(0, probs)

    handles.hook(mha.register_forward_pre_hook(pre_hook, with_kwargs=True))


def is_sincos(visual: nn.Module, grid: tuple[int, int]) -> bool:
    """Whether the tower's position table is open_clip's fixed 2-D sin-cos one."""
    from open_clip.pos_embed import get_2d_sincos_pos_embed

    if grid[0] != grid[1]:
        return False
    table = torch.from_numpy(get_2d_sincos_pos_embed(int(visual.positional_embedding.shape[1]), grid[0],
                                                     cls_token=True)).float()
    return torch.equal(visual.positional_embedding.detach().cpu().float(), table)


__all__ = ["encode_image", "install_attentional_pool", "is_open_clip", "is_sincos", "open_clip_data_config",
           "visual_of"]
