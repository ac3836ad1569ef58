"""Named models a user can pick without knowing timm's catalogue: the embedded reference pair
and the hub checkpoints closest to the paper's figures (Fig. 7, Fig. 11)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    needs_download: bool


PRESETS: tuple[Preset, ...] = (
    Preset("ref-vit", "Embedded reference ViT (64 px, 8x8 patches, 6 layers), trained on vitlens shapes", False),
    Preset("ref-hybrid", "Embedded reference hybrid (small ResNet, stride 8, same transformer)", False),
    Preset("vit_base_patch16_224.orig_in21k", "Paper's ViT-B/16, ImageNet-21k (features, no head)", True),
    Preset("vit_base_r50_s16_224.orig_in21k", "Paper's R50+ViT-B/16 hybrid, ImageNet-21k", True),
    Preset("vit_base_patch16_384.orig_in21k_ft_in1k", "Paper's ViT-B/16 at 384 px, fine-tuned on ImageNet-1k", True),
    Preset("vit_base_r50_s16_384.orig_in21k_ft_in1k", "Paper's R50+ViT-B/16 at 384 px, fine-tuned on ImageNet-1k",
           True),
    Preset("vit_large_patch32_384.orig_in21k_ft_in1k", "Paper's ViT-L/32 (Fig. 7 filters and position embeddings)",
           True),
    Preset("vit_base_patch16_224.augreg2_in21k_ft_in1k", "ViT-B/16, AugReg (How to train your ViT)", True),
    Preset("deit_small_distilled_patch16_224.fb_in1k", "DeiT-S distilled (class + distillation token)", True),
    Preset("vit_small_patch16_224.dino", "DINO self-supervised ViT-S/16 (features)", True),
    Preset("vit_base_patch14_reg4_dinov2.lvd142m", "DINOv2 ViT-B/14 with 4 register tokens (features)", True),
)


def list_models(include_downloads: bool = True) -> list[Preset]:
    """Presets: the embedded reference models first, then hub checkpoints (these need a download).

    Args:
        include_downloads: False: the embedded models only (what works offline).

    Returns:
        The ``Preset`` entries (name, description, whether it needs a download), in display order.
    """
    return [p for p in PRESETS if include_downloads or not p.needs_download]
