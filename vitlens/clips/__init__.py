"""Video inputs (issue 50): the ``Clip`` record, reading video files (PyAV), animated GIFs and folders of frames,
the frame sampling and preprocessing of the video models' processors, synthetic clips with known motion, and
writers for GIF and MP4."""
from .clip import Clip, sample_indices
from .processing import VideoProcessing, clip_pixel_values, sampled_clip
from .read import (CLIP_SUFFIXES, MAX_CLIP_BYTES, MAX_CLIP_DECODE_PIXELS, MAX_CLIP_FRAMES, MAX_CLIP_PIXELS,
                   VIDEO_SUFFIXES, read_clip)
from .synthetic import MovingShape, moving_shape_clip
from .write import write_gif, write_mp4

__all__ = ["Clip", "sample_indices", "VideoProcessing", "clip_pixel_values", "sampled_clip", "MAX_CLIP_BYTES",
           "MAX_CLIP_DECODE_PIXELS", "MAX_CLIP_FRAMES", "MAX_CLIP_PIXELS", "CLIP_SUFFIXES", "VIDEO_SUFFIXES",
           "read_clip", "MovingShape", "moving_shape_clip", "write_gif", "write_mp4"]
