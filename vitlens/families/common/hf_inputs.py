"""What a Hugging Face vision model is fed and how its masks read (the helper layer of ``vitlens.families.hf``): the
forward's keyword inputs by model type (``pixel_values``, SigLIP 2's NaFlex patches and their mask,
``interpolate_pos_encoding`` for a model that takes any size), the embeddings and position rows the views read, and
the refusals of padded or packed batches where a view would read padding as tokens."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import UnsupportedModelError
from ..base import CaptureRequest, Handles
from .hf import (resize_inputs, tower_type, vision_tower)
from .windows import pair


def scores_mask(mask: Any) -> torch.Tensor | None:
    """The mask a transformers attention function is handed, as ``attention_probs`` takes it: a 4-D mask
    [B, 1, T, T] as it is (boolean, True = attend, under sdpa; additive under eager), a 2-D padding mask
    [B, T] (flash attention's: nonzero = a real token) as a boolean key mask [B, 1, 1, T].

    Args:
        mask: the ``attention_mask`` the attention module was called with (None: no mask).

    Returns:
        A mask ``attention_probs`` applies with these semantics, or None.

    Raises:
        UnsupportedModelError: a mask side capture cannot read (flex_attention's ``BlockMask``, another shape).
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise UnsupportedModelError(
            f"Side capture cannot read the {type(mask).__name__} this attention implementation masks with "
            "(flex_attention): capture with mode='inline' (transformers' eager attention, exact), or load the model "
            "with attn_implementation='sdpa' or 'eager'.")
    if mask.dim() == 2:
        return mask.bool()[:, None, None, :]
    if mask.dim() == 4:
        return mask
    raise UnsupportedModelError(f"Side capture reads a 4-D [B, 1, T, T] or 2-D [B, T] attention mask; the attention "
                                f"was handed one of shape {tuple(mask.shape)}: capture with mode='inline'.")

def masks_keys(mask: torch.Tensor | None) -> bool:
    """Whether an attention mask, boolean (True = attend) or additive, masks any key (Siglip2's padding)."""
    if mask is None:
        return False
    if mask.dtype == torch.bool:
        return not bool(mask.all())
    return bool((mask <= torch.finfo(mask.dtype).min / 2).any())

def refuse_padding_in_views(capture: CaptureRequest, mask: torch.Tensor | None) -> None:
    """The views read every token as a patch of one grid (``spec.grid``); a packed Siglip2 batch with
    padding has per-image grids and padding tokens, which they would count as patches. Its maps (padding
    keys at exactly zero, as in the model) are for ``capture_attention``; the views feed one size unpadded."""
    if capture.views and masks_keys(mask):
        raise UnsupportedModelError(
            "vitlens views do not read packed Siglip2 inputs with padding (pixel_attention_mask with zeros): pass "
            "images (the views feed one unpadded size), or use vl.capture_attention for the maps themselves.")

def refuse_packing_in_views(model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
    """For a Siglip2 tower read by the views (streaming consumers): refuse, before the first block, a packed
    batch whose images have different grids (``spatial_shapes``) or fewer patches than tokens (padding). The
    views read every token as a patch of one grid, so either would give them wrong numbers. Nothing is
    installed for other models, or when no view listens (``capture_attention`` reads any packing exactly).

    Args:
        model: the model being captured.
        capture: the capture's request (its ``views`` flag says whether views listen).
        handles: where the embeddings' pre-hook is put, removed with the capture's other hooks.

    Raises:
        UnsupportedModelError: (from the hook, at the forward) a batch of other grids or with padding.
    """
    if not capture.views or tower_type(model) != "siglip2_vision_model":
        return

    def pre_hook(_mod: nn.Module, args: tuple, kwargs: dict) -> None:
        pixels = kwargs.get("pixel_values", args[0] if args else None)
        shapes = kwargs.get("spatial_shapes", args[1] if len(args) > 1 else None)
        if pixels is None or shapes is None:
            return
        grids = sorted({(int(h), int(w)) for h, w in shapes.tolist()})
        tokens = int(pixels.shape[1])
        if len(grids) > 1 or grids[0][0] * grids[0][1] != tokens:
            raise UnsupportedModelError(
                f"vitlens views do not read packed Siglip2 inputs of other grids or with padding (spatial_shapes "
                f"{', '.join(f'{h}x{w}' for h, w in grids)} for {tokens} tokens): pass images (the views feed one "
                "unpadded size), or use vl.capture_attention for the maps themselves.")

    handles.hook(embeddings_of(model).register_forward_pre_hook(pre_hook, with_kwargs=True))

def embeddings_of(model: nn.Module) -> nn.Module:
    emb = getattr(vision_tower(model), "embeddings", None)
    if emb is not None and (hasattr(emb, "patch_embedding") or hasattr(emb, "patch_embeddings")):
        return emb
    for _name, mod in model.named_modules():
        if hasattr(mod, "patch_embeddings") and hasattr(mod.patch_embeddings, "projection"):
            return mod
    raise UnsupportedModelError(f"{type(model).__name__} has no patch embeddings vitlens recognises.")

def position_rows(emb: nn.Module) -> torch.Tensor:
    """The position table [1, rows, D]: a parameter (ViT, DeiT, Dinov2, IJepa, MAE) or an nn.Embedding
    (CLIP, SigLIP)."""
    if getattr(emb, "position_embeddings", None) is not None:
        return emb.position_embeddings.detach()
    return emb.position_embedding.weight.detach().unsqueeze(0)

def siglip2_inputs(x: torch.Tensor, patch: int) -> dict[str, torch.Tensor]:
    """Siglip2's inputs for a batch of one size [B, C, H, W]: the patches cut as its image processor cuts them
    ((row, column) order, each patch flattened as (py, px, channel)), their grid, and a mask with no padding."""
    b, c, h, w = x.shape
    gh, gw = h // patch, w // patch
    patches = x[:, :, :gh * patch, :gw * patch].reshape(b, c, gh, patch, gw, patch).permute(0, 2, 4, 3, 5, 1)
    return {"pixel_values": patches.reshape(b, gh * gw, patch * patch * c),
            "pixel_attention_mask": torch.ones(b, gh * gw, dtype=torch.long, device=x.device),
            "spatial_shapes": torch.tensor([[gh, gw]] * b, dtype=torch.long, device=x.device)}

#: model types whose embeddings resample the position table to any input size by themselves
ANY_SIZE = ("dinov2", "dinov2_with_registers", "siglip2_vision_model")

def size_inputs(model: nn.Module, x: torch.Tensor, fn: Any = None) -> dict[str, Any]:
    """``interpolate_pos_encoding=True`` for an input of another size than the config's, where ``fn`` (the
    call vitlens makes) takes it (``common.hf.resize_inputs``); nothing at the config's size, nor for a type whose
    embeddings resample the table by themselves (``ANY_SIZE``).

    Raises:
        InvalidParameterError: another size, and a model that cannot take one.
    """
    if tower_type(model) in ANY_SIZE:
        return {}
    return resize_inputs(model, x, fn)

def model_inputs(model: nn.Module, x: torch.Tensor, fn: Any = None) -> dict[str, Any]:
    """The keyword inputs of a preprocessed batch [B, 3, H, W], as vitlens feeds the model (``fn``: the call
    they are for, whose signature says whether it resamples the position table: ``size_inputs``)."""
    kind = tower_type(model)
    if kind == "siglip2_vision_model":
        return siglip2_inputs(x, int(vision_tower(model).config.patch_size))
    extra = size_inputs(model, x, fn)
    if kind == "vit_mae":  # every patch, kept in the image's own order (mask_ratio is 0)
        n = (x.shape[-2] // pair(model.config.patch_size)[0]) * (x.shape[-1] // pair(model.config.patch_size)[1])
        return {"pixel_values": x, "noise": torch.arange(n, device=x.device, dtype=x.dtype).expand(x.shape[0], -1),
                **extra}
    return {"pixel_values": x, **extra}


__all__ = ["ANY_SIZE", "embeddings_of", "masks_keys", "model_inputs", "position_rows", "refuse_packing_in_views",
           "refuse_padding_in_views", "scores_mask", "siglip2_inputs", "size_inputs"]
