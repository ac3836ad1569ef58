"""Does a map point at the object? Mass inside an object mask and the pointing game, for any
[gh, gw] map on the patch grid (rollout, paper Fig. 6, or an attribution map).

A map has one value per patch token, so each patch's value is spread evenly over its pixels:
the mask is reduced to the share of each patch's pixels that lie on the object, and nothing
depends on how a figure interpolates the map for display.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.resample import patch_coverage  # noqa: F401  (importable here; the survey's rollout statistics read it)
from ..errors import InvalidParameterError
from ..images import Images, preprocess_masks


def masks_at_input(masks: np.ndarray, data_config: dict, images: Images | None = None) -> np.ndarray:
    """Object masks of ``images`` at the size the model sees them: bool [B, H, W].

    Masks drawn on the original images (e.g. 64 px scenes for a 224 px model) go through the
    same resize and crop as their images (``preprocess_masks``, nearest neighbour); masks already
    at the size of a preprocessed image tensor, or at the model's input size, stay as they are.
    """
    masks = np.asarray(masks, dtype=bool)
    import torch

    if isinstance(images, torch.Tensor) and masks.shape[-2:] == tuple(images.shape[-2:]):
        return masks
    return preprocess_masks(masks, data_config)


@dataclass(frozen=True)
class MaskScores:
    """Agreement of a batch of maps with object masks.

    Attributes:
        mass_in_mask: [B] share of each map's (non-negative) mass on object pixels.
        area_share: [B] share of the image's pixels on the object.
        ratio: [B] mass_in_mask / area_share (1 = no better than uniform).
        pointing_hit: [B] whether the map's top patch overlaps the object.
    """

    mass_in_mask: np.ndarray
    area_share: np.ndarray
    ratio: np.ndarray
    pointing_hit: np.ndarray

    def summary(self) -> dict[str, float]:
        return {
            "n": int(len(self.ratio)),
            "mass_in_mask": float(self.mass_in_mask.mean()),
            "area_share": float(self.area_share.mean()),
            "ratio_mean": float(self.ratio.mean()),
            "ratio_median": float(np.median(self.ratio)),
            "share_above_area": float((self.ratio > 1).mean()),
            "pointing_game": float(self.pointing_hit.mean()),
        }


def mask_scores(maps: np.ndarray, masks: np.ndarray) -> MaskScores:
    """Score maps [B, gh, gw] against bool masks [B, H, W] (images with empty masks are skipped).

    Args:
        maps: [B, gh, gw] attribution maps.
        masks: [B, H, W] bool object masks on the model's input (H, W multiples of the grid).

    Returns:
        ``MaskScores``: per image ``mass_in_mask`` (share of the map's mass inside the mask, [0, 1]),
            ``area_share`` (the mask's share of the image), ``ratio`` (their quotient) and ``pointing_hit``
            (whether the map's maximum lies in the mask).

    Negative values (signed attributions) are clipped to 0 before measuring mass.
    """
    if maps.ndim != 3 or masks.ndim != 3 or len(maps) != len(masks):
        raise InvalidParameterError(f"Need maps [B, gh, gw] and masks [B, H, W] of the same B; got {maps.shape} "
                                    f"and {masks.shape}.")
    keep = masks.reshape(len(masks), -1).any(axis=1)
    maps, masks = np.clip(maps[keep].astype(np.float64), 0, None), masks[keep]
    cover = np.stack([patch_coverage(m, maps.shape[1:]) for m in masks])
    total = maps.reshape(len(maps), -1).sum(1)
    mass = (maps * cover).reshape(len(maps), -1).sum(1) / np.where(total > 0, total, 1.0)
    area = masks.reshape(len(masks), -1).mean(1)
    top = maps.reshape(len(maps), -1).argmax(1)
    hit = cover.reshape(len(cover), -1)[np.arange(len(cover)), top] > 0
    return MaskScores(mass_in_mask=mass, area_share=area, ratio=mass / area, pointing_hit=hit)
