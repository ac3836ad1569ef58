"""Reading clips: video files (PyAV, the optional ``av`` package), animated GIFs (Pillow) and folders of frames.

Safety, as ``vitlens.images`` reads images: a file over ``MAX_CLIP_BYTES`` is refused before it is opened; a frame
over ``images.MAX_DECODE_PIXELS`` is refused before its pixels are decoded (a GIF's canvas, which a later frame may
grow, is checked before every frame); a source with more than ``MAX_CLIP_FRAMES`` frames is refused; only local
files are opened, by the demuxers of ``VIDEO_DEMUXERS`` (``format_whitelist``: a playlist or a concat list naming
other files or URLs is not opened) and the ``file`` protocol; symlinks in a folder of frames are not followed.
Decoding runs FFmpeg's or Pillow's decoders on the data; nothing in a file is ever executed or unpickled. Every
refusal is one ``ClipLoadError`` line.

Bounds before the work (issue 62): only the frames kept are converted, each resized as it decodes when the reader is
given the model's ``shortest_edge``, into one array (never a list stacked after); the frames kept times their
pixels (after that resize) stay within ``MAX_CLIP_PIXELS``, a resized frame within ``MAX_DECODE_PIXELS``, and the
frames decoded to reach the last one kept (a video or a GIF decodes every frame before it) times their pixels
within ``MAX_CLIP_DECODE_PIXELS``, each checked before the decoding it bounds.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Union, cast

import numpy as np
import torch

from ..errors import ClipLoadError, ImageLoadError, InvalidParameterError
from ..images import MAX_DECODE_PIXELS, find_image_files, open_image, to_rgb
from .clip import Clip, sample_indices
from .gif import gif_frames
from .resize import resize_frames, resized_size

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
#: the most pixels (T x H x W, after the resize when reading resizes) a read keeps; sample with ``num_frames``
MAX_CLIP_PIXELS = 400_000_000
#: the most pixels a read decodes (frames decoded x H x W): a video or GIF decodes every frame up to the last one
#: kept, so a long clip of large frames is refused before it is decoded, however few frames a model samples
#: (19,999 frames of 4992 x 4992 in a 0.7 MB file were 24 minutes of decoding); ~10 s of decoding at most
MAX_CLIP_DECODE_PIXELS = 4_000_000_000
ClipSource = Union[str, Path, Clip, np.ndarray, torch.Tensor]


def read_clip(source: ClipSource, num_frames: int | None = None, shortest_edge: int | None = None) -> Clip:
    """A clip from a video file, an animated GIF, a folder of frames (sorted by name) or a [T, H, W, 3] array.

    Args:
        source: a path (``VIDEO_SUFFIXES``, ``.gif``, or a folder of images), a ``Clip``, or a uint8 array or
            tensor [T, H, W, 3].
        num_frames: keep only the frames a model's processor samples (``sample_indices``: ``num_frames``
            uniformly over the source's frames); None keeps every frame.
        shortest_edge: resize each frame of a file as it decodes so its shorter side is this (the video processors'
            resize, ``clips.resize``), so a clip of large frames is never held at its own size; None keeps the
            source's size (frames given in memory are never resized here).

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
        clip = Clip(cast(np.ndarray, source))  # Clip.__post_init__ turns a tensor into an array
        return clip if num_frames is None else clip.sample(num_frames)
    if not isinstance(source, (str, Path)):
        raise InvalidParameterError(f"A clip is a video file, a GIF, a folder of frames or a [T, H, W, 3] uint8 "
                                    f"array; got {type(source).__name__}.")
    if shortest_edge is not None and int(shortest_edge) < 1:
        raise InvalidParameterError(f"shortest_edge must be a positive integer; got {shortest_edge}.")
    path = Path(source).expanduser()
    if path.is_dir():
        return _read_folder(path, num_frames, shortest_edge)
    if not path.is_file():
        raise ClipLoadError(f"Clip not found: {path}. Pass a video file, a GIF or a folder of frames.")
    size = path.stat().st_size
    if size > MAX_CLIP_BYTES:
        raise ClipLoadError(f"{path.name}: file too large to read safely ({size:,} bytes, more than "
                            f"{MAX_CLIP_BYTES:,}); cut or downscale it first.")
    suffix = path.suffix.lower()
    if suffix == ".gif":
        return _read_gif(path, num_frames, shortest_edge)
    if suffix in VIDEO_SUFFIXES:
        return _read_video(path, num_frames, shortest_edge)
    raise ClipLoadError(f"{path.name}: not a clip vitlens reads (a {suffix or 'suffix-less'} file); pass a video "
                        f"({', '.join(VIDEO_SUFFIXES)}), a .gif or a folder of frames.")


