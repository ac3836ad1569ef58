"""Where the tokens of a windowed or hierarchical ViT's attention sit (Swin and its kin): for each block,
the grid of its stage, the pixel stride of that grid, and, for every window the block attends within,
which token of the stage's grid each of its positions holds (the cyclic shift undone, padding marked).

What the windowed views read to place a query and a key in the image (attention distance in image pixels,
Fig. 7 right and Fig. 11 for hierarchical models) and to compose the block-diagonal window maps into a
rollout through the stages (Fig. 6).
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Any, cast

import numpy as np



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
        kind: "window", "shifted window", "global" (one window over the whole grid), "grid" (MaxViT's grid attention:
            each window a dilated grid spread over the whole stage), or for a block whose keys are
            not its queries' tokens, "pooled" (MViT v2: keys pooled to a coarser grid) or "query-pooled window" /
            "query-pooled global" (Hiera: the queries pooled to the next stage's grid, the keys the block's input
            tokens, within mask units or over all of them).

    A block whose queries and keys are tokens of different grids (pooling attention) says so in the optional
    fields below; left at None, the keys are the queries' tokens (``index``) on the stage's grid, and the block
    reads and writes the stage's grid (Swin, SAM: the patch merging between stages is ``merge_transport``).

    Attributes (pooling attention):
        key_index: [windows, Nk] the key grid's token at each key position of each window (-1: padding).
        key_grid: (H_k, W_k) the grid of the keys.
        query_centres: [H_s * W_s, 2] (y, x) the queries' centres in input pixels (None: ``stage_centres``).
        key_centres: [H_k * W_k, 2] the keys' centres in input pixels (None: the query grid's centres).
        input_grid: (H_in, W_in) the grid of the tokens that enter the block (None: ``grid``).
        key_from: the stated transport of the keys onto the input tokens (None: the keys are the input tokens).
        query_from: the stated transport of the block's output tokens (its queries and pooled residual) onto the
            input tokens (None: the identity).
        stage_from: the stated transport of the tokens entering the block (``in_grid``) onto the previous block's
            output tokens, where a stage's own embedding makes them (PVT: a strided convolution of the previous
            stage's tokens); None: the patch merging (``merge_transport``) where the two grids differ, else none.
        prefix_tokens: tokens outside every grid at the start of the block's one window (PVT v1's class token in
            its last stage), marked -1 in ``index`` and ``key_index`` (they have no place in the image: the distance
            reads the grid's tokens alone), carried by the rollout as tokens of their own (0: none).
    """

    stage: int
    grid: tuple[int, int]
    stride_px: tuple[int, int]
    index: np.ndarray
    allowed: np.ndarray
    kind: str
    key_index: np.ndarray | None = None
    key_grid: tuple[int, int] | None = None
    query_centres: np.ndarray | None = None
    key_centres: np.ndarray | None = None
    input_grid: tuple[int, int] | None = None
    key_from: "Transport | None" = None
    query_from: "Transport | None" = None
    stage_from: "Transport | None" = None
    prefix_tokens: int = 0

    @property
    def num_windows(self) -> int:
        return int(self.index.shape[0])

    @property
    def window_tokens(self) -> int:
        """Query positions per window, Nq (the keys' ``key_tokens``; the same in a plain window)."""
        return int(self.index.shape[1])

    @property
    def num_tokens(self) -> int:
        """Tokens of the stage's grid, H_s * W_s."""
        return int(self.grid[0] * self.grid[1])

    @property
    def keys(self) -> np.ndarray:
        """[windows, Nk] the key grid's token at each key position (``index`` where the keys are the queries')."""
        return self.index if self.key_index is None else self.key_index

    @property
    def key_tokens(self) -> int:
        """Key positions per window, Nk."""
        return int(self.keys.shape[1])

    @property
    def keys_grid(self) -> tuple[int, int]:
        """The grid the keys are tokens of."""
        return self.grid if self.key_grid is None else self.key_grid

    @property
    def in_grid(self) -> tuple[int, int]:
        """The grid of the tokens entering the block."""
        return self.grid if self.input_grid is None else self.input_grid


@dataclass(frozen=True)
class Transport:
    """A stated transport from the tokens of one grid onto those of another (rollout through pooling): token
    ``rows[i]`` of the pooled grid takes ``weights[i]`` of token ``cols[i]`` of the finer grid; each pooled token's
    weights sum to 1 (the mean of the tokens its pooling covers, as patch merging is read: ``merge_transport``).

    Attributes:
        rows: [nnz] int64 tokens of the pooled grid.
        cols: [nnz] int64 tokens of the finer grid.
        weights: [nnz] float64.
        shape: (pooled tokens, finer tokens).
    """

    rows: np.ndarray
    cols: np.ndarray
    weights: np.ndarray
    shape: tuple[int, int]

    def pull(self, v: "Any") -> "Any":
        """``v`` [B, pooled tokens] (a torch tensor) carried back onto the finer tokens: v_fine = v P."""
        import torch

        rows = torch.from_numpy(self.rows).to(v.device)
        cols = torch.from_numpy(self.cols).to(v.device)
        w = torch.from_numpy(self.weights).to(device=v.device, dtype=v.dtype)
        out = torch.zeros(v.shape[0], self.shape[1], dtype=v.dtype, device=v.device)
        return out.index_add_(1, cols, v[:, rows] * w)

    def dense(self) -> np.ndarray:
        """[pooled tokens, finer tokens] the transport as a matrix (tests, small grids)."""
        out = np.zeros(self.shape)
        np.add.at(out, (self.rows, self.cols), self.weights)
        return out


