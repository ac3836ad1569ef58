"""Whole models read through their vision tower: a VLM (Llava's ``model.vision_tower``), a depth or pose model
(Depth Anything's and VitPose's ``backbone``), a detector (OWL-ViT's ``owlvit``), transformers' wrapper of a timm
model (``timm_model``). The views are the tower's: its blocks, its output, on the images the tower takes; the spec's
``read_module`` names the submodule read, so no result passes a tower's maps off as the whole model's.

The rule, in one place: when no family knows the model as given (``looks_inside``), its submodules are tried breadth
first (the
shallowest first, and among those of one depth the usual names of a tower first, ``TOWER_NAMES``), down to
``MAX_DEPTH`` levels; the first that a family reads is the tower. A language model, a projector or a decoder is never
read by a vision family (none has a patch embedding), so it is passed over. Where none is found, the refusal of the
model as given stands.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from ..errors import UnsupportedModelError
from ..families import FAMILIES, family_of
from ..families.base import AttentionClassUnknown

if TYPE_CHECKING:  # for the annotation only (families are imported where a tower is looked for)
    from ..families import Family

#: attribute names of vision towers, tried first among the submodules of one depth; a model with an image tower
#: beside its video tower (Video-LLaVA's ``image_tower`` and ``video_tower``) embeds images with the former
TOWER_NAMES = ("image_tower", "vision_tower", "vision_model", "visual", "backbone", "timm_model", "vision_encoder",
               "image_encoder", "encoder")
#: how deep below the model given a tower is looked for (Llava: ``model.vision_tower``, depth 2; OWL-ViT's detector:
#: ``owlvit.vision_model``, read through ``owlvit`` at depth 1)
MAX_DEPTH = 3


def candidates(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(path, submodule) of every submodule down to ``MAX_DEPTH`` levels, shallowest first, tower names first among
    those of one depth (each module once, by its first path)."""
    seen = {id(model)}
    level: list[tuple[str, nn.Module]] = [("", model)]
    found: list[tuple[str, nn.Module]] = []
    for _depth in range(MAX_DEPTH):
        below: list[tuple[str, nn.Module]] = []
        for path, module in level:
            for name, child in module.named_children():
                if id(child) in seen or isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
                    continue
                seen.add(id(child))
                below.append((f"{path}.{name}" if path else name, child))
        below.sort(key=lambda item: TOWER_NAMES.index(item[0].rsplit(".", 1)[-1])
                   if item[0].rsplit(".", 1)[-1] in TOWER_NAMES else len(TOWER_NAMES))
        found.extend(below)
        level = below
    return found


def looks_inside(model: nn.Module, refusal: UnsupportedModelError) -> bool:
    """Whether a model's refusal leaves its submodules to be tried: no family knows the model as given (none matches
    it, or its family does not know its class: ``AttentionClassUnknown``, as Hugging Face's for a VLM's type). A
    family that knows the model and refuses it for a reason (ViTMAE's random masking, a Hiera backbone) is not
    second-guessed through a submodule."""
    return isinstance(refusal, AttentionClassUnknown) or not any(f.matches(model) for f in FAMILIES)


def find_tower(model: nn.Module, name: str, refusal: UnsupportedModelError) -> tuple[str, nn.Module, Family]:
    """The vision tower of a whole model no family knows as given (``looks_inside``): (its path in ``model``, the
    submodule, its family), by the module docstring's rule.

    Raises:
        UnsupportedModelError: ``refusal`` (the model's own) when no submodule is read either, or when a family
            refused the model itself for a reason.
    """
    if not looks_inside(model, refusal):
        raise refusal

    for path, module in candidates(model):
        try:
            family = family_of(module, f"{name}.{path}")
        except UnsupportedModelError:
            continue
        return path, module, family
    raise refusal


def describe_tower(path: str, module: nn.Module) -> str:
    """``"backbone (Dinov2Backbone)"``: what ``ModelSpec.read_module`` says."""
    return f"{path} ({type(module).__name__})"


__all__ = ["MAX_DEPTH", "TOWER_NAMES", "candidates", "describe_tower", "find_tower", "looks_inside"]
