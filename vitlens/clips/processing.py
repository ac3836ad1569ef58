"""Clips to a video model's ``pixel_values`` [B, T, C, H, W], as its transformers video processor makes them.

The rule (``BaseVideoProcessor._preprocess`` of transformers 5.24, torchvision backend), per clip: sample
``num_frames`` frames (``clips.clip.sample_indices``); resize every frame so its shorter side is ``shortest_edge``
(the longer ``int(shortest_edge * long / short)``; bilinear with antialiasing, on uint8, as
``torchvision.transforms.v2.functional.resize`` does); centre-crop to ``crop`` (top ``int((H - h) / 2)``, left
likewise); then rescale and normalise in float32: ``(x * rescale - offset - mean) / std``, which the processors
compute fused as ``(x - mean / rescale) / (std / rescale)`` when the offset is 0 (VideoMAE, TimeSformer, V-JEPA
2) and unfused for ViViT (``x / 127.5 - 1``, then ``(. - 0.5) / 0.5``). ``VideoProcessing.of(model)`` takes each
processor class's defaults, as the model's family declares them (``families.hf_video``, the one source of them),
scaled to the model's image size; ``VideoProcessing.from_processor`` reads a loaded processor (a checkpoint's own
``preprocessor_config.json`` may differ from the class defaults: pass it then).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, cast

import numpy as np
import torch

from ..errors import InvalidParameterError, UnsupportedModelError
from ..families.common.hf import video_model_types, video_processor_defaults
from .clip import Clip
from .read import ClipSource, read_clip
from .resize import resize_frames


def _config(model: Any) -> tuple[Any, Any]:
    """The transformers config of a video model (or a ``LoadedModel`` of it, or the config itself) and its type's
    declared per-frame processor defaults (``families.hf_video``'s ``HF_TYPES``, the one source of them)."""
    if not isinstance(model, torch.nn.Module) and isinstance(getattr(model, "model", None), torch.nn.Module):
        model = model.model  # a LoadedModel's module
    config = getattr(model, "config", model)
    defaults = video_processor_defaults(getattr(config, "model_type", None))
    if defaults is None:
        raise UnsupportedModelError(f"No video processing is known for {type(model).__name__}; vitlens prepares "
                                    f"clips for the Hugging Face {', '.join(video_model_types())} models.")
    return config, defaults


@dataclass(frozen=True)
class VideoProcessing:
    """How a video model's processor turns frames into ``pixel_values``.

    Attributes:
        num_frames: frames per clip (the model's config).
        shortest_edge: the shorter side after resizing.
        crop: (height, width) of the centre crop.
        mean, std: per-channel statistics, applied after rescaling.
        rescale: the factor on 0..255 values.
        offset: subtracted after rescaling (ViViT: 1, so values start in [-1, 1]).
    """

    num_frames: int
    shortest_edge: int
    crop: tuple[int, int]
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float
    offset: float = 0.0

    @classmethod
    def of(cls, model: Any) -> "VideoProcessing":
        """The processor class's defaults for a Hugging Face VideoMAE, ViViT, TimeSformer or V-JEPA 2 model (or its
        config), with the crop at the model's image size and the resize in the class's ratio (ViViT and V-JEPA 2:
        ``int(crop * 256 / 224)``; the others: the crop)."""
        config, defaults = _config(model)
        # V-JEPA 2's config names them crop_size and frames_per_clip; the others image_size and num_frames
        side = getattr(config, "crop_size", None) or config.image_size
        side = int(side[0] if isinstance(side, (list, tuple)) else side)
        frames = getattr(config, "frames_per_clip", None) or config.num_frames
        # the crop is crop_pct of the shortest edge (exact for 224 / 256: 0.875 is a binary fraction)
        return cls(int(frames), int(side / defaults.crop_pct), (side, side), tuple(defaults.mean),
                   tuple(defaults.std), defaults.rescale, defaults.offset)

    @classmethod
    def from_processor(cls, processor: Any, num_frames: int) -> "VideoProcessing":
        """Read a loaded transformers video processor (its ``size`` must be a ``shortest_edge``)."""
        size, crop = processor.size, processor.crop_size
        shortest = size.get("shortest_edge") if hasattr(size, "get") else getattr(size, "shortest_edge", None)
        if not shortest or not processor.do_resize or not processor.do_center_crop:
            raise InvalidParameterError("vitlens follows processors that resize the shorter side and centre-crop; "
                                        f"this one has size={size}, do_center_crop={processor.do_center_crop}.")
        crop_hw = (crop["height"], crop["width"]) if hasattr(crop, "get") else (crop.height, crop.width)
        offset = 1.0 if type(processor).__name__.startswith("Vivit") else 0.0
        return cls(int(num_frames), int(shortest), (int(crop_hw[0]), int(crop_hw[1])), tuple(processor.image_mean),
                   tuple(processor.image_std), float(processor.rescale_factor), offset)

    def frames_to_pixels(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [T, H, W, 3] (already sampled) -> float32 [T, 3, crop_h, crop_w]."""
        from torchvision.transforms.v2 import functional as tvf

        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()
        x = resize_frames(x, self.shortest_edge)  # frames a reader resized as they decoded are returned as they are
        ch, cw = self.crop
        if ch > x.shape[-2] or cw > x.shape[-1]:
            raise InvalidParameterError(f"The crop {ch}x{cw} is larger than the resized frames "
                                        f"{x.shape[-2]}x{x.shape[-1]}; use a larger shortest_edge.")
        top, left = int((x.shape[-2] - ch) / 2.0), int((x.shape[-1] - cw) / 2.0)
        x = x[..., top:top + ch, left:left + cw]
        if self.offset:
            x = x.float() * self.rescale - self.offset
            return tvf.normalize(x, list(self.mean), list(self.std))
        mean = torch.tensor(self.mean) * (1.0 / self.rescale)
        std = torch.tensor(self.std) * (1.0 / self.rescale)
        return tvf.normalize(x.to(torch.float32), mean.tolist(), std.tolist())


def clip_pixel_values(clips: ClipSource | Sequence[ClipSource], model: Any,
                      processing: VideoProcessing | None = None) -> torch.Tensor:
    """One or more clips as the model's input ``pixel_values`` [B, T, C, H, W] (float32).

    Args:
        clips: a clip source (``read_clip``: a file, GIF, folder, ``Clip`` or array) or a list of them.
        model: the Hugging Face video model (or its config, or a ``LoadedModel`` of it); says ``num_frames``,
            the image size and which processor's statistics.
        processing: overrides the defaults (e.g. ``VideoProcessing.from_processor`` of the checkpoint's processor).

    Returns:
        float32 [B, num_frames, 3, crop_h, crop_w].

    Raises:
        ClipLoadError: a source that cannot be read or has fewer frames than the model takes.
        UnsupportedModelError: a model vitlens has no video processing for.
    """
    processing = processing or VideoProcessing.of(model)
    # a list or tuple holds sources; anything else is one source (read_clip refuses what is none)
    items: list[ClipSource] = list(clips) if isinstance(clips, (list, tuple)) else [cast(ClipSource, clips)]
    # a file's frames are sampled and resized as they decode (``read_clip``): never held at the file's size
    out = [processing.frames_to_pixels(read_clip(c, processing.num_frames, processing.shortest_edge).frames)
           for c in items]
    return torch.stack(out)


def sampled_clip(source: ClipSource, model: Any, processing: VideoProcessing | None = None) -> Clip:
    """The frames of ``source`` the model's processor takes, for showing and for ``clip_pixel_values``: a file's
    resized as they decode (``read_clip(source, num_frames, shortest_edge)``), a clip in memory as it is."""
    processing = processing or VideoProcessing.of(model)
    return read_clip(source, processing.num_frames, processing.shortest_edge)
