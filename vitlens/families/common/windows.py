"""Window geometry read through a model's own code, for the families whose blocks attend within windows or over
pooled grids (Swin, SAM / ViTDet, Hiera, MViT v2, PVT): a stand-in that runs a module's methods without touching
the module (``StandIn``), one block's windows recorded from its own partition code (``record_windows``), pooling
modules' kernels, strides and output grids, and the pixel centres of a grid's tokens.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ...core.windows import Transport, WindowGeometry, pooling_transport
from ...errors import UnsupportedModelError


def pair(v: Any) -> tuple[int, int]:
    """(v, v) of a number, (v[0], v[1]) of a pair (a config's ``image_size``, a module's ``kernel_size``)."""
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def identity(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """A stand-in's module that hands its input on (a norm, a projection)."""
    return x


def token_centres(grid: tuple[int, int], stride: tuple[int, int]) -> np.ndarray:
    """[H * W, 2] (y, x) pixel centres of a grid's tokens, row-major: token (r, c) at ((r + 0.5) sy, (c + 0.5) sx),
    the centre of its stride cell (as for every family)."""
    ys, xs = np.meshgrid((np.arange(grid[0]) + 0.5) * stride[0], (np.arange(grid[1]) + 0.5) * stride[1], indexing="ij")
    return np.stack([ys.ravel(), xs.ravel()], axis=1)


class StandIn:
    """A module seen through a stand-in: every attribute the module's, every method of its class run with the
    stand-in as ``self`` (so what a method sets, e.g. a window size it clamps, lands on the stand-in), and the
    attributes given here in place of the module's. Nothing is set on the module, so a forward of another
    thread is not touched and the model stays as it is.

    Args:
        module: the module (a Swin block).
        **replaced: attributes seen in place of the module's (its attention: a recorder; a norm: the identity).
    """

    def __init__(self, module: nn.Module, **replaced: Any) -> None:
        self.__dict__["_module"] = module
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        module = self.__dict__["_module"]
        static = inspect.getattr_static(type(module), name, None)
        if inspect.isfunction(static):  # a method of the module's class, run on the stand-in
            return static.__get__(self, type(self))
        return getattr(module, name)


class _Recorded(Exception):
    """What a block handed its attention: the windows of token numbers and the mask (ends the block's code)."""

    def __init__(self, windows: torch.Tensor, mask: torch.Tensor | None) -> None:
        super().__init__("recorded")
        self.windows, self.mask = windows, mask


def _recorder(x_windows: torch.Tensor, mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
    raise _Recorded(x_windows[..., 0].detach().clone(), mask)


def record_windows(run: Callable[[torch.Tensor, Callable[..., Any]], Any], grid: tuple[int, int], stage: int,
                   stride: tuple[int, int], what: str = "block") -> WindowGeometry:
    """One block's windows on its stage grid, read through the block's own code.

    Args:
        run: ``run(numbers, recorder)`` runs the block's window code on ``numbers`` ([H_s, W_s] float64, the
            token numbers 1..H_s*W_s, row-major; 0 is what padding brings), with ``recorder`` in place of its
            attention module (called as the block calls it: windows [windows, N, 1], then the mask).
        grid: (H_s, W_s) the stage's token grid.
        stage: the stage's number.
        stride: (sy, sx) pixels between the stage's tokens.
        what: the block, in words, for the error.

    Returns:
        The ``WindowGeometry``: windows in the model's order, each position's stage token (-1: padding), which
            keys each query may attend (the real keys, the mask's 0 entries where the block hands one: timm's and
            transformers' 0 / -100 mask of the shifted windows), and its kind ("shifted window" where the block
            hands a mask, "global" for one window holding the whole grid, "window" otherwise).

    Raises:
        UnsupportedModelError: the block's code did not call its attention with the windows.
    """
    h, w = (int(g) for g in grid)
    numbers = torch.arange(1, h * w + 1, dtype=torch.float64).reshape(h, w)
    try:
        with torch.no_grad():
            run(numbers, _recorder)
    except _Recorded as seen:
        windows, mask = seen.windows, seen.mask
    else:
        raise UnsupportedModelError(f"{what}: its window code did not call its attention; vitlens cannot read "
                                    "its windows.")
    # [windows, N] (a window handed over as [windows, w_h, w_w] too: SAM's), -1 at padding
    index = windows.round().long().reshape(windows.shape[0], -1).cpu().numpy() - 1
    valid = index >= 0
    allowed = np.broadcast_to(valid[:, None, :], (*index.shape, index.shape[1])).copy()
    if mask is not None:  # attend where the mask is 0 (-100 elsewhere)
        allowed &= mask.detach().cpu().numpy().reshape(index.shape[0], index.shape[1], index.shape[1]) > -1.0
    kind = "shifted window" if mask is not None else ("global" if index.shape[0] == 1 and valid.all() else "window")
    return WindowGeometry(stage=stage, grid=(h, w), stride_px=(int(stride[0]), int(stride[1])), index=index,
                          allowed=allowed, kind=kind)


def pooling_of(module: nn.Module) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(kernel, stride, padding) per axis of a pooling module (Conv2d, MaxPool2d, AvgPool2d)."""
    if getattr(module, "dilation", 1) not in (1, (1, 1)) or getattr(module, "ceil_mode", False):
        raise UnsupportedModelError(f"a {type(module).__name__} with dilation or ceil_mode: vitlens places the tokens "
                                    "of plain strided poolings only.")
    return pair(module.kernel_size), pair(module.stride), pair(module.padding)


def pooled_grid(grid: tuple[int, int], module: nn.Module | None) -> tuple[int, int]:
    """The grid a pooling module makes of ``grid`` (``grid`` itself where there is no pooling)."""
    if module is None:
        return grid
    kernel, stride, padding = pooling_of(module)
    # the ignore below: 2 ints (mypy: tuple[int, ...])
    return tuple((n + 2 * p - k) // s + 1 for n, k, s, p in zip(grid, kernel, stride, padding))  # type: ignore[return-value]


def pooling_module_transport(fine: tuple[int, int], pool: nn.Module | None,
                             coarse: tuple[int, int] | None = None) -> Transport | None:
    """The stated transport of a pooling module (each pooled token the mean of the tokens its kernel covers inside
    the grid), None where there is none."""
    if pool is None:
        return None
    kernel, stride, padding = pooling_of(pool)
    return pooling_transport(fine, kernel, stride, padding, coarse)


__all__ = ["StandIn", "identity", "pair", "pooled_grid", "pooling_module_transport", "pooling_of", "record_windows",
           "token_centres"]
