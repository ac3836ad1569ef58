"""``decompose``: the output as an exact sum over embeddings, heads x source tokens, MLPs and biases, with a
ledger (docs/definitions.md, "Direct contributions")."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from ..errors import InvalidParameterError, VitlensError
from . import conventions, hf_clip, openclip, prenorm, timm_vit, towers
from .layout import refuse
from .result import DecompositionResult
from .arguments import per_image
from .stream import module_of, pixels_for


def decompose(model: object, pixels: object, target: int | Sequence[int] | None = None,
              direction: torch.Tensor | np.ndarray | None = None, norm_convention: str = "per_part"
              ) -> DecompositionResult:
    """Split what the model outputs for each image into exact parts (docs/definitions.md, "Direct contributions").

    Args:
        model: a ``LoadedModel`` (``vl.load_model``) or the module itself: timm's ``VisionTransformer`` (class
            token, registers, average pooling, MAP head), a Hugging Face CLIP vision tower (with or without its
            projection), an OpenCLIP vision tower, Hugging Face ``ViTModel`` / ``ViTForImageClassification``,
            ``Dinov2Model`` / ``Dinov2ForImageClassification``, ``SiglipVisionModel`` (its MAP head held) or
            torchvision's ``VisionTransformer``; other structures (the generic path's included) are refused by name.
        pixels: [B, 3, H, W] preprocessed images (moved to the model's device and dtype); with a ``LoadedModel``,
            anything ``vl.preprocess`` reads (PIL images, paths, arrays).
        target: the class read, one for all images or one per image; default each image's predicted class (a tower
            without a classifier: one coordinate of its features).
        direction: instead of a class, a [D] direction over the pre-logits features (a text embedding, a unit
            vector); the output read is ``direction . features``.
        norm_convention: how the final LayerNorm is shared among the parts (docs/definitions.md, "Norm
            conventions"; ``conventions.NORM_CONVENTIONS``): ``"per_part"`` (each part centred by its own mean, the
            norm's beta a readout term; the output ``u . f``) or, on a CLIP / OpenCLIP tower read by its class
            token, ``"clip_text_span"`` (Gandelsman et al.'s ``prs_hook``: the norm's mean and beta in equal shares,
            the output projection's bias spread over tokens and heads, every part divided by ``|f|``; the output
            ``u . f / |f|``).

    Returns:
        A ``DecompositionResult`` whose ledger (``ledger()``, shown in its summary) says how closely the parts add
            up to the output.
    """
    module, name = module_of(model, "decompose")
    conventions.check(norm_convention)
    if target is not None and direction is not None:
        raise InvalidParameterError("Give a target class or a direction, not both.")
    if hf_clip.is_clip_tower(module) or openclip.is_openclip_tower(module):
        return _clip(module, name, pixels_for(model, module, pixels), target, direction, norm_convention)
    if norm_convention != "per_part":
        raise InvalidParameterError(f"norm_convention={norm_convention!r} is stated for CLIP vision towers (Hugging "
                                    f"Face or OpenCLIP) read by their class token; {name} is read with 'per_part'.")
    if towers.is_tower(module):
        return _tower(module, name, pixels_for(model, module, pixels), target, direction)
    refuse(module, name)
    timm_vit.refuse_unless_supported(module)
    pixels = pixels_for(model, module, pixels)
    cap = timm_vit.capture(module, pixels)
    b = pixels.shape[0]
    if direction is not None:
        u, output = _along(cap.features, direction)
        labels = torch.full((b,), -1, dtype=torch.long)
        const = torch.zeros(b, dtype=torch.float64, device=u.device)
    else:
        labels, u, output, const = _class_read(cap.logits, module.head, target)
    parts = timm_vit.contributions(module, cap, u)
    parts["readout_bias"] = parts["readout_bias"] + const.to(parts["readout_bias"].device)
    n_patch = cap.final_in.shape[1] - module.num_prefix_tokens
    grid = tuple(getattr(module.patch_embed, "grid_size", None) or (n_patch, 1))
    return _result(output, labels, parts, int(module.num_prefix_tokens), grid, name, direction is not None)


def refusal(model: object) -> str:
    """Why ``decompose`` would refuse ``model`` (a ``LoadedModel`` or a module), found by the checks it makes before
    any forward (the model's structure, blocks and norms); "" where it reads it."""
    module, name = module_of(model, "decompose")
    try:
        if hf_clip.is_clip_tower(module) or openclip.is_openclip_tower(module):
            (hf_clip if hf_clip.is_clip_tower(module) else openclip).refuse_unless_supported(module)
        elif towers.is_tower(module):
            towers.plan(module)
        else:
            refuse(module, name)
            timm_vit.refuse_unless_supported(module)
    except VitlensError as e:
        return e.message
    return ""


def _class_read(logits: torch.Tensor, head: nn.Linear, target: int | Sequence[int] | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(labels [B], u [B, F], output [B], const [B])`` for a class read through a linear head."""
    b, n_classes = logits.shape
    labels = (logits.argmax(-1) if target is None else per_image(target, "target", n_classes, b)).to(logits.device)
    u = head.weight.detach().double()[labels]
    output = logits.double().gather(1, labels[:, None])[:, 0]
    const = (head.bias.detach().double()[labels] if head.bias is not None else
             torch.zeros(b, dtype=torch.float64, device=logits.device))
    return labels, u, output, const


def _coordinate(dim: int, name: str, target: int | Sequence[int] | None) -> torch.Tensor:
    """The unit vector of one coordinate of a tower's features (``target``), or a refusal asking for a direction."""
    if target is None or not isinstance(target, int) or not 0 <= target < dim:
        raise InvalidParameterError(f"{name} has no classes, so there is no class to decompose.", fixes={
            "python": f"Give direction= (a text embedding, a unit vector over its {dim}-dimensional image embedding) "
                      "or target= one coordinate.", "app": "Pick the output coordinate to read above."})
    direction = torch.zeros(dim, dtype=torch.float64)
    direction[target] = 1.0
    return direction


def _tower(module: nn.Module, name: str, pixels: torch.Tensor, target: int | Sequence[int] | None,
           direction: torch.Tensor | np.ndarray | None) -> DecompositionResult:
    """A Hugging Face ViT / DINOv2 / SigLIP tower or torchvision's ViT (``towers``): a class through its classifier,
    or a direction over its features (``target`` = one coordinate where it has no classifier)."""
    plan, seen = towers.read(module, pixels)
    b = pixels.shape[0]
    if direction is None and plan.classifier is not None:
        with torch.no_grad():
            logits = plan.classifier(seen.features)
        labels, u, output, const = _class_read(logits, plan.classifier, target)
    else:
        if direction is None:
            direction = _coordinate(seen.features.shape[-1], name, target)
        u, output = _along(seen.features, direction)
        labels = torch.full((b,), -1, dtype=torch.long)
        const = torch.zeros(b, dtype=torch.float64, device=u.device)
    g_after, more, pool_mlp = towers.readout(module, plan, seen, u)
    parts = prenorm.contributions(plan, seen, g_after, const + more, pool_mlp)
    if seen.patch.dim() == 4:
        grid = tuple(seen.patch.shape[-2:])
    else:
        ps = getattr(plan.patch, "patch_size", 1)
        ps = (ps, ps) if isinstance(ps, int) else tuple(ps)
        grid = (pixels.shape[-2] // ps[0], pixels.shape[-1] // ps[1])
    return _result(output, labels, parts, plan.prefix.shape[0], grid, name, bool(labels[0] < 0))


def _along(features: torch.Tensor, direction: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u [B, D], u . features [B])`` for a direction over the features."""
    u = torch.as_tensor(np.asarray(direction), dtype=torch.float64, device=features.device)
    if u.shape != (features.shape[-1],):
        raise InvalidParameterError(f"direction has shape {tuple(u.shape)}; the features read have "
                                    f"{features.shape[-1]} dimensions.")
    u = u.expand(features.shape[0], -1)
    return u, (features.double() * u).sum(-1)


def _clip(module: nn.Module, name: str, pixels: torch.Tensor, target: int | Sequence[int] | None,
          direction: torch.Tensor | np.ndarray | None, norm_convention: str = "per_part") -> DecompositionResult:
    """A CLIP tower (Hugging Face or OpenCLIP): a direction over its image embedding, or ``target`` = one coordinate
    of it."""
    reader = hf_clip if hf_clip.is_clip_tower(module) else openclip
    reader.refuse_unless_supported(module)
    if norm_convention == "clip_text_span":
        conventions.refuse_unless_read(module)
    seen = reader.capture(module, pixels)
    b, dim = seen.features.shape
    if direction is None:
        direction = _coordinate(dim, name, target)
    u, output = _along(seen.features, direction)
    parts = reader.contributions(module, seen, u)
    if norm_convention == "clip_text_span":
        parts, output = conventions.clip_text_span(reader, module, seen, u, parts, output, seen.features)
    grid = tuple(seen.patch.shape[-2:])
    return _result(output, torch.full((b,), -1, dtype=torch.long), parts, 1, grid, name, True, norm_convention)


def _result(output: torch.Tensor, labels: torch.Tensor, parts: dict[str, torch.Tensor], num_prefix: int,
            grid: tuple, name: str, along: bool, norm_convention: str = "per_part") -> DecompositionResult:
    return DecompositionResult(
        output=output.cpu().numpy(), target=labels.cpu().numpy(),
        **{k: v.cpu().numpy() for k, v in parts.items()},
        num_prefix_tokens=num_prefix, grid=tuple(int(g) for g in grid), model_name=name,
        direction="direction" if along else "class", norm_convention=norm_convention)
