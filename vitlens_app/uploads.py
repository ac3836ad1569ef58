"""Uploads to the app: checkpoints and clips kept where no one else can plant or read them, and the size images are
kept at.

Each app server gets one private folder (``tempfile.mkdtemp``: mode 0700, a fresh unpredictable name, never a
folder that was there before), removed when the server exits; each session gets its own folder inside it,
removed when the session ends (its ``UploadFolder`` is dropped) or the server exits. A file is created only
new (``O_EXCL | O_NOFOLLOW``, mode 0600), and every time it is handed out its bytes are checked against the
sha256 of what was uploaded: a file that differs is replaced, never trusted.
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path

from vitlens_app.library import CHECKPOINT_SUFFIXES, CLIP_SUFFIXES

#: the suffixes an upload keeps (anything else is saved without one): checkpoints (the loader's
#: ``CHECKPOINT_SUFFIXES``) and clips (a video model's clip is read by its suffix: ``vl.read_clip``'s ``CLIP_SUFFIXES``)
UPLOAD_SUFFIXES = (*CHECKPOINT_SUFFIXES, *CLIP_SUFFIXES)
#: the checkpoint uploader's file types: the loader's suffixes without their dots
CHECKPOINT_TYPES = tuple(suffix.lstrip(".") for suffix in CHECKPOINT_SUFFIXES)
#: The longest side, in pixels, of an uploaded image as the app keeps it (larger ones are resized to fit once,
#: when uploaded; every view resizes to the model's input anyway, 1024 px at most for the high-resolution runs).
APP_MAX_SIDE_PX = 2048
_SERVER: Path | None = None
_SERVER_LOCK = threading.Lock()


def server_folder() -> Path:
    """This process's private upload folder (0700), made on first use and removed at exit."""
    global _SERVER
    with _SERVER_LOCK:
        if _SERVER is None or not _SERVER.is_dir():
            _SERVER = Path(tempfile.mkdtemp(prefix="vitlens-uploads-"))
            atexit.register(shutil.rmtree, str(_SERVER), True)
        return _SERVER


class UploadFolder:
    """One session's uploaded checkpoints and clips: a private folder, removed when this object goes (session end)."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="session-", dir=server_folder()))
        self._finalizer = weakref.finalize(self, shutil.rmtree, str(self.path), True)

    def save(self, name: str, data: bytes) -> Path:
        """The path of a file holding exactly ``data`` (written now, or checked when it is already there).

        The name is the content's sha256 and the upload's suffix (``UPLOAD_SUFFIXES``); a file there whose bytes differ
        (or anything that is not a plain file) is removed and written again.
        """
        digest = hashlib.sha256(data).hexdigest()
        suffix = Path(name).suffix.lower()
        target = self.path / f"{digest[:32]}{suffix if suffix in UPLOAD_SUFFIXES else ''}"
        if not _holds(target, digest):
            if target.is_symlink() or target.exists():
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            if not _holds(target, digest):
                raise OSError(f"the uploaded file {name} changed on disk while it was saved; upload it again")
        return target

    def close(self) -> None:
        """Remove the folder now."""
        self._finalizer()


def _holds(path: Path, digest: str) -> bool:
    """True when ``path`` is a plain file (not a link) whose bytes have this sha256."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        if not os.path.stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return False
        h = hashlib.sha256()
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest() == digest
