"""Static figure files: one export path for the app's "Figure" downloads and the command line's ``--png``.

A figure is exported with Plotly's own ``"plotly"`` template whatever the running process's default is.
That matters in the app: importing Streamlit sets ``plotly.io.templates.default`` to its ``"streamlit"``
template, whose colours are placeholders for the browser to replace and whose axes have no automargin,
so a figure rendered there by kaleido clips its tick labels and puts the axis titles on them.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable

import plotly.graph_objects as go
import plotly.io as pio

#: the template of every exported figure (what ``vitlens report --png`` has always rendered with)
EXPORT_TEMPLATE = "plotly"
#: the width of every exported PNG in pixels (its height is the figure's own), and its scale
PNG_WIDTH = 1000
PNG_SCALE = 1
#: seconds one PNG may take (the browser's start, the render, its close) before the export is abandoned and started
#: again with a new browser: kaleido can wait forever on a Chromium that never answers (rare; plotly/Kaleido#441,
#: seen here once while two test processes exported at once)
PNG_TIMEOUT_S = 120.0
#: how many times a PNG is tried before ``PngExportTimeout``
PNG_ATTEMPTS = 2
#: seconds given to an abandoned export to close its browser before it is left behind
CLOSE_GRACE_S = 15.0


class PngExportTimeout(RuntimeError):
    """kaleido gave no PNG within ``PNG_TIMEOUT_S`` in any of ``PNG_ATTEMPTS`` tries."""


def export_figure(fig: Any) -> go.Figure:
    """A copy of ``fig`` with the export template set (the figure passed in is left as it is)."""
    out = go.Figure(fig)
    out.update_layout(template=pio.templates[EXPORT_TEMPLATE])
    return out


def _within(make: Callable[[], Any], timeout_s: float) -> Any:
    """``asyncio.run`` of the coroutine ``make()`` in a thread of its own (as kaleido's blocking calls do, so a
    caller's running event loop, Jupyter's, is no obstacle), cancelled after ``timeout_s`` (its browser is then
    closed by kaleido's own exit path). TimeoutError when it did not finish; the thread is a daemon, so one that
    does not even close within ``CLOSE_GRACE_S`` never holds the interpreter's exit."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = asyncio.run(asyncio.wait_for(make(), timeout_s))
        except BaseException as e:  # noqa: BLE001 — handed to the caller's thread
            box["error"] = e

    worker = threading.Thread(target=run, name="vitlens-png-export", daemon=True)
    worker.start()
    worker.join(timeout_s + CLOSE_GRACE_S)
    if worker.is_alive():
        raise TimeoutError(f"no PNG within {timeout_s:g} s, and the export did not close")
    if "error" in box:
        raise box["error"]
    return box["value"]


def figure_png(fig: Any, width: int = PNG_WIDTH, scale: float = PNG_SCALE, timeout_s: float = PNG_TIMEOUT_S,
               attempts: int = PNG_ATTEMPTS) -> bytes:
    """The figure as PNG bytes through kaleido (needs Chrome or Chromium), as plotly's ``to_image`` makes them
    (its defaults for the height, plotly.js, MathJax and topojson), each try bounded by ``timeout_s`` and tried
    ``attempts`` times with a new browser.

    Raises:
        PngExportTimeout: no try gave a PNG in time.
    """
    import kaleido

    out = export_figure(fig)
    d = pio.defaults
    kopts = {k: getattr(d, k) for k in ("plotlyjs", "mathjax", "headers") if getattr(d, k, None)}
    opts = {"format": "png", "width": width, "height": out.layout.height or d.default_height, "scale": scale}
    spec = out.to_dict()
    tries = max(1, attempts)
    for _ in range(tries):
        try:
            return _within(lambda: kaleido.calc_fig(spec, opts=dict(opts), topojson=d.topojson, kopts=dict(kopts)),
                           timeout_s)
        except TimeoutError:
            continue
    raise PngExportTimeout(f"kaleido gave no PNG within {timeout_s:g} s in {tries} tries (its browser "
                           "never answered; plotly/Kaleido#441). Try again; if it keeps happening, check that "
                           "Chromium starts: chromium --headless --no-sandbox --dump-dom about:blank")


def figure_html(fig: Any) -> bytes:
    """The figure as one self-contained HTML file (plotly.js inlined; opens without network)."""
    return export_figure(fig).to_html(include_plotlyjs=True, full_html=True).encode()
