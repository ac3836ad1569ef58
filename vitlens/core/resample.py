"""Moving maps between the patch grid and the pixels: the resampling that attribution numbers rest on.

The perturbation metrics rank pixels by ``upsample_map`` (Chefer et al.'s and ROAD's pixel
granularity), and the pixel attribution methods reduce to tokens with ``pixels_to_grid``, so these
live with the numeric code; ``vitlens.figures`` draws with the same ``upsample_map`` and re-exports it.
``patch_coverage`` reduces an object mask to the patch grid (each patch's share of pixels on the object).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import InvalidParameterError


def upsample_map(values: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """Bilinear resize (``align_corners=False``, float64) of a [gh, gw] map to (H, W): the pixel map of a
    token map, for display (Fig. 6, Fig. 14) and for the pixel-granularity perturbation metrics."""
    t = torch.as_tensor(np.asarray(values, dtype=np.float64))[None, None]
    return F.interpolate(t, size=tuple(size), mode="bilinear", align_corners=False)[0, 0].numpy()


def pixels_to_grid(attr: torch.Tensor, grid: tuple[int, int], reduce: str = "sum") -> np.ndarray:
    """[B, C, H, W] pixel attributions -> [B, gh, gw] float64: channels summed, then each token's
    (H // gh) x (W // gw) pixel block summed (``reduce="sum"``) or averaged (``"mean"``); pixels past the
    last whole block are dropped (the patch embedding never sees them)."""
    b, _, h, w = attr.shape
    gh, gw = grid
    a = attr.detach().to(torch.float64).sum(1)[:, : gh * (h // gh), : gw * (w // gw)]
    blocks = a.reshape(b, gh, h // gh, gw, w // gw)
    out = blocks.sum(dim=(2, 4)) if reduce == "sum" else blocks.mean(dim=(2, 4))
    return out.cpu().numpy()



def patch_coverage(mask: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """Share of each patch's pixels inside ``mask``: bool [H, W] -> float64 [gh, gw].

    H and W must be multiples of the grid (the model's input size and token grid).

    Args:
        mask: [H, W] bool mask.
        grid: (gh, gw), the token grid.

    Returns:
        [gh, gw] float64 shares in [0, 1].
    """
    h, w = mask.shape
    gh, gw = grid
    if h % gh or w % gw:
        raise InvalidParameterError(f"A mask of {h}x{w} pixels does not tile a {gh}x{gw} grid evenly; "
                                    "resize the mask to the model's input size first.")
    return mask.reshape(gh, h // gh, gw, w // gw).mean(axis=(1, 3), dtype=np.float64)


__all__ = ["patch_coverage", "pixels_to_grid", "upsample_map"]
