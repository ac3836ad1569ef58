"""Model families: one module each, saying how vitlens reads a kind of ViT exactly (its spec, its
attention, its embedding filters and position table). ``family_of(model)`` finds the one for a
model, or refuses it with a message that names what is unsupported.
"""
from __future__ import annotations

from .base import FAMILIES, Emit, Family, Handles, HookSession, family_of, register

#: timm model modules vitlens refuses, with what it would silently get wrong.
REFUSED_FAMILIES = {
    "vision_transformer_relpos": "relative-position bias added to the attention logits",
    "vision_transformer_sam": "windowed attention with decomposed relative-position bias (SAM)",
    "naflexvit": "variable-resolution patch packing with attention masks and RoPE (NaFlexViT)",
    "cait": "class-attention layers and talking heads (CaiT)",
    "xcit": "cross-covariance attention over channels (XCiT)",
    "swin_transformer": "windowed attention with relative-position bias (Swin)",
}

_LOADED = False


def _load_all() -> None:
    """Import every family module once (each registers itself)."""
    global _LOADED
    if _LOADED:
        return
    from . import hf, openclip, timm_beit, timm_eva, timm_vit, torchvision_vit  # noqa: F401

    _LOADED = True


def describe_families() -> list[dict[str, object]]:
    """Each family vitlens reads: its name, what it reads and the model names that lead to it
    (what ``vitlens models`` lists).

    Returns:
        One dict per family: "family", "reads" and "names".
    """
    _load_all()
    return [{"name": f.name, "reads": f.reads, "names": list(f.names)} for f in FAMILIES]


__all__ = ["FAMILIES", "REFUSED_FAMILIES", "Emit", "Family", "Handles", "HookSession", "describe_families", "family_of",
           "register"]
