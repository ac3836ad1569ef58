"""Every frame's canvas of a GIF, read from its block structure before any pixel is decoded (issue 62).

Pillow grows a GIF's canvas when a later frame's image descriptor reaches past it (to ``max(x0 + w, canvas_w)``,
``max(y0 + h, canvas_h)``), and allocates it, and each frame's disposal area, when it *seeks* to that frame, before
the frame's pixels decode: a 200-byte GIF whose 1 x 1 canvas grows to 13000 x 13000 took 5.2 GB. Walking the
blocks (GIF89a: the logical screen, then extensions, image descriptors with their LZW sub-blocks, the trailer) costs
no decoding, so every frame's canvas is known, and bounded, before the first one is decoded.
"""
from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

from ..errors import ClipLoadError


def _skip_sub_blocks(f: BinaryIO) -> None:
    """Past a chain of data sub-blocks (a length byte, that many bytes; a zero length or the end of the data ends
    it, as for Pillow)."""
    while True:
        n = f.read(1)
        if not n or n[0] == 0:
            return
        f.seek(n[0], 1)


def gif_canvases(path: Path, what: str) -> list[tuple[int, int]]:
    """(width, height) of the canvas as each frame of the GIF at ``path`` is shown, by Pillow's rule (a byte that
    starts no block is passed over, as Pillow passes it).

    Raises:
        ClipLoadError: not a GIF, or one that ends inside a frame's descriptor.
    """
    return [(w, h) for w, h, _ in gif_frames(path, what)]


def gif_durations(path: Path, what: str) -> list[int]:
    """Each frame's display time in milliseconds (its graphic control extension's delay; 0 where it has none), read
    from the blocks: the clip's rate is their mean (a GIF's delays are whole centiseconds, so 8 fps alternates 120 and
    130 ms).

    Raises:
        ClipLoadError: not a GIF, or one that ends inside a frame's descriptor.
    """
    return [d for _, _, d in gif_frames(path, what)]


def gif_frames(path: Path, what: str) -> list[tuple[int, int, int]]:
    """(canvas width, canvas height, display time in ms) of each frame, from the blocks alone (no pixel decoded).

    Raises:
        ClipLoadError: not a GIF, or one that ends inside a frame's descriptor.
    """
    with open(path, "rb") as f:
        head = f.read(13)
        if len(head) < 13 or head[:3] != b"GIF":
            raise ClipLoadError(f"{what}: not a GIF; pass an animated GIF.")
        w, h, flags = struct.unpack("<HHB", head[6:11])
        if flags & 0x80:
            f.seek(3 << ((flags & 7) + 1), 1)  # the global colour table
        frames: list[tuple[int, int, int]] = []
        delay = 0  # the next frame's, from a graphic control extension before it
        while True:
            kind = f.read(1)
            if not kind or kind == b";":  # Pillow ends a GIF at its trailer or at the end of the data
                return frames
            if kind == b"!":
                label = f.read(1)
                if label == b"\xf9":  # graphic control: a 4-byte block (flags, delay in centiseconds, transparency)
                    block = f.read(5)
                    if len(block) == 5 and block[0] >= 3:
                        delay = 10 * struct.unpack("<H", block[2:4])[0]
                        f.seek(block[0] - 4, 1)  # the rest of a block longer than 4 bytes
                    else:
                        f.seek(-len(block), 1)
                _skip_sub_blocks(f)
            elif kind == b",":
                desc = f.read(9)
                if len(desc) < 9:
                    raise ClipLoadError(f"Cannot read {what} as a GIF (it ends inside a frame); pass an animated "
                                        "GIF.")
                x0, y0, fw, fh, fflags = struct.unpack("<HHHHB", desc)
                w, h = max(w, x0 + fw), max(h, y0 + fh)
                frames.append((w, h, delay))
                delay = 0
                if fflags & 0x80:
                    f.seek(3 << ((fflags & 7) + 1), 1)  # the frame's local colour table
                f.seek(1, 1)  # the LZW minimum code size
                _skip_sub_blocks(f)


__all__ = ["gif_canvases", "gif_durations", "gif_frames"]
