"""Where a survey's images come from, cut into shards that any worker can read by itself.

A source is plain data (it travels in the manifest and to Ray workers): image files (a folder,
a glob; with ``per_class`` each file's parent folder is its class, as in ImageNet's
``val/<class>/*.JPEG``), clip files for video models (``clips_source``: videos and animated GIFs, a shard being a set
of clips), or held-out reference scenes (with labels and object masks), which a
worker regenerates from (seed, index) instead of receiving pixels.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import ClipLoadError, ImageLoadError, InvalidParameterError
from ..images import check_resized, find_image_files, to_rgb
from ..clips import CLIP_SUFFIXES, read_clip
from ..reference.shapes import CLASSES, HELD_OUT_SEED, generate



@dataclass(frozen=True)
class Shard:
    """Images ``start .. stop - 1`` of a source."""

    index: int
    start: int
    stop: int

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}"


@dataclass(frozen=True)
class ImageSource:
    """A survey's image set.

    Attributes:
        kind: "files", "clips" (video files and animated GIFs, each read as the worker's model reads it) or "shapes".
        description: what the user asked for (folder, glob, or the scenes' seed).
        files: the image files, sorted (kind "files").
        labels: each file's class index, -1 when unknown (kind "files").
        classes: class names, index = label.
        n: number of scenes (kind "shapes").
        seed: the scenes' stream (kind "shapes").
        stats: each file's (size in bytes, modification time in ns, sha256 or "") when the source was made
            (kind "files"): what tells a rerun that an image was replaced under its name. Not part of the
            fingerprint (the set is its files; a changed file recomputes only its shards).
    """

    kind: str
    description: str
    files: tuple[str, ...] = ()
    labels: tuple[int, ...] = ()
    classes: tuple[str, ...] = ()
    n: int = 0
    seed: int = 0
    stats: tuple[tuple[int, int, str], ...] = ()

    def __len__(self) -> int:
        return len(self.files) if self.lists_files else self.n

    @property
    def lists_files(self) -> bool:
        """Whether the source is a list of files (kind "files" or "clips"), not scenes regenerated from a seed."""
        return self.kind in ("files", "clips")

    @property
    def has_labels(self) -> bool:
        return bool(self.classes)

    def shards(self, size: int) -> list[Shard]:
        if size < 1:
            raise InvalidParameterError(f"shard_size must be >= 1; got {size}.")
        return [Shard(i, start, min(start + size, len(self))) for i, start in enumerate(range(0, len(self), size))]

    def fingerprint(self) -> str:
        """Identifies the image set (a rerun must use the same one to extend a survey)."""
        h = hashlib.sha256(repr((self.kind, self.files, self.labels, self.classes, self.n, self.seed)).encode())
        return h.hexdigest()[:16]

    def range_digest(self, start: int, stop: int) -> str | None:
        """A digest of the stats of images ``start .. stop - 1`` (None without stats)."""
        if not self.stats:
            return None
        return hashlib.sha256(repr([tuple(s) for s in self.stats[start:stop]]).encode()).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ImageSource":
        return cls(**{**d, "files": tuple(d.get("files", ())), "labels": tuple(d.get("labels", ())),
                      "classes": tuple(d.get("classes", ())),
                      "stats": tuple(tuple(x) for x in d.get("stats", ()))})

    def read(self, shard: Shard, read_clip_as: Callable[[str], Any] | None = None,
             data_config: dict[str, Any] | None = None
             ) -> tuple[list[Any], np.ndarray | None, np.ndarray | None, list[str]]:
        """(images, labels or None, masks or None, names of unreadable files) of one shard; a clips source's
        "images" are its clips, each as ``read_clip_as(path)`` makes it (a worker's: the model's input, so a clip
        holds no more than the model takes, ``spacetime.clip_reader``), by default ``vl.Clip`` of every frame. With
        the model's ``data_config``, an image its resize would make too large (``images.check_resized``) is skipped
        as an unreadable one is, instead of failing the shard when it is preprocessed."""
        if self.kind == "clips":
            read_one = read_clip_as or read_clip
            clips, skipped = [], []
            for i in range(shard.start, shard.stop):
                try:
                    clips.append(read_one(self.files[i]))
                except ClipLoadError:
                    skipped.append(os.path.basename(self.files[i]))
            return clips, None, None, skipped
        if self.kind == "shapes":
            data = generate(shard.stop - shard.start, seed=self.seed, start=shard.start)
            return list(data.images), data.labels, data.masks, []
        images, labels, skipped = [], [], []
        for i in range(shard.start, shard.stop):
            try:
                img = to_rgb(self.files[i])
                if data_config is not None:
                    check_resized(img.size, data_config, self.files[i])
                images.append(img)
            except ImageLoadError:
                skipped.append(os.path.basename(self.files[i]))
                continue
            labels.append(self.labels[i] if self.labels else -1)
        return images, (np.asarray(labels, dtype=np.int64) if self.has_labels else None), None, skipped


def file_stat(path: str, content_hash: bool = False) -> tuple[int, int, str]:
    """(size in bytes, modification time in ns, sha256 of the bytes or "") of one image file."""
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1, "")
    digest = ""
    if content_hash:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        digest = h.hexdigest()
    return (int(st.st_size), int(st.st_mtime_ns), digest)


def files_source(spec: str, per_class: bool = False, max_images: int | None = None,
                 hash_images: bool = False) -> ImageSource:
    """Image files named by a folder (searched recursively) or a glob pattern, sorted.

    Args:
        spec: a folder, a glob ("val/*/*.JPEG") or one file.
        per_class: each file's parent folder name is its class.
        max_images: keep the first N files (after sorting).
        hash_images: record each file's sha256 besides its size and modification time (reads every file).

    Returns:
        An ``ImageSource`` of the files (and their classes with ``per_class``).

    Raises:
        InvalidParameterError: nothing matches ``spec``, or the folder holds no images.
    """
    files = [str(f) for f in find_image_files(spec, recursive=True)]
    files = files[: max_images] if max_images else files
    classes: tuple[str, ...] = ()
    labels: tuple[int, ...] = ()
    if per_class:
        classes = tuple(sorted({Path(f).parent.name for f in files}))
        index = {c: i for i, c in enumerate(classes)}
        labels = tuple(index[Path(f).parent.name] for f in files)
    resolved = tuple(str(Path(f).resolve()) for f in files)
    return ImageSource(kind="files", description=spec, files=resolved, labels=labels, classes=classes,
                       stats=tuple(file_stat(f, hash_images) for f in resolved))


def shapes_source(n: int, seed: int | None = None) -> ImageSource:
    """The first ``n`` held-out reference scenes (labels and object masks included).

    Args:
        n: number of scenes.
        seed: the scenes' stream seed (default ``HELD_OUT_SEED``, which the embedded pair was not trained on).

    Returns:
        An ``ImageSource`` of the generated scenes.
    """
    seed = HELD_OUT_SEED if seed is None else seed
    return ImageSource(kind="shapes", description=f"vitlens shapes scenes (seed {seed}, first {n})",
                       classes=tuple(CLASSES), n=int(n), seed=int(seed))


def clips_source(spec: str, max_clips: int | None = None, hash_clips: bool = False) -> ImageSource:
    """The video files and animated GIFs in a folder (searched recursively), sorted: a survey of video models'
    space-time statistics, a shard being a set of clips.

    Args:
        spec: a folder.
        max_clips: keep the first N clips (after sorting).
        hash_clips: record each file's sha256 besides its size and modification time.

    Returns:
        An ``ImageSource`` of kind "clips".

    Raises:
        InvalidParameterError: not a folder, or no clip in it.
    """
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise InvalidParameterError(f"{spec} is not a folder; pass a folder of clips (videos or animated GIFs).")
    suffixes = set(CLIP_SUFFIXES)
    files = sorted(str(f.resolve()) for f in folder.rglob("*") if f.is_file() and f.suffix.lower() in suffixes)
    files = files[: max_clips] if max_clips else files
    if not files:
        raise InvalidParameterError(f"{spec} holds no clip ({', '.join(sorted(suffixes))}).")
    return ImageSource(kind="clips", description=spec, files=tuple(files),
                       stats=tuple(file_stat(f, hash_clips) for f in files))
