"""Static figure files: one export path for the app's "Figure" downloads and the command line's ``--png``.

A figure is exported with Plotly's own ``"plotly"`` template whatever the running process's default is.
That matters in the app: importing Streamlit sets ``plotly.io.templates.default`` to its ``"streamlit"``
template, whose colours are placeholders for the browser to replace and whose axes have no automargin,
so a figure rendered there by kaleido clips its tick labels and puts the axis titles on them.
"""
from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any, Callable, Sequence

import plotly.graph_objects as go
import plotly.io as pio

from vitlens.errors import VitlensError

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


#: the command that installs the browser kaleido renders with (what scripts/install-chromium.sh runs)
INSTALL_BROWSER = "apt-get install chromium"


class PngExportTimeout(RuntimeError):
    """kaleido gave no PNG within ``PNG_TIMEOUT_S`` in any of ``PNG_ATTEMPTS`` tries."""


class BrowserNotFoundError(VitlensError, RuntimeError):
    """No Chrome or Chromium for kaleido to render PNGs with (kaleido's own advice, ``kaleido_get_chrome``,
    downloads one from the internet and is never passed on: it cannot work offline)."""


def browser_path() -> str | None:
    """The browser kaleido would render with, found the way kaleido finds it (choreographer's search): the
    ``BROWSER_PATH`` environment variable when it is set, else Chrome, Chromium, Edge, Brave or Vivaldi on
    ``PATH`` or at their usual places, else choreographer's own download. None when that is no file.

    Returns:
        The browser's path, or None when kaleido would find none.
    """
    try:
        from choreographer.browsers.chromium import Chromium
    except ImportError:  # a kaleido without choreographer: let it look for itself
        return None
    if os.environ.get("BROWSER_PATH"):
        path: str | None = os.environ["BROWSER_PATH"]
    else:
        path = Chromium.find_browser(skip_local=False)
    return str(path) if path and Path(path).is_file() else None


def browser_missing() -> BrowserNotFoundError:
    """The error for a machine where kaleido finds no browser, saying which one is looked for and how to install
    it, in each interface's words.

    Returns:
        The error (to raise).
    """
    where = os.environ.get("BROWSER_PATH")
    what = (f"no browser at BROWSER_PATH={where!r}" if where
            else "no Chrome or Chromium on this machine (looked on PATH and at /usr/bin/chromium)")
    install = f"install Chromium ({INSTALL_BROWSER}, or bash scripts/install-chromium.sh in a checkout)"
    return BrowserNotFoundError(
        f"PNG export renders figures with kaleido, which needs Chrome or Chromium: {what}.",
        fixes={"python": f"To fix: {install}, or set BROWSER_PATH to a Chrome/Chromium executable.",
               "cli": f"To fix: {install}, or leave out --png.",
               "app": f"To fix: {install} and restart the app; the HTML download needs no browser."})


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


async def _calc_figs(specs: list[dict], opts: list[dict], topojson: Any, kopts: dict) -> list[bytes]:
    """The PNGs of several figure dicts from one kaleido browser, one after the other (what ``kaleido.calc_fig``
    does for one figure, without a browser's start and close for each: seconds apiece)."""
    import kaleido

    async with kaleido.Kaleido(**{**kopts, "n": 1}) as k:
        return [await k.calc_fig(spec, opts=opt, topojson=topojson) for spec, opt in zip(specs, opts)]


def figures_png(figs: Sequence[Any], width: int = PNG_WIDTH, scale: float = PNG_SCALE,
                timeout_s: float = PNG_TIMEOUT_S, attempts: int = PNG_ATTEMPTS) -> list[bytes]:
    """The figures as PNG bytes through kaleido (needs Chrome or Chromium), one browser for them all, as plotly's
    ``to_image`` makes each (its defaults for the height, plotly.js, MathJax and topojson; byte for byte). Each try
    is bounded by ``timeout_s`` per figure and tried ``attempts`` times with a new browser.

    Args:
        figs: plotly figures (or their dicts); each is exported with ``EXPORT_TEMPLATE``.
        width: pixels across every PNG.
        scale: the PNGs' scale factor.
        timeout_s: seconds one figure may take (the browser's start and close included).
        attempts: tries, each with a new browser, before ``PngExportTimeout``.

    Returns:
        One PNG per figure, in their order.

    Raises:
        BrowserNotFoundError: kaleido finds no Chrome or Chromium (the message names the install command).
        PngExportTimeout: no try gave the PNGs in time.
    """
    from choreographer.errors import ChromeNotFoundError

    if not figs:
        return []
    outs = [export_figure(fig) for fig in figs]
    d = pio.defaults
    kopts = {k: getattr(d, k) for k in ("plotlyjs", "mathjax", "headers") if getattr(d, k, None)}
    opts = [{"format": "png", "width": width, "height": out.layout.height or d.default_height, "scale": scale}
            for out in outs]
    specs = [out.to_dict() for out in outs]
    limit = timeout_s * len(specs)
    tries = max(1, attempts)
    for _ in range(tries):
        try:
            return _within(lambda: _calc_figs(specs, [dict(o) for o in opts], d.topojson, dict(kopts)), limit)
        except TimeoutError:
            continue
        except ChromeNotFoundError:  # kaleido's message advises a download (kaleido_get_chrome): ours says apt
            raise browser_missing() from None
    raise PngExportTimeout(f"kaleido gave no PNG within {limit:g} s in {tries} tries (its browser "
                           "never answered; plotly/Kaleido#441). Try again; if it keeps happening, check that "
                           "Chromium starts: chromium --headless --no-sandbox --dump-dom about:blank")


def figure_png(fig: Any, width: int = PNG_WIDTH, scale: float = PNG_SCALE, timeout_s: float = PNG_TIMEOUT_S,
               attempts: int = PNG_ATTEMPTS) -> bytes:
    """The figure as PNG bytes: ``figures_png`` of the one figure.

    Args:
        fig: a plotly figure (or its dict).
        width: pixels across the PNG.
        scale: the PNG's scale factor.
        timeout_s: seconds one try may take.
        attempts: tries, each with a new browser.

    Returns:
        The PNG's bytes.

    Raises:
        BrowserNotFoundError: kaleido finds no Chrome or Chromium (the message names the install command).
        PngExportTimeout: no try gave a PNG in time.
    """
    return figures_png([fig], width, scale, timeout_s, attempts)[0]


def figure_html(fig: Any) -> bytes:
    """The figure as one self-contained HTML file (plotly.js inlined; opens without network)."""
    return export_figure(fig).to_html(include_plotlyjs=True, full_html=True).encode()
