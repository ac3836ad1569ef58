"""The video processors' resize (their shorter side to ``shortest_edge``), one rule for the frames a reader resizes
as they decode and for ``VideoProcessing.frames_to_pixels`` (issue 62: a clip of large frames is never held at its
own size).

The rule (``BaseVideoProcessor._preprocess`` of transformers 5.24, torchvision backend): the shorter side becomes
``shortest_edge``, the longer ``int(shortest_edge * long / short)``; bilinear with antialiasing on uint8, as
``torchvision.transforms.v2.functional.resize`` does. The resize works on each frame alone, so frames resized one
by one as they decode equal the clip resized at once, and a frame already at the size is returned as it is.
"""
from __future__ import annotations

import torch


def resized_size(height: int, width: int, shortest_edge: int) -> tuple[int, int]:
    """(height, width) of a ``height`` x ``width`` frame once its shorter side is ``shortest_edge``."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest_edge * long / short)
    return (new_long, shortest_edge) if width <= height else (shortest_edge, new_long)


def resize_frames(x: torch.Tensor, shortest_edge: int) -> torch.Tensor:
    """uint8 [T, 3, H, W] -> uint8 [T, 3, H', W'], the shorter side ``shortest_edge`` (the processors' resize)."""
    from torchvision.transforms.v2 import functional as tvf

    size = list(resized_size(int(x.shape[-2]), int(x.shape[-1]), shortest_edge))
    return tvf.resize(x, size, interpolation=tvf.InterpolationMode.BILINEAR, antialias=True)


__all__ = ["resize_frames", "resized_size"]
