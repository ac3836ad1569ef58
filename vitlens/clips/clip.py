"""The clip record every video input becomes, and the frame-sampling rule of the video models' processors.

Sampling (issue 50): transformers' video processors (``VideoMAEVideoProcessor``, ``VivitVideoProcessor``,
``TimesformerVideoProcessor``, ``VJEPA2VideoProcessor``) sample with ``BaseVideoProcessor.sample_frames``, whose
rule is ``video_utils.default_sample_indices_fn``: ``num_frames`` frames uniformly over the clip's ``total``
frames, frame ``i`` of the sample being source frame ``i * total // num_frames`` (integer floor), and a clip
with fewer than ``num_frames`` frames refused. vitlens follows that rule with ``num_frames`` from the model's
config (``num_frames``; V-JEPA 2's ``frames_per_clip``), so a clip of exactly ``num_frames`` frames is used as it
is, which is what the processors do by default (their ``do_sample_frames`` is off).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from ..errors import ClipLoadError, InvalidParameterError


def sample_indices(total: int, num_frames: int, what: str = "the clip") -> np.ndarray:
    """The source frames a model's processor samples: ``arange(num_frames) * total // num_frames``.

    Args:
        total: frames in the clip.
        num_frames: frames the model takes (its config's ``num_frames``).
        what: how to name the clip in an error.

    Returns:
        int64 [num_frames], increasing, within ``0 .. total - 1``.

    Raises:
        ClipLoadError: a clip with fewer frames than the model takes.
        InvalidParameterError: ``num_frames`` < 1.
    """
    if int(num_frames) < 1:
        raise InvalidParameterError(f"num_frames must be a positive integer; got {num_frames}.")
    if total < num_frames:
        raise ClipLoadError(f"{what} has {total} frame{'s' * (total != 1)}, fewer than the {num_frames} the model "
                            f"takes; pass a longer clip (or a model with num_frames <= {total}).")
    return np.arange(int(num_frames), dtype=np.int64) * int(total) // int(num_frames)


@dataclass(frozen=True, eq=False)
class Clip:
    """A video as vitlens reads it: RGB frames, their rate when known, where they came from.

    Attributes:
        frames: uint8 [T, H, W, 3] (a tensor given here is kept as a numpy array).
        fps: frames per second of the source when known (a video's average rate, a GIF's first frame's
            duration), else None (a folder of frames, an array).
        name: the source's name (file or folder name; "" for an array).
        indices: int64 [T], the source frame each frame is (0 .. T-1 for a clip read whole).
        source_frames: how many frames the source has.
    """

    frames: np.ndarray
    fps: float | None = None
    name: str = ""
    indices: np.ndarray | None = None
    source_frames: int | None = None

    def __post_init__(self) -> None:
        frames = self.frames
        if isinstance(frames, torch.Tensor):
            frames = frames.detach().cpu().numpy()
        frames = np.asarray(frames)
        if frames.ndim != 4 or frames.shape[-1] != 3 or min(frames.shape[:3]) < 1:
            raise InvalidParameterError(f"Clip frames must be [T, H, W, 3] with T, H, W >= 1; got shape "
                                        f"{tuple(frames.shape)}.")
        if frames.dtype != np.uint8:
            raise InvalidParameterError(f"Clip frames must be uint8 RGB; got {frames.dtype}. Scale to 0..255 first.")
        if self.fps is not None and not (np.isfinite(self.fps) and self.fps > 0):
            raise InvalidParameterError(f"Clip fps must be a positive number or None; got {self.fps}.")
        indices = np.arange(len(frames), dtype=np.int64) if self.indices is None else np.asarray(self.indices,
                                                                                                 np.int64)
        if indices.shape != (len(frames),):
            raise InvalidParameterError(f"Clip indices must be one per frame ({len(frames)}); got {indices.shape}.")
        object.__setattr__(self, "frames", frames)
        object.__setattr__(self, "indices", indices)
        object.__setattr__(self, "source_frames", int(self.source_frames or len(frames)))
        object.__setattr__(self, "fps", None if self.fps is None else float(self.fps))

    @property
    def num_frames(self) -> int:
        """T, the frames held."""
        return int(self.frames.shape[0])

    @property
    def size(self) -> tuple[int, int]:
        """(H, W) of every frame."""
        return int(self.frames.shape[1]), int(self.frames.shape[2])

    def times(self) -> np.ndarray | None:
        """Each frame's time in the source, seconds (``indices / fps``); None when the rate is unknown."""
        # __post_init__ always sets indices (0 .. T-1 when none were given)
        return None if self.fps is None else cast(np.ndarray, self.indices) / self.fps

    def sample(self, num_frames: int) -> "Clip":
        """The ``num_frames`` frames a model's processor takes from this clip (``sample_indices``)."""
        picked = sample_indices(self.num_frames, num_frames, self.name or "the clip")
        indices = cast(np.ndarray, self.indices)  # set by __post_init__
        return Clip(self.frames[picked], self.fps, self.name, indices[picked], self.source_frames)

    def __repr__(self) -> str:
        rate = f", {self.fps:g} fps" if self.fps else ""
        h, w = self.size
        return f"Clip({self.name or 'array'!r}: {self.num_frames} frames of {h}x{w}{rate})"
