"""Reading clips: video files (PyAV, the optional ``av`` package), animated GIFs (Pillow) and folders of frames.

Safety, as ``vitlens.images`` reads images: a file over ``MAX_CLIP_BYTES`` is refused before it is opened; a frame
over ``images.MAX_DECODE_PIXELS`` is refused before its pixels are decoded; a source with more than
``MAX_CLIP_FRAMES`` frames is refused; only local files are opened, by the demuxers of ``VIDEO_DEMUXERS``
(``format_whitelist``: a playlist or a concat list naming other files or URLs is not opened) and the ``file``
protocol; symlinks in a folder of frames are not followed. Decoding runs FFmpeg's or Pillow's decoders on the
data; nothing in a file is ever executed or unpickled. Every refusal is one ``ClipLoadError`` line.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union

import numpy as np
import torch

from ..errors import ClipLoadError, ImageLoadError, InvalidParameterError
from ..images import MAX_DECODE_PIXELS, find_image_files, open_image, to_rgb
from .clip import Clip, sample_indices

#: video file extensions read with PyAV
VIDEO_SUFFIXES: tuple[str, ...] = (".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi")
#: every file suffix ``read_clip`` reads as one clip: the video files, then animated GIFs
CLIP_SUFFIXES: tuple[str, ...] = (*VIDEO_SUFFIXES, ".gif")
#: the FFmpeg demuxers a video file may be opened with (their short names)
VIDEO_DEMUXERS = "mov,matroska,avi"
#: the largest video or GIF file read, in bytes
MAX_CLIP_BYTES = 1 << 30
#: the most frames a source may have
MAX_CLIP_FRAMES = 20_000
#: the most pixels (T x H x W) a clip read whole keeps; sample with ``num_frames`` to read a longer one
MAX_CLIP_PIXELS = 400_000_000
ClipSource = Union[str, Path, Clip, np.ndarray, torch.Tensor]


def read_clip(source: ClipSource, num_frames: int | None = None) -> Clip:
    """A clip from a video file, an animated GIF, a folder of frames (sorted by name) or a [T, H, W, 3] array.

    Args:
        source: a path (``VIDEO_SUFFIXES``, ``.gif``, or a folder of images), a ``Clip``, or a uint8 array or
            tensor [T, H, W, 3].
        num_frames: keep only the frames a model's processor samples (``sample_indices``: ``num_frames``
            uniformly over the source's frames); None keeps every frame.

    Returns:
        A ``Clip``: ``frames`` [T, H, W, 3] uint8, ``fps`` when the source has a rate, ``name``, ``indices``
            (the source frames kept) and ``source_frames``.

    Raises:
        ClipLoadError: not a video, GIF or folder of frames; an empty folder; frames of different sizes; fewer
            frames than ``num_frames``; a file, frame or clip over the limits; no ``av`` for a video file.
    """
    if isinstance(source, Clip):
        return source if num_frames is None else source.sample(num_frames)
    if isinstance(source, (np.ndarray, torch.Tensor)):
        clip = Clip(source)
        return clip if num_frames is None else clip.sample(num_frames)
    if not isinstance(source, (str, Path)):
        raise InvalidParameterError(f"A clip is a video file, a GIF, a folder of frames or a [T, H, W, 3] uint8 "
                                    f"array; got {type(source).__name__}.")
    path = Path(source).expanduser()
    if path.is_dir():
        return _read_folder(path, num_frames)
    if not path.is_file():
        raise ClipLoadError(f"Clip not found: {path}. Pass a video file, a GIF or a folder of frames.")
    size = path.stat().st_size
    if size > MAX_CLIP_BYTES:
        raise ClipLoadError(f"{path.name}: file too large to read safely ({size:,} bytes, more than "
                            f"{MAX_CLIP_BYTES:,}); cut or downscale it first.")
    suffix = path.suffix.lower()
    if suffix == ".gif":
        return _read_gif(path, num_frames)
    if suffix in VIDEO_SUFFIXES:
        return _read_video(path, num_frames)
    raise ClipLoadError(f"{path.name}: not a clip vitlens reads (a {suffix or 'suffix-less'} file); pass a video "
                        f"({', '.join(VIDEO_SUFFIXES)}), a .gif or a folder of frames.")


def _wanted(total: int, num_frames: int | None, what: str) -> np.ndarray:
    if total < 1:
        raise ClipLoadError(f"{what} holds no frames; pass a clip with at least one frame.")
    if total > MAX_CLIP_FRAMES:
        raise ClipLoadError(f"{what}: too many frames to read safely ({total:,}, more than {MAX_CLIP_FRAMES:,}); "
                            "cut it first.")
    return np.arange(total, dtype=np.int64) if num_frames is None else sample_indices(total, num_frames, what)


def _check_frame(w: int, h: int, kept: int, what: str) -> None:
    if w * h > MAX_DECODE_PIXELS:
        raise ClipLoadError(f"{what}: frames too large to read safely ({w} x {h} pixels, more than "
                            f"{MAX_DECODE_PIXELS:,}); downscale it first.")
    if kept * w * h > MAX_CLIP_PIXELS:
        raise ClipLoadError(f"{what}: {kept} frames of {w} x {h} are more pixels than vitlens keeps "
                            f"({MAX_CLIP_PIXELS:,}); pass num_frames to sample fewer.")


def _stack(frames: list[np.ndarray], what: str) -> np.ndarray:
    shapes = sorted({f.shape for f in frames})
    if len(shapes) > 1:
        raise ClipLoadError(f"{what}: frames of different sizes ({shapes[0][1]}x{shapes[0][0]} and "
                            f"{shapes[-1][1]}x{shapes[-1][0]}); resize them to one size first.")
    return np.stack(frames)


def _read_folder(path: Path, num_frames: int | None) -> Clip:
    try:
        files = [p for p in find_image_files(str(path)) if not p.is_symlink()]
    except InvalidParameterError as e:
        raise ClipLoadError(f"{e.message} Pass a folder of frames (one image per frame, sorted by name).") from e
    what = f"the folder {path.name}"
    wanted = _wanted(len(files), num_frames, what)
    frames = []
    for i in wanted:
        try:
            img = to_rgb(open_image(files[i], files[i].name), files[i].name)
        except ImageLoadError as e:
            raise ClipLoadError(f"{what}: {e.message}") from e
        _check_frame(img.width, img.height, len(wanted), what)
        frames.append(np.asarray(img, dtype=np.uint8))
    return Clip(_stack(frames, what), None, path.name, wanted, len(files))


def _read_gif(path: Path, num_frames: int | None) -> Clip:
    from PIL import Image, ImageSequence

    what = path.name
    try:
        with Image.open(path) as gif:
            if gif.format != "GIF":
                raise ClipLoadError(f"{what}: not a GIF (its data is {gif.format}); pass an animated GIF.")
            total = int(getattr(gif, "n_frames", 1))
            wanted = _wanted(total, num_frames, what)
            _check_frame(gif.width, gif.height, len(wanted), what)
            keep, durations, frames = set(wanted.tolist()), [], []
            for i, frame in enumerate(ImageSequence.Iterator(gif)):
                durations.append(frame.info.get("duration") or 0)  # every frame's: the rate is their mean
                if i in keep:  # transparency onto white, as images
                    frames.append(np.asarray(to_rgb(frame.copy(), what), dtype=np.uint8))
    except ClipLoadError:
        raise
    except ImageLoadError as e:
        raise ClipLoadError(f"{what}: {e.message}") from e
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ClipLoadError(f"Cannot read {what} as a GIF ({e}); pass an animated GIF.") from e
    # the mean frame time: a GIF's durations are whole centiseconds, so a rate like 8 fps alternates 120 and 130 ms
    fps = 1000.0 * len(durations) / sum(durations) if sum(durations) > 0 else None
    return Clip(_stack(frames, what), fps, path.name, wanted, total)


def _read_video(path: Path, num_frames: int | None) -> Clip:
    try:
        import av
    except ImportError as e:
        raise ClipLoadError(f"{path.name}: reading video files needs PyAV; pip install 'vitlens[video]' "
                            "(or pass an animated GIF or a folder of frames).") from e
    what = path.name
    options = {"format_whitelist": VIDEO_DEMUXERS, "protocol_whitelist": "file"}
    try:
        with av.open(os.fspath(path), options=options) as container:
            if not container.streams.video:
                raise ClipLoadError(f"{what} holds no video stream; pass a video file.")
            stream = container.streams.video[0]
            _check_frame(stream.codec_context.width, stream.codec_context.height, 1, what)
            total = int(stream.frames) or sum(1 for p in container.demux(stream) if p.size)
            wanted = _wanted(total, num_frames, what)
            _check_frame(stream.codec_context.width, stream.codec_context.height, len(wanted), what)
            rate = float(stream.average_rate) if stream.average_rate else None
            container.seek(0)
            keep = set(wanted.tolist())
            frames = []
            for i, frame in enumerate(container.decode(stream)):
                if i >= total:
                    break
                _check_frame(frame.width, frame.height, len(wanted), what)  # a stream may change size mid-way
                if i in keep:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except ClipLoadError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise ClipLoadError(f"Cannot read {what} as a video ({e}); pass a video file "
                            f"({', '.join(VIDEO_SUFFIXES)}).") from e
    if len(frames) < len(wanted):  # the container said more frames than it decodes to
        raise ClipLoadError(f"{what}: the container lists {total} frames but {len(frames)} of the sampled ones "
                            "decode; re-encode it (e.g. ffmpeg -i in.mp4 out.mp4).")
    return Clip(_stack(frames, what), rate, path.name, wanted, total)
