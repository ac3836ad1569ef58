"""What every page is given (``Context``: the model, the image set, the current image; ``ClipContext``: a video model,
its clip and the frame shown) and the pieces every page draws the same way: the error message, downloads, whole
tables, the image count."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import streamlit as st

import vitlens as vl
from vitlens_app.library import browser_path, figure_html, figure_png

#: whether figures download as PNG: the browser kaleido would use, found as kaleido finds it, once per app process
PNG_EXPORT = browser_path() is not None


@dataclass
class Context:
    """What a view renders from: the model, the image set and the current image."""

    m: vl.LoadedModel
    mkey: str
    images: list
    names: list[str]
    ikey: str
    masks: np.ndarray | None
    labels: np.ndarray | None
    index: int
    shown: np.ndarray  # the current image as the model sees it, uint8 [H, W, 3]

    @property
    def current(self) -> Any:
        return self.images[self.index]

    @property
    def cur_key(self) -> str:
        return f"{self.ikey}-{self.index}"


@dataclass
class ClipContext:
    """What a space-time page renders from: the model, the clip as sampled, its pixel values and the frame shown."""

    m: vl.LoadedModel
    mkey: str
    clip: vl.Clip  # the frames the model's processor takes
    ckey: str
    x: Any  # float32 [1, frames, 3, H, W], the model's input
    shown: list[np.ndarray]  # each frame as the model sees it, uint8 [H, W, 3]
    frame: int  # the slider's frame (0-based)
    fps: float | None  # the sampled frames' rate (frames per second), None when the source has none


def show_error(e: Exception) -> None:
    """A message a person can act on; never a traceback."""
    if isinstance(e, vl.VitlensError):
        st.error(e.message_for("app"))
    else:
        st.error(f"Something went wrong ({type(e).__name__}: {e}). Try other settings; the app keeps working.")


def figure_download(where: Any, fig: Any, stem: str, label: str = "Figure") -> None:
    """A figure's download through the command line's export path (``vitlens.report.export``): PNG when
    Chromium is there for kaleido (the browser kaleido would use, found as kaleido finds it), self-contained HTML
    otherwise; made only when clicked."""
    if PNG_EXPORT:
        # the PNG is drawn only when clicked, by a browser kaleido starts: seconds with nothing on screen, so said
        where.download_button(f"{label} (PNG)", lambda: figure_png(fig), f"{stem}.png", "image/png",
                              key=f"png-{stem}", on_click="ignore",
                              help="Drawn by Chromium (kaleido) when clicked: the file comes after a few seconds.")
    else:
        where.download_button(f"{label} (HTML)", lambda: figure_html(fig), f"{stem}.html", "text/html",
                              key=f"html-{stem}", on_click="ignore")


def downloads(result: vl.Result, fig: Any, stem: str) -> None:
    """A result's numbers (CSV, JSON) and its figure, side by side."""
    cols = st.columns(3)
    cols[0].download_button("Numbers (CSV)", result.to_csv(), f"{stem}.csv", "text/csv", key=f"csv-{stem}",
                            on_click="ignore")
    cols[1].download_button("Numbers (JSON)", result.to_json().encode(), f"{stem}.json", "application/json",
                            key=f"json-{stem}", on_click="ignore")
    figure_download(cols[2], fig, stem)


#: more columns than this and a table's numbers take narrow columns (the Attributions table's time columns, the
#: sanity and survey tables were cut at the right edge)
WIDE_TABLE_COLUMNS = 7


def whole_table(frame: Any, name_column: str = "method") -> None:
    """A table shown whole: every row (no scroll box of ten) and its name column wide enough for the
    longest name ("integrated_gradients" was cut to "integrated_gradi…")."""
    longest = max((len(str(v)) for v in frame[name_column]), default=0) if name_column in frame else 0
    config: dict[str, Any] = {}
    if len(frame.columns) > WIDE_TABLE_COLUMNS:  # numbers in narrow columns, so the last ones are not off-screen
        config.update({c: st.column_config.NumberColumn(str(c), width="small", help=str(c)) for c in frame.columns
                       if c != name_column and str(frame[c].dtype).startswith(("float", "int"))})
    if longest:
        config[name_column] = st.column_config.TextColumn(name_column, width=max(80, 8 * longest + 24))
    st.dataframe(frame, hide_index=True, height="content", column_config=config or None)


def image_count(where: Any, available: int, key: str) -> int:
    """How many images to average over (a slider needs at least two choices)."""
    if available == 1:
        where.caption("1 image")
        return 1
    return int(where.slider("Images", 1, available, min(available, 32), key=key))
