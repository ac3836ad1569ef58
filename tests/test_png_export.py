"""PNG export (``vitlens.report.export.figure_png``, the app's downloads and ``--png``): a kaleido that never
answers (plotly/Kaleido#441) costs one bounded try and a new browser, never a hung command."""
from __future__ import annotations

import asyncio
import shutil

import plotly.graph_objects as go
import pytest

from vitlens.report import export


def hanging_then(png: bytes, hangs: int):
    """A stand-in for ``kaleido.calc_fig`` whose first ``hangs`` calls never answer; it counts its calls and how
    many of them were cancelled (their browser closed)."""
    state = {"calls": 0, "cancelled": 0}

    async def calc_fig(fig, opts=None, *, topojson=None, kopts=None):
        state["calls"] += 1
        assert opts["format"] == "png" and opts["width"] == export.PNG_WIDTH and fig["data"]
        if state["calls"] <= hangs:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                state["cancelled"] += 1
                raise
        return png

    return calc_fig, state


def test_a_try_that_never_answers_is_cancelled_and_the_next_gives_the_png(monkeypatch):
    kaleido = pytest.importorskip("kaleido")
    fake, state = hanging_then(b"\x89PNG-fake", hangs=1)
    monkeypatch.setattr(kaleido, "calc_fig", fake)
    assert export.figure_png(go.Figure(go.Scatter(y=[1, 2])), timeout_s=0.3) == b"\x89PNG-fake"
    assert state == {"calls": 2, "cancelled": 1}


def test_every_try_hanging_is_an_error_that_says_what_to_do(monkeypatch):
    kaleido = pytest.importorskip("kaleido")
    fake, state = hanging_then(b"never", hangs=99)
    monkeypatch.setattr(kaleido, "calc_fig", fake)
    with pytest.raises(export.PngExportTimeout, match=r"no PNG within 0.2 s in 2 tries.*chromium --headless"):
        export.figure_png(go.Figure(go.Scatter(y=[1, 2])), timeout_s=0.2)
    assert state == {"calls": 2, "cancelled": 2}


def test_other_errors_are_not_retried(monkeypatch):
    kaleido = pytest.importorskip("kaleido")
    calls = []

    async def broken(*args, **kwargs):
        calls.append(1)
        raise ValueError("bad figure")

    monkeypatch.setattr(kaleido, "calc_fig", broken)
    with pytest.raises(ValueError, match="bad figure"):
        export.figure_png(go.Figure())
    assert len(calls) == 1


@pytest.mark.skipif(shutil.which("chromium") is None, reason="kaleido needs Chromium")
def test_the_png_is_plotlys_own_export_of_the_same_figure():
    fig = go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]), layout={"title": "t", "height": 300})
    want = export.export_figure(fig).to_image(format="png", width=export.PNG_WIDTH, scale=export.PNG_SCALE)
    assert export.figure_png(fig) == want
