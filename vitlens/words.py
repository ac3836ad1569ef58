"""Counts and lists in words, as every message, caption and page writes them (no "1 images", no "(s)")."""
from __future__ import annotations

from typing import Sequence


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """"1 image", "2 images" (``plural`` for irregular nouns)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def listed_some(items: Sequence[str], most: int) -> str:
    """The first ``most`` items joined by commas, with "…" when some are left out (the count says how many)."""
    shown = ", ".join(items[:most])
    return shown + (f", … ({len(items) - most} more)" if len(items) > most else "")


__all__ = ["counted", "listed_some"]
