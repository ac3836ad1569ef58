"""Packed vision towers of the Hugging Face layout (``common.layouts_hf``): what a tower fed packed patches with
``grid_thw`` declares (Kimi K2.5's MoonViT: a stack of patches ``[N, C, p, p]`` through one convolution) and how an
image batch is cut for it, and the one-line refusals of towers whose forward needs what vitlens cannot know (text, a
dataset index, a packing it does not declare, windows)."""
from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ...errors import UnsupportedModelError
from .windows import pair


def patch_stack(tower: nn.Module) -> nn.Module | None:
    """A packed tower fed a stack of patches with ``grid_thw``, one token per patch, its tokens row-major: its
    ``patch_embed`` whose ``proj`` is a convolution of kernel = stride and no temporal patch (Kimi K2.5's MoonViT),
    or, for a tower without ``patch_embed``, its ``embeddings`` whose ``patch_embedding`` is such a convolution
    (PaddleOCR-VL, HunYuan-VL, VideoLLaMA3); None for any other tower."""
    if not takes(tower, "grid_thw"):
        return None
    pe = getattr(tower, "patch_embed", None)
    if pe is None:
        pe = getattr(tower, "embeddings", None)
    proj = stack_proj(pe) if isinstance(pe, nn.Module) else None
    if not isinstance(proj, nn.Conv2d) or getattr(pe, "temporal_patch_size", None):
        return None
    return pe if tuple(proj.kernel_size) == tuple(proj.stride) and proj.groups == 1 else None


def declares_packing(tower: nn.Module) -> bool:
    """Whether a tower, from any library, declares everything a packed reading needs: a ``config`` (the layout reads
    its ``num_hidden_layers``), a forward taking ``grid_thw`` and a patch layout its modules declare — a stack of
    patches through a convolution (``patch_stack``) or a ``patch_embed`` Conv3d over flattened temporal patches
    (``temporal_patch_size``) with an int ``spatial_merge_size``. The Hugging Face layout reads such a tower though
    it is not a transformers class: nothing it reads is transformers' own."""
    if getattr(tower, "config", None) is None or not takes(tower, "grid_thw"):
        return False
    if patch_stack(tower) is not None:
        return True
    pe = getattr(tower, "patch_embed", None)
    return isinstance(getattr(pe, "proj", None), nn.Conv3d) and bool(getattr(pe, "temporal_patch_size", None)) \
        and isinstance(getattr(tower, "spatial_merge_size", None), int)


def stack_proj(pe: nn.Module) -> nn.Module | None:
    """The convolution of a stacked-patch embedding (``patch_stack``): its ``proj``, else its ``patch_embedding``."""
    proj = getattr(pe, "proj", None)
    return proj if isinstance(proj, nn.Module) else getattr(pe, "patch_embedding", None)


def takes(tower: nn.Module, argument: str) -> bool:
    """Whether the tower's forward takes ``argument``."""
    import inspect

    try:
        return argument in inspect.signature(tower.forward).parameters
    except (TypeError, ValueError):
        return False


