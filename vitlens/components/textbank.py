"""Texts for TextSpan (docs/definitions.md, "TextSpan"): the bank shipped with vitlens (a few hundred short
descriptions of shapes, colours, textures, places and objects, written for vitlens) and the user's own text file, one
description a line, read within bounds that hold before anything is read past them.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import InvalidParameterError

#: the bank shipped with vitlens (package data)
TEXT_BANK_PATH = Path(__file__).parent / "data" / "text_bank.txt"
#: a text file's bounds: its size, its lines and one line's length
MAX_FILE_BYTES = 4 * 1024 * 1024
MAX_TEXTS = 50_000
MAX_TEXT_CHARS = 300


def read_texts(path: str | os.PathLike) -> list[str]:
    """The descriptions of a UTF-8 text file, one a line (blank lines skipped, surrounding spaces stripped).

    Args:
        path: the file.

    Returns:
        The texts, in the file's order.

    Raises:
        InvalidParameterError: no such file, a folder, over ``MAX_FILE_BYTES``, not UTF-8, no text in it, more than
            ``MAX_TEXTS`` texts or a line over ``MAX_TEXT_CHARS`` characters (each naming the file and the bound).
    """
    p = Path(path)
    if not p.is_file():
        raise InvalidParameterError(f"texts file {str(p)!r} does not exist or is not a file: give a text file with one "
                                    "description a line, or a list of texts.")
    size = p.stat().st_size
    if size > MAX_FILE_BYTES:
        raise InvalidParameterError(f"texts file {str(p)!r} is {size} bytes; at most {MAX_FILE_BYTES} are read: split "
                                    "it or keep the descriptions you need.")
    with open(p, "rb") as f:
        raw = f.read(MAX_FILE_BYTES + 1)  # the size can grow after the check: never read past the bound
    if len(raw) > MAX_FILE_BYTES:
        raise InvalidParameterError(f"texts file {str(p)!r} is over {MAX_FILE_BYTES} bytes.")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InvalidParameterError(f"texts file {str(p)!r} is not UTF-8 text (byte {e.start}): save it as UTF-8, one "
                                    "description a line.") from None
    if "\x00" in text:
        raise InvalidParameterError(f"texts file {str(p)!r} holds NUL bytes: it is not a text file.")
    lines = [line.strip() for line in text.splitlines()]
    texts = [line for line in lines if line]
    if not texts:
        raise InvalidParameterError(f"texts file {str(p)!r} holds no text: write one description a line.")
    if len(texts) > MAX_TEXTS:
        raise InvalidParameterError(f"texts file {str(p)!r} holds {len(texts)} texts; at most {MAX_TEXTS} are read.")
    long = next((i for i, line in enumerate(lines) if len(line) > MAX_TEXT_CHARS), None)
    if long is not None:
        raise InvalidParameterError(f"texts file {str(p)!r}: line {long + 1} has {len(lines[long])} characters; a "
                                    f"description has at most {MAX_TEXT_CHARS}.")
    return texts


def text_bank() -> list[str]:
    """The descriptions shipped with vitlens (``TEXT_BANK_PATH``): shapes, colours, textures, places, objects, people,
    kinds of picture."""
    return read_texts(TEXT_BANK_PATH)


__all__ = ["MAX_FILE_BYTES", "MAX_TEXTS", "MAX_TEXT_CHARS", "TEXT_BANK_PATH", "read_texts", "text_bank"]