def _wanted(total: int, num_frames: int | None, what: str) -> np.ndarray:
    if total < 1:
        raise ClipLoadError(f"{what} holds no frames; pass a clip with at least one frame.")
    if total > MAX_CLIP_FRAMES:
        raise ClipLoadError(f"{what}: too many frames to read safely ({total:,}, more than {MAX_CLIP_FRAMES:,}); "
                            "cut it first.")
    return np.arange(total, dtype=np.int64) if num_frames is None else sample_indices(total, num_frames, what)


class _Kept:
    """The frames a read keeps, each resized (when asked) and written into one array as it decodes, with the checks
    that bound a read before each frame is decoded."""

    def __init__(self, wanted: np.ndarray, shortest_edge: int | None, what: str, sequential: bool) -> None:
        """``sequential``: the source decodes every frame up to the last one kept (a video, a GIF), not only those
        (a folder of frames)."""
        self.wanted, self.shortest_edge, self.what = wanted, shortest_edge, what
        self.slot = {int(i): k for k, i in enumerate(wanted)}
        self.decoded = int(wanted[-1]) + 1 if sequential else len(wanted)
        self.frames: np.ndarray | None = None
        self.source_size: tuple[int, int] | None = None

    def __contains__(self, index: int) -> bool:
        return index in self.slot

    @property
    def last(self) -> int:
        """The last source frame kept (a sequential read stops after it)."""
        return int(self.wanted[-1])

    def check(self, w: int, h: int) -> None:
        """Refuse, before a frame of ``w`` x ``h`` is decoded, a frame, a clip kept or a read over the limits."""
        what = self.what
        if w * h > MAX_DECODE_PIXELS:
            raise ClipLoadError(f"{what}: frames too large to read safely ({w} x {h} pixels, more than "
                                f"{MAX_DECODE_PIXELS:,}); downscale it first.")
        held = w * h
        if self.shortest_edge is not None:
            rh, rw = resized_size(h, w, self.shortest_edge)
            held = rh * rw
            if held > MAX_DECODE_PIXELS:
                raise ClipLoadError(f"{what}: frames of {w} x {h} are too elongated to read safely (the model's "
                                    f"resize makes them {rw} x {rh}, more than {MAX_DECODE_PIXELS:,} pixels); crop "
                                    "them nearer to square first.")
        if len(self.wanted) * held > MAX_CLIP_PIXELS:
            raise ClipLoadError(f"{what}: {len(self.wanted)} frames of {w} x {h} are more pixels than vitlens keeps "
                                f"({MAX_CLIP_PIXELS:,}); pass num_frames to sample fewer.")
        if self.decoded * w * h > MAX_CLIP_DECODE_PIXELS:
            raise ClipLoadError(f"{what}: reading it decodes {self.decoded:,} frames of {w} x {h}, more pixels than "
                                f"vitlens decodes for one clip ({MAX_CLIP_DECODE_PIXELS:,}); cut or downscale it "
                                "first.")

    def add(self, index: int, frame: np.ndarray) -> None:
        """Keep source frame ``index`` (uint8 [H, W, 3]), resized as the model's processor resizes."""
        size = (int(frame.shape[1]), int(frame.shape[0]))
        if self.source_size is not None and size != self.source_size:
            a, b = sorted([self.source_size, size])
            raise ClipLoadError(f"{self.what}: frames of different sizes ({a[0]}x{a[1]} and {b[0]}x{b[1]}); resize "
                                "them to one size first.")
        self.source_size = size
        if self.shortest_edge is not None:
            # [1, 3, H, W] as a view of the frame (channels last: what the uint8 resize works on, no copy)
            x = torch.from_numpy(frame if frame.flags.writeable else frame.copy()).permute(2, 0, 1)[None]
            frame = resize_frames(x, self.shortest_edge)[0].permute(1, 2, 0).numpy()
        if self.frames is None:
            self.frames = np.empty((len(self.wanted), *frame.shape), dtype=np.uint8)
        self.frames[self.slot[index]] = frame

    def clip(self, fps: float | None, name: str, total: int) -> Clip:
        if self.frames is None:
            raise ClipLoadError(f"{self.what}: no frame could be read; check that the source holds frames.")
        return Clip(self.frames, fps, name, self.wanted, total)


