"""Saving a clip: an animated GIF (Pillow) or an MP4 (PyAV, H.264 at constant quantiser 0 in 4:4:4, so the only
loss is the RGB -> YUV -> RGB rounding). Each file is encoded in memory and written whole
(``results.atomic_write_bytes``: a temporary file renamed into place), so a failed write leaves nothing half-written.

A GIF holds at most 256 colours per frame and Pillow merges identical consecutive frames into one (their
durations added): a clip with a still stretch reads back with fewer frames.
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import Callable

from ..errors import ClipLoadError
from ..results import atomic_write_bytes
from .clip import Clip


def _save(path: str | Path, write: Callable[[io.BytesIO], None]) -> Path:
    path = Path(path).expanduser()
    if not path.parent.is_dir():
        raise ClipLoadError(f"Cannot write {path}: its folder {path.parent} does not exist; create it first.")
    buf = io.BytesIO()
    write(buf)
    atomic_write_bytes(path, buf.getvalue())
    return path


def write_gif(clip: Clip, path: str | Path) -> Path:
    """Save ``clip`` as an animated GIF, looping, each frame shown ``1 / fps`` s (0.1 s when the rate is unknown).

    Args:
        clip: the clip (at most 256 colours per frame are kept exactly).
        path: the file to write; its folder must exist.

    Returns:
        The path written.

    Raises:
        ClipLoadError: the folder does not exist.
    """
    from PIL import Image

    images = [Image.fromarray(f, "RGB") for f in clip.frames]
    # a GIF keeps whole centiseconds (8 fps's 125 ms would be 120 ms: 8.33 fps): each frame starts at its own time
    # rounded to the centisecond, so the durations (120, 130, ...) add up to the clip's length at its rate
    per_frame = 100.0 / clip.fps if clip.fps else 10.0
    starts = [round(k * per_frame) for k in range(len(images) + 1)]
    duration = [10 * max(b - a, 1) for a, b in zip(starts, starts[1:])]

    def write(buf: io.BytesIO) -> None:
        images[0].save(buf, format="GIF", save_all=True, append_images=images[1:], duration=duration, loop=0)

    return _save(path, write)


def write_mp4(clip: Clip, path: str | Path) -> Path:
    """Save ``clip`` as an MP4 (H.264, yuv444p, qp 0) at its rate (8 fps when unknown) with PyAV.

    Args:
        clip: the clip.
        path: the file to write; its folder must exist.

    Returns:
        The path written.

    Raises:
        ClipLoadError: PyAV is not installed, or the folder does not exist.
    """
    try:
        import av
    except ImportError as e:
        raise ClipLoadError("Writing MP4 needs PyAV; pip install 'vitlens[video]' (or write a GIF).") from e
    from fractions import Fraction

    rate = Fraction(clip.fps or 8.0).limit_denominator(1001)

    def write(buf: io.BytesIO) -> None:
        with av.open(buf, "w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=rate)
            stream.height, stream.width = clip.size
            stream.pix_fmt = "yuv444p"
            stream.options = {"qp": "0"}
            for frame in clip.frames:
                for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)

    return _save(path, write)
