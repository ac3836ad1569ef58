"""A video transformer's token layout (issue 50): for each token its time step (a frame, or a tubelet's span of
frames), its cell in the frame's grid, and the prefix tokens; for a model with divided space-time attention, which
of a block's maps is temporal and which spatial.

Serves the space-time views (docs/definitions.md, "Video: space and time"): the spatial distance reads the cells'
centres in pixels, the temporal distance the time steps' centres in frames, rollout the tokens' order. The views
read tokens in the canonical order -- prefix tokens first, then the cells time-major (step, row, col) -- and
``to_canonical`` permutes a joint map from the model's own order into it (an exact relabelling).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidParameterError

#: the cell orders a model's sequence may have: time-major (step, row, col: VideoMAE, ViViT, V-JEPA 2's
#: Conv3d tokens flattened) or space-major (row, col, step: TimeSformer's divided sequence)
ORDERS = ("time-major", "space-major")
#: the roles of a map: a joint block's one map over every token, or a divided block's temporal map (each cell over
#: the time steps) and spatial map (each time step over its cells and the class token)
ROLES = ("joint", "temporal", "spatial")


@dataclass(frozen=True)
class ClipLayout:
    """Where each token of a video transformer stands in space and time.

    Attributes:
        frames: input frames per clip.
        tubelet: frames per time step (1: a frame per step, TimeSformer; 2: VideoMAE's tubelets).
        grid: (rows, cols) of each time step's cells.
        stride_px: (sy, sx) input pixels between neighbouring cells.
        prefix: the prefix tokens' names before the cells ("class",), () without any.
        order: the model's cell order (``ORDERS``).
        divided: each block makes two maps, temporal then spatial (TimeSformer's ``divided_space_time``); False: one
            joint map over every token.
    """

    frames: int
    tubelet: int
    grid: tuple[int, int]
    stride_px: tuple[int, int]
    prefix: tuple[str, ...] = ()
    order: str = "time-major"
    divided: bool = False

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise InvalidParameterError(f"a clip layout's order is one of {ORDERS}; got {self.order!r}")
        if self.tubelet < 1 or self.frames % self.tubelet:
            raise InvalidParameterError(f"{self.frames} frames are not a whole number of tubelets of {self.tubelet}")

    @property
    def steps(self) -> int:
        """Time steps T' (frames // tubelet)."""
        return self.frames // self.tubelet

    @property
    def cells(self) -> int:
        """Cells per time step (rows x cols)."""
        return self.grid[0] * self.grid[1]

    @property
    def num_prefix(self) -> int:
        return len(self.prefix)

    @property
    def num_tokens(self) -> int:
        """Tokens of the whole sequence: the prefix and every step's cells."""
        return self.num_prefix + self.steps * self.cells

    def map_roles(self, blocks: int) -> tuple[str, ...]:
        """The role of each map a capture hands over (``ROLES``), first map first: a joint model's one per block; a
        divided model's two per block, temporal (map 2l) then spatial (map 2l + 1)."""
        return ("temporal", "spatial") * blocks if self.divided else ("joint",) * blocks

    def time_centres(self) -> np.ndarray:
        """[T'] each time step's centre in frames: the mean of its frames (step * tubelet + (tubelet - 1) / 2)."""
        return np.arange(self.steps) * self.tubelet + (self.tubelet - 1) / 2.0

    def cell_positions(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(time centre in frames, y px, x px) of every cell in canonical order (time-major), each [T' * cells]."""
        gh, gw = self.grid
        t, r, c = np.meshgrid(np.arange(self.steps), np.arange(gh), np.arange(gw), indexing="ij")
        return (self.time_centres()[t.reshape(-1)], r.reshape(-1) * float(self.stride_px[0]),
                c.reshape(-1) * float(self.stride_px[1]))

    def canonical_order(self) -> list[int]:
        """The model's position of each canonical token (prefix, then cells time-major): ``x[..., order]``."""
        p, cells, steps = self.num_prefix, self.cells, self.steps
        if self.order == "time-major":
            return list(range(self.num_tokens))
        return list(range(p)) + [p + cell * steps + t for t in range(steps) for cell in range(cells)]

    def to_canonical(self, probs: torch.Tensor) -> torch.Tensor:
        """A joint map's query and key axes permuted into canonical order (exact: each entry moves, none changes)."""
        if probs.shape[-1] != self.num_tokens:
            raise InvalidParameterError(f"the clip layout has {self.num_tokens} tokens; the map has {probs.shape[-1]}")
        if self.order == "time-major":
            return probs
        order = torch.as_tensor(self.canonical_order(), device=probs.device)
        return probs.index_select(-2, order).index_select(-1, order)

    def describe(self) -> str:
        """One line for the spec's ``describe()``: the steps, the grid, the prefix, and each block's maps."""
        span = "a frame per step" if self.tubelet == 1 else f"tubelets of {self.tubelet} frames"
        prefix = ", ".join(self.prefix) or "no prefix tokens"
        maps = ("divided: map 2l is block l's temporal attention [B * cells, heads, T', T'] (each cell over the "
                "steps), map 2l + 1 its spatial attention [B * T', heads, 1 + cells, 1 + cells] (each step over "
                "the class token and its cells)") if self.divided else "joint: one map per block over every token"
        return (f"clip of {self.frames} frames in {self.steps} steps ({span}), {self.grid[0]}x{self.grid[1]} cells "
                f"each, {prefix}; model order {self.order}; {maps}")


__all__ = ["ClipLayout", "ORDERS", "ROLES"]
