"""Clips run through a video transformer for the space-time views (issue 50; ``vitlens.views.spacetime``): the
clips checked against the model's clip layout, run batch by batch under side capture (the outputs untouched), each
map read as the capture hands it over.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..core.clip_layout import ClipLayout
from ..engine.capture import capture_attention
from ..errors import InvalidParameterError
from .spacetime import SpaceTimeAccumulator

if TYPE_CHECKING:
    from ..loading.model import LoadedModel


def check_clips(clips: Any, layout: ClipLayout, name: str) -> torch.Tensor:
    """The clips as a float tensor [B, frames, 3, H, W] (one clip [frames, 3, H, W] gets its batch axis), refused in
    one line when they are not preprocessed clips of the model's frames and size."""
    if not isinstance(clips, torch.Tensor) or clips.dim() not in (4, 5):
        shape = tuple(clips.shape) if isinstance(clips, torch.Tensor) else type(clips).__name__
        raise InvalidParameterError(
            f"{name} is a video model: pass preprocessed clips as a tensor [B, frames, 3, H, W] (or one clip "
            f"[frames, 3, H, W]); got {shape}.")
    x = clips if clips.dim() == 5 else clips[None]
    h, w = layout.grid[0] * layout.stride_px[0], layout.grid[1] * layout.stride_px[1]
    if tuple(x.shape[1:]) != (layout.frames, 3, h, w):
        raise InvalidParameterError(f"{name} reads clips of {layout.frames} frames of 3x{h}x{w}; got "
                                    f"{tuple(x.shape[1:])}: sample {layout.frames} frames at {h}x{w}.")
    return x.float()


def run_clips(m: LoadedModel, clips: Any, batch_size: int = 8, renormalize: bool = True,
              head_fusion: str = "mean") -> SpaceTimeAccumulator:
    """The clips run through the model once, batch by batch, under side capture (the outputs untouched), every
    batch's maps read by a ``SpaceTimeAccumulator``."""
    if batch_size < 1:
        raise InvalidParameterError(f"batch_size must be >= 1; got {batch_size}.")
    layout = m.family.clip_layout(m.model)
    x = check_clips(clips, layout, m.spec.name)
    acc = SpaceTimeAccumulator(layout, m.spec.num_layers, renormalize, head_fusion)
    step = clips_per_forward(layout, m.spec.num_heads, batch_size)
    with capture_attention(m, store=False, consumers=[acc.on_map], mode="side"), torch.no_grad():
        for start in range(0, len(x), step):
            m.forward(x[start:start + step].to(m.device))
            acc.end_batch()
    return acc


#: megabytes of one map's float32 probabilities allowed per forward (``clips_per_forward``)
MAP_BUDGET_MB = 512


def clips_per_forward(layout: ClipLayout, heads: int, batch_size: int) -> int:
    """Clips per forward: ``batch_size``, lowered so that one joint map [B, heads, N, N] of float32 stays within
    ``MAP_BUDGET_MB`` (a VideoMAE-base map is about 118 MB a clip), at least one."""
    per_clip = heads * layout.num_tokens ** 2 * 4
    return max(1, min(int(batch_size), (MAP_BUDGET_MB << 20) // per_clip))


def check_fps(fps: float | None) -> float | None:
    """A frame rate in frames per second (None: unknown), refused in one line unless positive."""
    if fps is not None and not (isinstance(fps, (int, float)) and fps > 0):
        raise InvalidParameterError(f"fps is the clip's frame rate in frames per second, > 0; got {fps!r}.")
    return None if fps is None else float(fps)



__all__ = ["MAP_BUDGET_MB", "check_clips", "check_fps", "clips_per_forward", "run_clips"]
