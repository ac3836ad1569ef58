"""Reading a survey folder's files within bounds: ``lstat`` first, regular files only, the size checked against
the record (or a ceiling) before any byte is read (docs/security.md, "Result files and survey folders").

A survey folder may be anyone's (``vl.load_survey`` and the app's Survey page open any folder given): a FIFO in a
shard's place would hang the reader, a link to ``/dev/zero`` read until memory ran out, a sparse file of gigabytes
(no bytes on disk) be read whole before its size was compared with its record (issue 62, item 10). Every file of
the folder is therefore opened as one that is not followed through a link, not waited on, and re-checked after
opening (the file opened is the file checked).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


class RefusedFile(ValueError):
    """A survey file that is not read: not a regular file, larger than it may be, or another size than its record
    says. ``str()`` says which, in words."""


def file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in words ("a FIFO", "a symbolic link", ...)."""
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str | Path, limit: int, size: int | None = None) -> BinaryIO:
    """``path`` opened for reading once ``lstat`` says it is a regular file of at most ``limit`` bytes (and of
    exactly ``size``, when given); the open file is checked again (the same file, still regular, same size).

    Raises:
        FileNotFoundError: there is nothing at ``path``.
        RefusedFile: a link, FIFO, device, folder or socket; too large; another size than ``size``.
        OSError: it cannot be opened.
    """
    st = os.lstat(path)
    _check(st, limit, size)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise RefusedFile("was replaced while it was opened")
        _check(now, limit, size)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | Path, limit: int, size: int | None = None) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes (exactly ``size`` when given), read as
    ``open_regular`` opens it; never more than the size checked.

    Raises:
        FileNotFoundError, RefusedFile, OSError: as ``open_regular``; RefusedFile when it changed size meanwhile.
    """
    with open_regular(path, limit, size) as f:
        want = os.fstat(f.fileno()).st_size
        data = f.read(want + 1)
    if len(data) != want:
        raise RefusedFile(f"changed size while it was read ({len(data)} of {want} bytes)")
    return data


def _check(st: os.stat_result, limit: int, size: int | None) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise RefusedFile(f"is {file_kind(st.st_mode)}, not a regular file")
    if size is not None and st.st_size != size:
        kind = "truncated" if st.st_size < size else "longer than written"
        raise RefusedFile(f"{kind} ({st.st_size} of {size} bytes)")
    if st.st_size > limit:
        raise RefusedFile(f"holds {st.st_size:,} bytes, more than it may ({limit:,})")