def pooling_transport(fine: tuple[int, int], kernel: tuple[int, int], stride: tuple[int, int],
                      padding: tuple[int, int], coarse: tuple[int, int] | None = None) -> Transport:
    """The stated transport of a 2-D pooling (a strided max/avg pool or convolution over the token grid): each
    pooled token the mean of the fine tokens its kernel covers inside the grid (padding is no token).

    Args:
        fine: (H, W) the grid pooled.
        kernel: the pooling's kernel, per axis.
        stride: its stride, per axis.
        padding: its padding, per axis.
        coarse: the pooled grid (default: the pooling's output size, floor((H + 2p - k) / s) + 1).

    Returns:
        The ``Transport`` [coarse tokens, fine tokens].
    """
    h, w = fine
    out = coarse or tuple((n + 2 * p - k) // s + 1 for n, k, s, p in zip(fine, kernel, stride, padding))
    rows, cols, weights = [], [], []
    for i in range(out[0]):
        ys = [y for y in range(i * stride[0] - padding[0], i * stride[0] - padding[0] + kernel[0]) if 0 <= y < h]
        for j in range(out[1]):
            xs = [x for x in range(j * stride[1] - padding[1], j * stride[1] - padding[1] + kernel[1]) if 0 <= x < w]
            cells = [y * w + x for y in ys for x in xs]
            rows += [i * out[1] + j] * len(cells)
            cols += cells
            weights += [1.0 / len(cells)] * len(cells)
    return Transport(np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64), np.array(weights),
                     (int(out[0] * out[1]), int(h * w)))


def adaptive_pooling_transport(fine: tuple[int, int], coarse: tuple[int, int]) -> Transport:
    """The transport of an adaptive average pooling (``nn.AdaptiveAvgPool2d(coarse)``): pooled token (i, j) the mean
    of the fine tokens of its bin, rows floor(i H / H') to ceil((i + 1) H / H') - 1 (columns likewise), the
    bins PyTorch averages (they overlap, or repeat a token, where the pooled grid is not a divisor of the fine one).

    Args:
        fine: (H, W) the grid pooled.
        coarse: (H', W') the pooled grid.

    Returns:
        The ``Transport`` [H' * W', H * W] (exactly the pooling's weights).
    """
    (h, w), (oh, ow) = fine, coarse
    rows, cols, weights = [], [], []
    for i in range(oh):
        ys = range(i * h // oh, -(-(i + 1) * h // oh))
        for j in range(ow):
            xs = range(j * w // ow, -(-(j + 1) * w // ow))
            cells = [y * w + x for y in ys for x in xs]
            rows += [i * ow + j] * len(cells)
            cols += cells
            weights += [1.0 / len(cells)] * len(cells)
    return Transport(np.array(rows, dtype=np.int64), np.array(cols, dtype=np.int64), np.array(weights),
                     (int(oh * ow), int(h * w)))


def transport_centres(t: Transport, centres: np.ndarray) -> np.ndarray:
    """[pooled tokens, 2] each pooled token's centre: the weighted mean of the centres of the tokens it covers."""
    out = np.zeros((t.shape[0], 2))
    np.add.at(out, t.rows, centres[t.cols] * t.weights[:, None])
    return out



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
    if first.query_centres is not None:  # a family that places its tokens itself (pooling attention)
        # such a family places every stage's tokens (each geometry it writes holds its query_centres)
        return {g.stage: cast(np.ndarray, g.query_centres) for g in reversed(windows)}
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


def block_heads(family: Any, model: Any) -> list[int]:
    """The heads of every block's attention, first block first: the family's ``block_heads`` where it has one (its
    attention modules do not say it as ``num_heads``), else each attention module's ``num_heads``."""
    heads = family.block_heads  # an optional ability of ``Family``: None where ``num_heads`` says it
    if heads is not None:
        return [int(h) for h in heads(model)]
    return [int(a.num_heads) for a in family.attention_modules(model)]


def stage_heads(family: Any, model: Any, image_size: tuple[int, int]) -> tuple[tuple[int, ...], ...]:
    """A hierarchical model's heads of every block, grouped by stage (``WindowGeometry.stage``), first stage first:
    Swin-T's ((3, 3), (6, 6), (12,) * 6, (24, 24)). () for a family without windows (one global attention)."""
    windows = family.windows  # an optional ability of ``Family``: None for global attention
    if windows is None:
        return ()
    stages: dict[int, list[int]] = {}
    for g, heads in zip(windows(model, image_size), block_heads(family, model)):
        stages.setdefault(g.stage, []).append(heads)
    return tuple(tuple(stages[s]) for s in sorted(stages))


__all__ = ["Transport", "WindowGeometry", "adaptive_pooling_transport", "block_heads", "merge_transport",
           "pooling_transport", "stage_centres", "stage_heads", "transport_centres"]
