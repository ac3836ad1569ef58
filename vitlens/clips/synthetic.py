"""Synthetic clips with known motion: one shape of the reference scenes (``vitlens.reference.shapes``) moving in
time over a plain background, so tests and tutorials need no download (issue 50).

The shape's centre at frame t is ``start + t * velocity`` (pixels, (y, x)), from frame ``appear_at`` on; before
it the frame is background only. With a whole-pixel ``velocity`` and a shape inside the frame, frame t's mask is
frame ``appear_at``'s shifted by exactly ``(t - appear_at) * velocity`` pixels. The pixels hold two colours only
(background and shape; no noise), so a GIF keeps them exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InvalidParameterError
from ..reference.shapes import CLASSES, shape_mask
from .clip import Clip


@dataclass(frozen=True, eq=False)
class MovingShape:
    """A synthetic clip and what is known about it.

    Attributes:
        clip: the ``Clip`` (``name`` says the shape and its motion).
        masks: bool [T, H, W], True on the shape's pixels (all False before it appears).
        centres: float [T, 2], the shape's centre (y, x) in pixels at each frame; NaN before it appears.
        velocity: (dy, dx), pixels per frame.
        appear_at: the first frame the shape is in.
        shape: its class name (``reference.shapes.CLASSES``).
    """

    clip: Clip
    masks: np.ndarray
    centres: np.ndarray
    velocity: tuple[float, float]
    appear_at: int
    shape: str

    def __repr__(self) -> str:  # a line, not the masks' and centres' arrays
        return (f"MovingShape({self.shape} moving {self.velocity} px/frame from frame {self.appear_at}: "
                f"{self.clip!r})")


def moving_shape_clip(num_frames: int = 8, size: int = 32, shape: str = "square",
                      velocity: tuple[float, float] = (0.0, 2.0), start: tuple[float, float] | None = None,
                      radius: float | None = None, appear_at: int = 0, fps: float = 8.0,
                      seed: int = 0) -> MovingShape:
    """One shape moving at a constant velocity (and appearing at frame ``appear_at``) as a ``Clip``.

    Args:
        num_frames: T.
        size: frame side in pixels (square frames).
        shape: one of ``reference.shapes.CLASSES`` ("circle", "square", ...).
        velocity: (dy, dx) in pixels per frame.
        start: the centre (y, x) at frame ``appear_at``; default: the frame's centre moved back by half the path,
            so the path is centred.
        radius: circumradius in pixels (default: size / 6).
        appear_at: the first frame showing the shape (0: all of them).
        fps: the clip's frame rate.
        seed: picks the background and shape colours.

    Returns:
        A ``MovingShape``: the clip, its masks and centres.

    Raises:
        InvalidParameterError: an unknown shape, ``num_frames`` or ``size`` < 1, ``appear_at`` outside the clip.
    """
    if shape not in CLASSES:
        raise InvalidParameterError(f"shape must be one of {', '.join(CLASSES)}; got {shape!r}.")
    if num_frames < 1 or size < 1:
        raise InvalidParameterError(f"num_frames and size must be >= 1; got {num_frames} and {size}.")
    if not 0 <= appear_at < num_frames:
        raise InvalidParameterError(f"appear_at must be a frame of the clip, 0 .. {num_frames - 1}; got {appear_at}.")
    rng = np.random.default_rng([seed, 50])
    background = np.round(rng.uniform(0.05, 0.4, size=3) * 255).astype(np.uint8)
    colour = np.round(rng.uniform(0.6, 1.0, size=3) * 255).astype(np.uint8)
    vy, vx = float(velocity[0]), float(velocity[1])
    moving = num_frames - 1 - appear_at
    if start is None:
        start = (size / 2 - vy * moving / 2, size / 2 - vx * moving / 2)
    radius = size / 6 if radius is None else float(radius)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    frames = np.empty((num_frames, size, size, 3), np.uint8)
    frames[:] = background
    masks = np.zeros((num_frames, size, size), bool)
    centres = np.full((num_frames, 2), np.nan)
    label = CLASSES.index(shape)
    for t in range(appear_at, num_frames):
        cy, cx = start[0] + (t - appear_at) * vy, start[1] + (t - appear_at) * vx
        masks[t] = shape_mask(label, xx - cx, yy - cy, radius)
        frames[t][masks[t]] = colour
        centres[t] = (cy, cx)
    name = f"{shape} moving ({vy:g}, {vx:g}) px/frame" + (f", appearing at frame {appear_at}" if appear_at else "")
    return MovingShape(Clip(frames, fps, name), masks, centres, (vy, vx), appear_at, shape)
