"""Image uploads (the app's image set, read as bytes): each file checked against the upload limit, decoded within the
decode bound (``vitlens.images.open_image``), upright and RGB, kept resized to a longest side, once per session (a
rerun decodes nothing), and what could not be read named with its reason."""
from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Iterable

from PIL import Image

from .errors import ImageLoadError
from .images import MAX_UPLOAD_MB, open_image, tiny_image_warning, to_rgb


def read_upload(name: str, data: bytes, max_bytes: int = MAX_UPLOAD_MB * 2**20) -> Image.Image:
    """An uploaded file as an RGB PIL image, refusing files over ``max_bytes``; errors name the file."""
    if len(data) > max_bytes:
        raise ImageLoadError(f"{name} is {len(data) / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.0f} MB. "
                             "Downscale it and upload again.")
    return to_rgb(open_image(io.BytesIO(data), name), what=name)

@dataclass
class Uploads:
    """Uploaded images after reading: the good ones (each file once), and a message per bad one.

    Attributes:
        images: RGB images, in upload order, duplicates (same bytes) dropped.
        names: their file names.
        key: a digest of the set, for caching results of these images.
        skipped: one message per file that could not be read.
        duplicates: names of files dropped because the same bytes came earlier.
    """

    images: list[Image.Image]
    names: list[str]
    key: str
    skipped: list[str]
    duplicates: list[str]
    tiny: list[str] = field(default_factory=list)  # ``tiny_image_warning`` of each image below TINY_IMAGE_PX

def read_uploads(files: Iterable[tuple[str, bytes]], max_bytes: int = MAX_UPLOAD_MB * 2**20,
                 max_side_px: int | None = None, memo: dict[str, Image.Image | str] | None = None) -> Uploads:
    """Read ``(name, bytes)`` uploads: same bytes twice count once; unreadable files become messages.

    Args:
        max_side_px: resize (aspect kept) an image whose longer side is above this, once, when read.
        memo: {digest: decoded image or error message} kept between calls (the app's session): a file read
            before is not decoded again; entries of files no longer uploaded are dropped from it.
    """
    import hashlib

    images, names, digests, skipped, duplicates, tiny = [], [], [], [], [], []
    seen = list(files)
    for name, data in seen:
        digest = hashlib.sha256(data).hexdigest()[:12]
        if digest in digests:
            duplicates.append(name)
            continue
        known = memo.get(digest) if memo is not None else None
        if known is None:
            try:
                known = read_upload(name, data, max_bytes)
                if max_side_px and max(known.size) > max_side_px:
                    known = known.copy()
                    known.thumbnail((max_side_px, max_side_px), Image.Resampling.LANCZOS)
            except ImageLoadError as e:
                known = str(e)
            if memo is not None:
                memo[digest] = known
        if isinstance(known, str):
            skipped.append(known)
            continue
        images.append(known)
        names.append(name)
        digests.append(digest)
        if tiny_image_warning(name, known.size):
            tiny.append(tiny_image_warning(name, known.size))
    if memo is not None:
        current = {hashlib.sha256(data).hexdigest()[:12] for _name, data in seen}
        for stale in [d for d in memo if d not in current]:
            del memo[stale]
    return Uploads(images=images, names=names, key="upload-" + "-".join(digests), skipped=skipped,
                   duplicates=duplicates, tiny=tiny)


__all__ = ["Uploads", "read_upload", "read_uploads"]