def refuse_inputs_it_cannot_know(tower: nn.Module, name: str, packed_here: bool) -> None:
    """A tower whose forward needs more than the pixels is refused in one line naming what it needs: text
    (``input_ids``: ViLT embeds both in one sequence), a dataset index choosing among several experts (ViTPose+),
    packed patches with their ``grid_thw`` in a layout its modules do not declare (neither a Conv3d over flattened
    temporal patches nor a convolution over stacked patches), or windows (Qwen2.5-Omni's window blocks:
    only transformers' Qwen2.5-VL tower has a family that undoes its window order)."""
    import inspect

    cfg, kind = tower.config, type(tower).__name__
    try:
        params = inspect.signature(tower.forward).parameters
    except (TypeError, ValueError):
        return
    if "input_ids" in params:
        raise UnsupportedModelError(
            f"{name!r} ({kind}) embeds text and image in one sequence (its forward takes input_ids): its attention "
            "depends on text vitlens cannot know; load a model whose vision tower runs on images alone.")
    experts = int(getattr(cfg, "num_experts", 1) or 1)
    if experts > 1 and "dataset_index" in params:
        raise UnsupportedModelError(
            f"{name!r} ({kind}) has {experts} experts chosen per sample by a dataset_index forward argument, which "
            "vitlens cannot know; build it with num_experts=1 or read a single-expert checkpoint.")
    window, full = getattr(cfg, "window_size", None), getattr(cfg, "fullatt_block_indexes", None)
    if packed_here and window and full is not None and len(set(full)) < int(getattr(cfg, "depth", 0) or 0):
        raise UnsupportedModelError(
            f"{name!r} ({kind}) attends in windows of {window} px in its blocks other than {sorted(full)} (several "
            "attention calls per image, its tokens reordered into windows); vitlens reads that pattern only in "
            "transformers' Qwen2_5_VisionTransformerPretrainedModel (family hf-qwen2.5-vl).")
    if not packed_here and "grid_thw" in params:
        raise UnsupportedModelError(
            f"{name!r} ({kind}) is a packed vision tower (its forward takes pixel_values with grid_thw, patches "
            "flattened in a layout its modules do not declare), which vitlens does not read: it reads packed towers "
            "whose patches enter through a Conv3d over flattened patches or a convolution over stacked patches "
            "(docs/models.md).")


def stack_inputs(tower: nn.Module, x: torch.Tensor, p: int) -> dict[str, torch.Tensor]:
    """A batch [B, C, H, W] as MoonViT's processor hands it: each image's patches [C, p, p] stacked row-major,
    images in order, and ``grid_thw``; the sides whole multiples of its pooling's ``merge_kernel_size``."""
    b, c, h, w = x.shape
    kh, kw = pair(getattr(tower.config, "merge_kernel_size", 1) or 1)
    if h % (p * kh) or w % (p * kw):
        raise UnsupportedModelError(f"{type(tower).__name__} takes images whose sides are multiples of "
                                    f"{p * kh}x{p * kw} px (patch {p} x its merge kernel); got {h}x{w}.")
    gh, gw = h // p, w // p
    stack = x.reshape(b, c, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5).reshape(b * gh * gw, c, p, p)
    inputs = {"pixel_values": stack, "grid_thw": torch.tensor([[1, gh, gw]] * b, device=x.device)}
    if takes(tower, "merge_sizes"):  # (VideoLLaMA3: merge 1 keeps each image's tokens row-major, as its processor
        inputs["merge_sizes"] = torch.ones(b, dtype=torch.long, device=x.device)  # hands images)
    return inputs


def run_stack(tower: nn.Module, inputs: dict[str, torch.Tensor]) -> Any:
    """The tower run on its stacked patches in the first shape it takes: [N, C, p, p] (MoonViT), [1, N, C, p, p]
    (PaddleOCR-VL) or [N, C·p·p] (HunYuan-VL); the shape found is kept for the tower's next calls. Each is a view of
    the same memory, and the tower's convolution declares a patch's (C, p, p) order, so any shape it accepts reads
    the same pixels; a shape it does not take fails in its patch embedding, before any attention call. Where none
    runs, the error of the first ([N, C, p, p]) is raised."""
    stack = inputs["pixel_values"]
    shapes = [tuple(stack.shape), (1, *stack.shape), (stack.shape[0], stack[0].numel())]
    known = _STACK_RANKS.get(tower)
    if known is not None:
        return tower(**{**inputs, "pixel_values": stack.reshape(shapes[known])})
    first: Exception | None = None
    for rank, shape in enumerate(shapes):
        try:
            out = tower(**{**inputs, "pixel_values": stack.reshape(shape)})
        except torch.OutOfMemoryError:
            raise
        except (ValueError, RuntimeError) as exc:
            first = first or exc
            continue
        _STACK_RANKS[tower] = rank
        return out
    assert first is not None
    raise first


_STACK_RANKS: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


__all__ = ["declares_packing", "patch_stack", "refuse_inputs_it_cannot_know", "run_stack", "stack_inputs", "stack_proj",
           "takes"]
