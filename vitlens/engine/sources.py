"""What the engine runs through a model, by its kind: a batch source per kind of input (images, or a video model's
clips). ``stream_attention`` asks ``batch_source`` once and runs every batch it yields the same way, so the views of a
clip (the space-time distance and rollout, Fig. 7 right and Fig. 6 in space and time) and of an image ride the one
loop and the one capture plan; which source a model takes is its kind's record (``Kind.clips``), not a branch of the
caller's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from ..core.clip_layout import ClipLayout
from ..errors import InvalidParameterError
from ..images import Images, count_images, iter_batches
from ..kinds import kind_of
from ..loading.model import LoadedModel

#: megabytes of one map's float32 probabilities allowed per forward of clips (``clips_per_forward``)
MAP_BUDGET_MB = 512


@dataclass(frozen=True)
class BatchSource:
    """The inputs of one stream, batch by batch.

    Attributes:
        count: how many inputs (images or clips) it holds, when known without reading them (None otherwise).
        batches: (inputs per forward asked) -> a fresh iterator of model-ready batches of at most that many (a
            source may run fewer a forward: a clip source keeps each joint map within ``MAP_BUDGET_MB``).
        what: one input in words ("image", "clip").
    """

    count: int | None
    batches: Callable[[int], Iterator[torch.Tensor]]
    what: str = "image"


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


def image_source(m: LoadedModel, images: Images) -> BatchSource:
    """Images (a tensor, PIL images, paths, arrays or an iterable of tensors), preprocessed batch by batch with the
    model's data config (``vitlens.images.iter_batches``)."""
    return BatchSource(count_images(images), lambda size: iter_batches(images, m.data_config, size))


def clip_source(m: LoadedModel, clips: Any) -> BatchSource:
    """A video model's preprocessed clips [B, frames, 3, H, W], checked against its clip layout before any forward,
    at most ``clips_per_forward`` a forward."""
    if m.family.clip_layout is None:
        raise InvalidParameterError(f"{m.spec.name} is not a video model (its family {m.family.name} reads no clips); "
                                    "pass it images.")
    layout = m.family.clip_layout(m.model)
    x = check_clips(clips, layout, m.spec.name)

    def batches(size: int) -> Iterator[torch.Tensor]:
        if size < 1:
            raise InvalidParameterError(f"batch_size must be >= 1; got {size}.")
        step = clips_per_forward(layout, m.spec.num_heads, size)
        for start in range(0, len(x), step):
            yield x[start:start + step]

    return BatchSource(len(x), batches, "clip")


def batch_source(m: LoadedModel, inputs: Any) -> BatchSource:
    """The batch source of ``m``'s kind: clips for a kind that reads them (``Kind.clips``), images otherwise."""
    return clip_source(m, inputs) if kind_of(m).clips else image_source(m, inputs)


__all__ = ["BatchSource", "MAP_BUDGET_MB", "batch_source", "check_clips", "check_fps",
           "clip_source", "clips_per_forward", "image_source"]