def _read_folder(path: Path, num_frames: int | None, shortest_edge: int | None) -> Clip:
    try:
        files = [p for p in find_image_files(str(path)) if not p.is_symlink()]
    except InvalidParameterError as e:
        raise ClipLoadError(f"{e.message} Pass a folder of frames (one image per frame, sorted by name).") from e
    what = f"the folder {path.name}"
    kept = _Kept(_wanted(len(files), num_frames, what), shortest_edge, what, sequential=False)
    for i in kept.wanted.tolist():
        try:
            img = to_rgb(open_image(files[i], files[i].name), files[i].name)
        except ImageLoadError as e:
            raise ClipLoadError(f"{what}: {e.message}") from e
        kept.check(img.width, img.height)
        kept.add(i, np.asarray(img, dtype=np.uint8))
    return kept.clip(None, path.name, len(files))


def _read_gif(path: Path, num_frames: int | None, shortest_edge: int | None) -> Clip:
    from PIL import Image

    what = path.name
    try:
        with Image.open(path) as gif:
            if gif.format != "GIF":
                raise ClipLoadError(f"{what}: not a GIF (its data is {gif.format}); pass an animated GIF.")
            total = int(getattr(gif, "n_frames", 1))
            kept = _Kept(_wanted(total, num_frames, what), shortest_edge, what, sequential=True)
            # Pillow allocates a grown canvas (and the frame's disposal area) when it seeks to the frame: every
            # canvas up to the last frame kept is checked from the blocks first, before any frame decodes
            frames = gif_frames(path, what)
            canvases = [(w, h) for w, h, _ in frames[:kept.last + 1]] or [gif.size]
            kept.check(max(c[0] for c in canvases), max(c[1] for c in canvases))
            durations = [d for _, _, d in frames]  # every frame's, from its blocks: the rate is their mean
            for i in range(kept.last + 1):
                if i:
                    gif.seek(i)  # decodes frame i - 1 (checked at its size) and reads frame i's header only
                kept.check(gif.width, gif.height)  # a later frame may grow the canvas: checked before it decodes
                if i in kept:
                    kept.add(i, np.asarray(to_rgb(gif.copy(), what), dtype=np.uint8))  # transparency onto white
    except ClipLoadError:
        raise
    except ImageLoadError as e:
        raise ClipLoadError(f"{what}: {e.message}") from e
    except (OSError, SyntaxError, ValueError, EOFError, Image.DecompressionBombError) as e:
        raise ClipLoadError(f"Cannot read {what} as a GIF ({e}); pass an animated GIF.") from e
    # the mean frame time: a GIF's delays are whole centiseconds, so a rate like 8 fps alternates 120 and 130 ms
    fps = 1000.0 * len(durations) / sum(durations) if sum(durations) > 0 else None
    return kept.clip(fps, path.name, total)


def _read_video(path: Path, num_frames: int | None, shortest_edge: int | None) -> Clip:
    try:
        import av
    except ImportError as e:
        raise ClipLoadError(f"{path.name}: reading video files needs PyAV; pip install 'vitlens[video]' "
                            "(or pass an animated GIF or a folder of frames).") from e
    what = path.name
    options = {"format_whitelist": VIDEO_DEMUXERS, "protocol_whitelist": "file"}
    got = 0
    try:
        with av.open(os.fspath(path), options=options) as container:
            if not container.streams.video:
                raise ClipLoadError(f"{what} holds no video stream; pass a video file.")
            stream = container.streams.video[0]
            w, h = stream.codec_context.width, stream.codec_context.height
            if w * h > MAX_DECODE_PIXELS:
                raise ClipLoadError(f"{what}: frames too large to read safely ({w} x {h} pixels, more than "
                                    f"{MAX_DECODE_PIXELS:,}); downscale it first.")
            total = int(stream.frames) or sum(1 for p in container.demux(stream) if p.size)
            kept = _Kept(_wanted(total, num_frames, what), shortest_edge, what, sequential=True)
            kept.check(w, h)
            rate = float(stream.average_rate) if stream.average_rate else None
            container.seek(0)
            for i, frame in enumerate(container.decode(stream)):
                if i > kept.last:
                    break
                kept.check(frame.width, frame.height)  # a stream may change size mid-way: before it is converted
                if i in kept:
                    kept.add(i, frame.to_ndarray(format="rgb24"))
                    got += 1
    except ClipLoadError:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise ClipLoadError(f"Cannot read {what} as a video ({e}); pass a video file "
                            f"({', '.join(VIDEO_SUFFIXES)}).") from e
    if got < len(kept.wanted):  # the container said more frames than it decodes to
        raise ClipLoadError(f"{what}: the container lists {total} frames but {got} of the sampled ones "
                            "decode; re-encode it (e.g. ffmpeg -i in.mp4 out.mp4).")
    return kept.clip(rate, path.name, total)
