"""View 2, paper Fig. 7 (centre) and Fig. 10: cosine similarity of position embeddings.

Tile (r, c) of the figure is the similarity of patch (r, c)'s embedding to every patch's:
``similarity[r, c]`` is a [gh, gw] map. Prefix rows of E_pos are dropped; a model can be
viewed at another grid by resampling E_pos on its 2D grid first (bicubic, as timm does).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import InvalidParameterError, ViewNotAvailableError
from ..loading.model import LoadedModel
from ..results import Result


@dataclass(eq=False, repr=False)
class PositionSimilarityResult(Result):
    """Cosine similarity between the position embeddings of all pairs of patches.

    Attributes:
        similarity: [gh, gw, gh, gw]; ``similarity[r, c, r2, c2]`` = cos(E_pos[r, c], E_pos[r2, c2]).
        grid: (gh, gw) of ``similarity``.
        model_grid: the grid E_pos was learned at.
        resized: whether E_pos was resampled to ``grid`` first.
        model_name: the model's name.
    """

    kind = "position_similarity"
    similarity: np.ndarray
    grid: tuple[int, int]
    model_grid: tuple[int, int]
    resized: bool
    model_name: str = ""

    def summary(self) -> str:
        gh, gw = self.grid
        note = f", E_pos resampled from {self.model_grid[0]}x{self.model_grid[1]}" if self.resized else ""
        return f"{self.model_name or 'model'}: {gh}x{gw} patches{note}"

    def to_rows(self) -> list[dict]:
        """One row per pair of patches (rows and columns 0-based): their cosine similarity."""
        gh, gw = self.grid
        s = self.similarity
        return [{"row": r, "col": c, "row2": r2, "col2": c2, "cosine": float(s[r, c, r2, c2])}
                for r in range(gh) for c in range(gw) for r2 in range(gh) for c2 in range(gw)]


def patch_position_embeddings(m: LoadedModel, grid: tuple[int, int] | None = None) -> torch.Tensor:
    """E_pos rows of the patch tokens, [gh * gw, D] in float64, optionally resampled to ``grid``.

    Raises:
        ViewNotAvailableError: the model has no learned absolute position table (its family says why).
    """
    spec = m.spec
    found = m.family.position_table(m.model, spec)
    if found is None:
        raise ViewNotAvailableError(
            f"Position similarity is not available for {spec.name}: "
            f"{m.family.no_position_reason(m.model, spec)}.")
    table, table_grid = found
    rows = table.float().cpu()
    target = tuple(grid) if grid is not None else tuple(table_grid)
    if target != tuple(table_grid):
        from timm.layers import resample_abs_pos_embed

        rows = resample_abs_pos_embed(rows, new_size=list(target), old_size=list(table_grid), num_prefix_tokens=0,
                                      interpolation="bicubic", antialias=True)
    return rows[0].to(torch.float64)


def cosine_similarity_matrix(x: torch.Tensor) -> torch.Tensor:
    """[N, D] -> [N, N] cosine similarities in float64 (zero vectors give 0)."""
    x = x.to(torch.float64)
    unit = x / x.norm(dim=1, keepdim=True).clamp_min(1e-300)
    return unit @ unit.T


def position_similarity(m: LoadedModel, grid: tuple[int, int] | None = None) -> PositionSimilarityResult:
    """Cosine similarity of patch position embeddings (paper Fig. 7 centre, Fig. 10).

    Args:
        m: the model; must have a learned absolute E_pos.
        grid: (gh, gw) to resample E_pos to before comparing (None: the model's own grid).

    Returns:
        A ``PositionSimilarityResult``: ``similarity`` [gh, gw, gh, gw], cosine similarities in [-1, 1].

    Raises:
        ViewNotAvailableError: a model without a learned absolute E_pos (RoPE, relative bias, fixed sin-cos).
    """
    if grid is not None:
        if len(grid) != 2 or min(grid) < 1:
            raise InvalidParameterError(f"grid must be two positive integers (rows, cols); got {grid}.")
        grid = (int(grid[0]), int(grid[1]))
    found = m.family.position_table(m.model, m.spec)
    model_grid = (int(found[1][0]), int(found[1][1])) if found is not None else m.spec.grid
    target = grid or model_grid
    sim = cosine_similarity_matrix(patch_position_embeddings(m, target))
    return PositionSimilarityResult(
        similarity=sim.reshape(*target, *target).numpy(),
        grid=target,
        model_grid=model_grid,
        resized=target != model_grid,
        model_name=m.spec.name,
    )


def neighbour_similarity(result: PositionSimilarityResult) -> dict[str, float]:
    """Summary of 2D structure (paper Fig. 7 centre).

    - ``neighbours`` / ``far_ge3``: mean cosine to the 4 neighbours / to patches at least 3 cells
      away along some axis (Chebyshev distance >= 3);
    - ``same_row_col_dK`` / ``off_axis_dK`` for K = 2, 3: patches K cells away in the same row or
      column, against patches in other rows and columns whose Euclidean distance rounds to K
      (e.g. (1, 2) and (2, 2) cells away for K = 2, 3). Row/column structure shows as the first
      exceeding the second.
    """
    gh, gw = result.grid
    s = result.similarity.reshape(gh * gw, gh * gw)
    rr, cc = np.divmod(np.arange(gh * gw), gw)
    dr = np.abs(rr[:, None] - rr[None, :])
    dc = np.abs(cc[:, None] - cc[None, :])
    rounded = np.rint(np.sqrt(dr**2 + dc**2))
    on_axis = (dr == 0) | (dc == 0)

    def mean(sel: np.ndarray) -> float:
        return float(s[sel].mean()) if sel.any() else float("nan")

    out = {"neighbours": mean(dr + dc == 1), "far_ge3": mean(np.maximum(dr, dc) >= 3)}
    for k in (2, 3):
        out[f"same_row_col_d{k}"] = mean(on_axis & (np.maximum(dr, dc) == k))
        out[f"off_axis_d{k}"] = mean(~on_axis & (rounded == k))
    return out
