"""Noisy linear imputation (Rong et al., 2022, "A Consistent and Efficient Evaluation Strategy for
Attribution Methods", ROAD, section 4): every removed pixel becomes the weighted mean of its eight
neighbours, solved jointly for all removed pixels as one sparse linear system, plus Gaussian noise.

The neighbour weights are the paper's (and its ``NoisyLinearImputer``'s): 1/6 for the four edge
neighbours, 1/12 for the four diagonal ones; a neighbour outside the image drops out and the pixel
is the weighted mean of the neighbours that exist. Known neighbours go to the right-hand side,
removed ones stay unknowns, so a removed region is filled from its border inwards (a discrete
Laplace equation), which is why the fill carries no information about the removed pixels' shape
beyond what the border holds.

Unlike the reference code (one image at a time, a ``lil_matrix`` filled in a Python loop over
offsets), the system of a whole batch is built with array indexing as one block-diagonal matrix
and solved with one ``spsolve``; the equations are the same.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidParameterError

NEIGHBOUR_WEIGHTS: tuple[tuple[tuple[int, int], float], ...] = (
    ((1, 1), 1 / 12), ((0, 1), 1 / 6), ((-1, 1), 1 / 12), ((1, -1), 1 / 12),
    ((0, -1), 1 / 6), ((-1, -1), 1 / 12), ((1, 0), 1 / 6), ((-1, 0), 1 / 6),
)


def noisy_linear_impute(images: np.ndarray, removed: np.ndarray, noise_std: float = 0.01,
                        rng: np.random.Generator | int | None = 0) -> np.ndarray:
    """Fill the removed pixels of a batch by noisy linear imputation.

    Args:
        images: [B, C, H, W] float images (any units; ROAD works on the model's normalised input).
        removed: [B, H, W] bool, True where a pixel is removed (the same for every channel).
        noise_std: standard deviation of the Gaussian noise added to every imputed value, in the
            images' units (the paper's and quantus's default 0.01); 0 for the plain linear fill.
        rng: a numpy Generator or a seed for the noise.

    Returns:
        [B, C, H, W] float64: the images with the removed pixels imputed; kept pixels unchanged.
    """
    x = np.asarray(images, dtype=np.float64)
    mask = np.asarray(removed, dtype=bool)
    if x.ndim != 4 or mask.shape != (x.shape[0], *x.shape[2:]):
        raise InvalidParameterError(f"noisy_linear_impute needs images [B, C, H, W] and a removed mask [B, H, W]; "
                                    f"got {x.shape} and {mask.shape}.")
    if noise_std < 0:
        raise InvalidParameterError(f"noise_std must be >= 0; got {noise_std}.")
    b, c, h, w = x.shape
    for i in range(b):
        if mask[i].all():
            raise InvalidParameterError(f"image {i} has every pixel removed: nothing is left to impute from.")
    out = x.copy()
    if not mask.any():
        return out
    from scipy.sparse import coo_matrix
    from scipy.sparse.linalg import spsolve

    flat = x.transpose(1, 0, 2, 3).reshape(c, -1)  # [C, B*H*W]
    unknown = np.flatnonzero(mask.reshape(-1))
    var_of = np.full(mask.size, -1, dtype=np.int64)
    var_of[unknown] = np.arange(len(unknown))
    img, rem = np.divmod(unknown, h * w)
    row, col = np.divmod(rem, w)
    rows, cols, vals = [], [], []
    rhs = np.zeros((len(unknown), c))
    diag = np.zeros(len(unknown))
    eq = np.arange(len(unknown))
    for (dr, dc), weight in NEIGHBOUR_WEIGHTS:
        r2, c2 = row + dr, col + dc
        inside = (r2 >= 0) & (r2 < h) & (c2 >= 0) & (c2 < w)
        nb = img[inside] * h * w + r2[inside] * w + c2[inside]
        diag[inside] += weight
        known = var_of[nb] < 0
        e = eq[inside]
        rhs[e[known]] -= weight * flat[:, nb[known]].T
        rows.append(e[~known])
        cols.append(var_of[nb[~known]])
        vals.append(np.full(int((~known).sum()), weight))
    rows.append(eq)
    cols.append(eq)
    vals.append(-diag)
    n = len(unknown)
    a = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(n, n)).tocsc()
    solution = np.asarray(spsolve(a, rhs)).reshape(n, c)
    gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    if noise_std > 0:
        solution = solution + noise_std * gen.standard_normal(solution.shape)
    out_flat = out.transpose(1, 0, 2, 3).reshape(c, -1)
    out_flat[:, unknown] = solution.T
    return out_flat.reshape(c, b, h, w).transpose(1, 0, 2, 3).copy()
