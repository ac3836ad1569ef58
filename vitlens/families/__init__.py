"""Model families: one module each, saying how vitlens reads a kind of ViT exactly (its spec, its
attention, its embedding filters and position table). ``family_of(model)`` finds the one for a
model, or refuses it with a message that names what is unsupported.
"""
from __future__ import annotations

from .base import (FAMILIES, REFUSED_FAMILIES, Adapter, CaptureAbilities, CaptureRequest, Emit, Family, Handles,
                   HookSession, family_of, register, supported_families)

# every family module, imported here so that each registers itself, in this line's order (the order of FAMILIES,
# which ``family_of`` tries and ``vitlens models`` lists). A family module imports only ``base`` and the helper layer
# ``vitlens.families.common``, never another family's module (tests/test_family_plugins.py), so none imports this
# package back; a new family is its module and its name on this line (``generic`` is a fallback: tried last whatever
# its place in FAMILIES, and registered last so that ``vitlens models`` lists it last)
from . import timm_vit, swin, tiny_vit, maxvit, davit, cait, hf, hf_video, mvit, hf_pvt, hf_segformer, hf_qwen2_5_vl, hf_swin, hf_vitdet, hiera, hieradet, torchvision_vit, openclip, sam, timm_beit, timm_eva  # noqa: E402,F401,E501
from . import generic  # noqa: E402,F401  (the fallback: listed last)
from .common.layouts import LAYOUTS, Layout, register_layout  # noqa: E402  (where the generic capture finds a ViT's pieces)


def describe_families() -> list[dict[str, object]]:
    """Each family vitlens reads: its name, what it reads and the model names that lead to it
    (what ``vitlens models`` lists).

    Returns:
        One dict per family: "family", "reads" and "names".
    """
    return [{"name": f.name, "reads": f.reads, "names": list(f.names)} for f in FAMILIES]


__all__ = ["Adapter", "CaptureAbilities", "CaptureRequest", "FAMILIES", "LAYOUTS", "REFUSED_FAMILIES", "Emit", "Family",
           "Handles", "HookSession", "Layout", "describe_families", "family_of", "register", "register_layout",
           "supported_families"]
