"""Counts and lists in words, as every message, caption and page writes them (no "1 images", no "(s)"), and text
made safe for a terminal (``printable``)."""
from __future__ import annotations

import unicodedata
from typing import Sequence


def printable(text: str, newlines: bool = False) -> str:
    """``text`` with every control, format (the bidirectional overrides among them: U+202E), private-use, surrogate
    or unassigned character written as its escape (``\\x1b``, ``\\u202e``), so that a model name or a file name
    prints as what it is and never moves the cursor, recolours the terminal or reverses the line. Tabs are kept,
    and newlines where ``newlines`` (a message of several lines)."""
    keep = "\t\n" if newlines else "\t"
    return "".join(c if c in keep or not unicodedata.category(c).startswith("C")
                   else c.encode("unicode_escape").decode("ascii") for c in text)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """"1 image", "2 images" (``plural`` for irregular nouns)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def listed_some(items: Sequence[str], most: int) -> str:
    """The first ``most`` items joined by commas, with "…" when some are left out (the count says how many)."""
    shown = ", ".join(items[:most])
    return shown + (f", … ({len(items) - most} more)" if len(items) > most else "")


def signed(x: float, digits: int = 2) -> str:
    """``x`` with a typographic minus ("−0.73"), so a negative value never reads as a dash."""
    text = f"{x:.{digits}f}"
    return "\u2212" + text[1:] if text.startswith("-") else text


def value_range(low: float, high: float, digits: int = 2) -> str:
    """"−0.73 to −0.02": a range in words, never "-0.73--0.02"; one value when both ends round alike."""
    a, b = signed(low, digits), signed(high, digits)
    return a if a == b else f"{a} to {b}"


__all__ = ["counted", "listed_some", "signed", "value_range"]


def class_label(names: Sequence[str], k: int) -> str:
    """Class ``k`` in words: its name where the model names its classes ("ring"), else "class k"."""
    return str(names[k]) if 0 <= k < len(names) else f"class {k}"


def class_names_of(model: object) -> list[str]:
    """A ``LoadedModel``'s class names ([] for a bare module or a model without names)."""
    names = getattr(model, "label_names", None)
    return list(names() or []) if callable(names) else []
