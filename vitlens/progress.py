"""One progress adapter for the library, the command line and the app.

Long computations take ``progress``: ``True`` for a tqdm bar (on stderr), a callable
``f(done, total)`` (the app drives a Streamlit bar with one), or ``None``/``False`` for silence.
"""
from __future__ import annotations

import sys
from typing import Callable, Union
from .words import printable

ProgressFn = Callable[[int, "int | None"], None]
ProgressArg = Union[bool, ProgressFn, None]


def time_left(elapsed_s: float, done: float, total: float) -> str:
    """The time left in words from the rate so far, as the app's progress bars write it.

    Args:
        elapsed_s: seconds spent on the ``done`` items.
        done: items finished (any unit: images, methods).
        total: items in all.

    Returns:
        "about 40 s left", "about 3 min left"; "" before the first item finishes (no rate yet) or when done.
    """
    if done <= 0 or total <= done:
        return ""
    left = elapsed_s / done * (total - done)
    return f"about {max(1, round(left))} s left" if left < 90 else f"about {round(left / 60)} min left"


class Progress:
    """Reports ``done`` of ``total`` to whatever ``progress`` asked for; a context manager."""

    def __init__(self, progress: ProgressArg, total: int | None, desc: str = "vitlens", unit: str = "img") -> None:
        self.total = total
        self._fn: ProgressFn | None = None
        self._bar = None
        if progress is True:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, leave=False)
        elif callable(progress):
            self._fn = progress

    def update(self, done: int) -> None:
        """``done`` items finished so far (not an increment)."""
        if self._bar is not None:
            self._bar.update(done - self._bar.n)
        elif self._fn is not None:
            self._fn(done, self.total)

    def describe(self, text: str) -> None:
        """Name the part being computed now (a tqdm bar's description; callables and silence get none)."""
        if self._bar is not None:
            self._bar.set_description(text)

    def drop(self, n: int) -> None:
        """``n`` items that will never finish (a failed model's shards) leave the total, so the bar still ends full."""
        if self.total is None or n <= 0:
            return
        self.total = max(0, self.total - n)
        if self._bar is not None:
            self._bar.total = self.total
            self._bar.refresh()

    def note(self, text: str) -> None:
        """A line for the person watching (beside a tqdm bar, on stderr); callables and silence get none."""
        if self._bar is not None:
            self._bar.write(printable(text), file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
