"""Where the tokens of a windowed or hierarchical ViT's attention sit (Swin and its kin): for each block,
the grid of its stage, the pixel stride of that grid, and, for every window the block attends within,
which token of the stage's grid each of its positions holds (the cyclic shift undone, padding marked).

What the windowed views read to place a query and a key in the image (attention distance in image pixels,
Fig. 7 right and Fig. 11 for hierarchical models) and to compose the block-diagonal window maps into a
rollout through the stages (Fig. 6).
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import numpy as np

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class WindowGeometry:
    """One block's windows.

    Attributes:
        stage: the stage the block belongs to (0: the first, at the patch embedding's grid).
        grid: (H_s, W_s) the stage's token grid.
        stride_px: (sy, sx) input pixels between neighbouring tokens of the stage.
        index: [windows, N] int64: the stage token (row-major, ``r * W_s + c``) at each position of each window,
            -1 where the window holds padding (a stage grid that is not a whole number of windows).
        allowed: [windows, N, N] bool: which keys each query of a window may attend (the shifted windows' mask;
            all True in a plain window), padding excluded.
        kind: "window", "shifted window" or "global" (one window over the whole grid).
    """

    stage: int
    grid: tuple[int, int]
    stride_px: tuple[int, int]
    index: np.ndarray
    allowed: np.ndarray
    kind: str

    @property
    def num_windows(self) -> int:
        return int(self.index.shape[0])

    @property
    def window_tokens(self) -> int:
        return int(self.index.shape[1])

    @property
    def num_tokens(self) -> int:
        """Tokens of the stage's grid, H_s * W_s."""
        return int(self.grid[0] * self.grid[1])



def merge_transport(fine: tuple[int, int], coarse: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The stated transport across a patch merging (rollout through stages): each coarse token is the mean of
    the fine tokens it merges, its 2x2 block (rows 2i, 2i+1, columns 2j, 2j+1; a block cut by the grid's
    border is the mean of the tokens it has, the padding is no token).

    Args:
        fine: (H, W) the grid before merging.
        coarse: (H', W') the grid after it (ceil(H / 2), ceil(W / 2)).

    Returns:
        (coarse token of each fine token [H * W], weight of each fine token in its coarse token's mean [H * W]).
    """
    (h, w), (ch, cw) = fine, coarse
    if (ch, cw) != (-(-h // 2), -(-w // 2)):
        raise ValueError(f"A merging of {h}x{w} tokens by 2x2 gives {-(-h // 2)}x{-(-w // 2)}, not {ch}x{cw}.")
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    parent = ((rows // 2) * cw + cols // 2).ravel()
    counts = np.bincount(parent, minlength=ch * cw)
    return parent.astype(np.int64), 1.0 / counts[parent]


def stage_centres(windows: list[WindowGeometry]) -> dict[int, np.ndarray]:
    """Every stage's token centres in input pixels, [H_s * W_s, 2] (y, x) row-major, by stage.

    The first stage's tokens sit at the centres of their patches ((r + 0.5) * stride); a merged token at the
    mean of the centres of the tokens it merges (``merge_transport``), so a token of a 2x2 block cut by the
    grid's border (a grid of odd size) sits at the centre of what it holds, inside the image, and every
    other at (r + 0.5) * its stage's stride.

    Args:
        windows: every block's geometry, first block first (the first block's stage is the first stage).

    Returns:
        {stage: centres}.
    """
    first = windows[0]
    (gh, gw), (sy, sx) = first.grid, first.stride_px
    ys, xs = np.meshgrid((np.arange(gh) + 0.5) * sy, (np.arange(gw) + 0.5) * sx, indexing="ij")
    centres = {first.stage: np.stack([ys.ravel(), xs.ravel()], axis=1)}
    previous = first
    for g in windows[1:]:
        if g.stage == previous.stage:
            continue
        parent, weight = merge_transport(previous.grid, g.grid)
        merged = np.zeros((g.num_tokens, 2))
        np.add.at(merged, parent, centres[previous.stage] * weight[:, None])
        centres[g.stage] = merged
        previous = g
    return centres


def refuse_windowed(spec: Any, what: str) -> None:
    """Refuse, in one line, a reading defined for a ViT's one global attention over one token grid when the model
    attends within windows on stages of coarser grids (``spec.kind == "hierarchical"``), naming what to use.

    Args:
        spec: the model's ``ModelSpec``.
        what: the reading refused, in words ("attention_maps", "CKA", ...).

    Raises:
        UnsupportedModelError: the model is hierarchical.
    """
    if getattr(spec, "kind", "") == "hierarchical":
        raise UnsupportedModelError(
            f"{what} reads a ViT's attention over one token grid; {spec.name} attends within windows on stages of "
            "coarser grids (hierarchical), so it is refused rather than read wrong. Its windowed views are exact: "
            "vl.attention_distance, vl.attention_rollout, and one query's window from "
            "vitlens.views.windowed.window_maps / query_window_attention.")


def refuse_class_attention(spec: Any, what: str) -> None:
    """Refuse, in one line, a reading defined for a ViT's one global attention over one sequence of tokens when the
    model's blocks are of two kinds (``spec.kind == "class-attention"``, CaiT: self-attention over the patches alone,
    then class-attention layers whose one query is the class token), naming what to use.

    Args:
        spec: the model's ``ModelSpec``.
        what: the reading refused, in words ("attention_maps", "CKA", ...).

    Raises:
        UnsupportedModelError: the model has class-attention layers.
    """
    if getattr(spec, "kind", "") == "class-attention":
        raise UnsupportedModelError(
            f"{what} reads a ViT whose every block attends over the same tokens; {spec.name} has self-attention blocks "
            "over the patches alone and then class-attention layers (the class token's one query), so it is refused "
            "rather than read wrong. Its views are exact: vl.attention_distance (the self-attention blocks), "
            "vl.attention_rollout (from the class token through both kinds), and every block's maps from "
            "vl.capture_attention ([B, heads, N, N], then [B, heads, 1, 1 + N]).")


__all__ = ["WindowGeometry", "merge_transport", "refuse_class_attention", "refuse_windowed", "stage_centres"]
