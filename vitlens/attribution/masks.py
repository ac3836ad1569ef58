"""Does a map point at the object? Mass inside an object mask, the pointing game and the IoU of the map's
segmentation (the cells above the map's mean: Gandelsman et al.'s and Chefer et al.'s binarisation) with the mask,
for any [gh, gw] map on the patch grid (rollout, paper Fig. 6, or an attribution map).

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
        iou: [B] intersection over union of the map's segmentation (the cells above its mean, each cell's pixels
            taken whole) and the object's pixels.
    """

    mass_in_mask: np.ndarray
    area_share: np.ndarray
    ratio: np.ndarray
    pointing_hit: np.ndarray
    iou: np.ndarray | None = None

    def summary(self) -> dict[str, float]:
        return {
            "n": int(len(self.ratio)),
            "mass_in_mask": float(self.mass_in_mask.mean()),
            "area_share": float(self.area_share.mean()),
            "ratio_mean": float(self.ratio.mean()),
            "ratio_median": float(np.median(self.ratio)),
            "share_above_area": float((self.ratio > 1).mean()),
            "pointing_game": float(self.pointing_hit.mean()),
            "iou": float(self.iou.mean()) if self.iou is not None else float("nan"),
        }


def mask_scores(maps: np.ndarray, masks: np.ndarray) -> MaskScores:
    """Score maps [B, gh, gw] against bool masks [B, H, W] (images with empty masks are skipped).

    Args:
        maps: [B, gh, gw] attribution maps.
        masks: [B, H, W] bool object masks on the model's input (H, W multiples of the grid).

    Returns:
        ``MaskScores``: per image ``mass_in_mask`` (share of the map's mass inside the mask, [0, 1]),
            ``area_share`` (the mask's share of the image), ``ratio`` (their quotient), ``pointing_hit``
            (whether the map's maximum lies in the mask) and ``iou`` (``segmentation_iou``).

    Negative values (signed attributions) are clipped to 0 before measuring mass; the IoU reads the signed map.
    """
    if maps.ndim != 3 or masks.ndim != 3 or len(maps) != len(masks):
        raise InvalidParameterError(f"Need maps [B, gh, gw] and masks [B, H, W] of the same B; got {maps.shape} "
                                    f"and {masks.shape}.")
    keep = masks.reshape(len(masks), -1).any(axis=1)
    signed, masks = maps[keep].astype(np.float64), masks[keep]
    maps = np.clip(signed, 0, None)
    cover = np.stack([patch_coverage(m, maps.shape[1:]) for m in masks])
    total = maps.reshape(len(maps), -1).sum(1)
    mass = (maps * cover).reshape(len(maps), -1).sum(1) / np.where(total > 0, total, 1.0)
    area = masks.reshape(len(masks), -1).mean(1)
    top = maps.reshape(len(maps), -1).argmax(1)
    hit = cover.reshape(len(cover), -1)[np.arange(len(cover)), top] > 0
    return MaskScores(mass_in_mask=mass, area_share=area, ratio=mass / area, pointing_hit=hit,
                      iou=segmentation_iou(signed, cover))


def segmentation_iou(maps: np.ndarray, cover: np.ndarray) -> np.ndarray:
    """[B] the IoU of each map's segmentation with its object: a cell is foreground when its value is above the map's
    mean (the binarisation of Gandelsman et al.'s and Chefer et al.'s segmentation tests), its pixels taken whole (the
    map shown as tokens); the object's pixels are ``cover`` [B, gh, gw], each cell's share of pixels on the object
    (``patch_coverage``). A flat map segments nothing (IoU 0).

    Args:
        maps: [B, gh, gw] maps (signed or not).
        cover: [B, gh, gw] each cell's share of object pixels, in [0, 1].

    Returns:
        [B] IoU in [0, 1], in units of one cell's pixels.
    """
    flat = maps.reshape(len(maps), -1)
    fg = (flat > flat.mean(1, keepdims=True)).astype(np.float64)
    c = cover.reshape(len(cover), -1)
    inter = (fg * c).sum(1)
    union = fg.sum(1) + c.sum(1) - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)
