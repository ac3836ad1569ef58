"""PNG export (``vitlens.report.export.figure_png``, the app's downloads and ``--png``): a kaleido that never
answers (plotly/Kaleido#441) costs one bounded try and a new browser, never a hung command."""
from __future__ import annotations

import asyncio
import shutil

import plotly.graph_objects as go
import pytest

from vitlens.report import export


def hanging_then(png: bytes, hangs: int):
    """A stand-in for ``export._calc_figs`` (one kaleido browser's PNGs) whose first ``hangs`` calls never answer;
    it counts its calls, how many of them were cancelled (their browser closed) and the figures it was given."""
    state = {"calls": 0, "cancelled": 0, "figures": 0}

    async def calc_figs(specs, opts, topojson, kopts):
        state["calls"] += 1
        assert all(o["format"] == "png" and o["width"] == export.PNG_WIDTH for o in opts) and specs[0]["data"]
        if state["calls"] <= hangs:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                state["cancelled"] += 1
                raise
        state["figures"] += len(specs)
        return [png] * len(specs)

    return calc_figs, state


def test_a_try_that_never_answers_is_cancelled_and_the_next_gives_the_png(monkeypatch):
    fake, state = hanging_then(b"\x89PNG-fake", hangs=1)
    monkeypatch.setattr(export, "_calc_figs", fake)
    assert export.figure_png(go.Figure(go.Scatter(y=[1, 2])), timeout_s=0.3) == b"\x89PNG-fake"
    assert state == {"calls": 2, "cancelled": 1, "figures": 1}


def test_every_try_hanging_is_an_error_that_says_what_to_do(monkeypatch):
    fake, state = hanging_then(b"never", hangs=99)
    monkeypatch.setattr(export, "_calc_figs", fake)
    with pytest.raises(export.PngExportTimeout, match=r"no PNG within 0.2 s in 2 tries.*chromium --headless"):
        export.figure_png(go.Figure(go.Scatter(y=[1, 2])), timeout_s=0.2)
    assert state == {"calls": 2, "cancelled": 2, "figures": 0}


def test_other_errors_are_not_retried(monkeypatch):
    calls = []

    async def broken(*args, **kwargs):
        calls.append(1)
        raise ValueError("bad figure")

    monkeypatch.setattr(export, "_calc_figs", broken)
    with pytest.raises(ValueError, match="bad figure"):
        export.figure_png(go.Figure())
    assert len(calls) == 1


def test_several_figures_take_one_browser_and_one_bound_for_them_all(monkeypatch):
    fake, state = hanging_then(b"\x89PNG-fake", hangs=1)
    monkeypatch.setattr(export, "_calc_figs", fake)
    figs = [go.Figure(go.Scatter(y=[i, 2])) for i in range(3)]
    assert export.figures_png(figs, timeout_s=0.1) == [b"\x89PNG-fake"] * 3  # a try bounded by 3 x 0.1 s
    assert state == {"calls": 2, "cancelled": 1, "figures": 3}
    assert export.figures_png([]) == []


@pytest.mark.skipif(shutil.which("chromium") is None, reason="kaleido needs Chromium")
@pytest.mark.heavy  # conftest.HEAVY: handed out before the short tests
def test_the_png_is_plotlys_own_export_of_the_same_figure():
    fig = go.Figure(go.Heatmap(z=[[1, 2], [3, 4]]), layout={"title": "t", "height": 300})
    want = export.export_figure(fig).to_image(format="png", width=export.PNG_WIDTH, scale=export.PNG_SCALE)
    assert export.figure_png(fig) == want
    other = go.Figure(go.Scatter(y=[3, 1, 2]), layout={"height": 460})  # one browser: each its own height
    assert export.figures_png([fig, other]) == [want, export.export_figure(other).to_image(
        format="png", width=export.PNG_WIDTH, scale=export.PNG_SCALE)]


def hide_the_browser(monkeypatch, tmp_path) -> None:
    """A machine without Chrome/Chromium, as kaleido sees it: an empty PATH, no BROWSER_PATH, nothing at the usual
    places (choreographer looks at /usr/bin/chromium and the like whatever PATH says), no downloaded browser."""
    from choreographer.browsers import chromium

    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("BROWSER_PATH", raising=False)
    monkeypatch.setattr(chromium, "_is_exe", lambda path: False)
    monkeypatch.setattr(chromium, "get_chrome_download_path", lambda mkdir=False: None)
    monkeypatch.setattr(chromium, "get_old_chrome_download_path", lambda: None)


def test_no_browser_is_our_error_naming_the_install_command_never_kaleidos_advice(monkeypatch, tmp_path):
    pytest.importorskip("kaleido")
    hide_the_browser(monkeypatch, tmp_path)
    assert export.browser_path() is None
    with pytest.raises(export.BrowserNotFoundError) as caught:
        export.figure_png(go.Figure(go.Scatter(y=[1, 2])))
    e = caught.value
    for interface in ("python", "cli", "app"):
        text = e.message_for(interface)
        assert "apt-get install chromium" in text and "no Chrome or Chromium" in text, text
        assert "kaleido_get_chrome" not in text and "\n" not in text, text
    assert "--png" in e.message_for("cli") and "HTML download" in e.message_for("app")


def test_a_browser_path_that_is_no_file_is_named(monkeypatch, tmp_path):
    pytest.importorskip("kaleido")
    monkeypatch.setenv("BROWSER_PATH", str(tmp_path / "no-chrome"))
    assert export.browser_path() is None
    with pytest.raises(export.BrowserNotFoundError, match=r"no browser at BROWSER_PATH='.*no-chrome'.*apt-get install"):
        export.figure_png(go.Figure())


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Chromium on PATH")
def test_the_browser_is_found_where_kaleido_finds_it(monkeypatch):
    monkeypatch.delenv("BROWSER_PATH", raising=False)
    assert export.browser_path() is not None
    monkeypatch.setenv("BROWSER_PATH", shutil.which("chromium"))
    assert export.browser_path() == shutil.which("chromium")


def test_report_png_without_a_browser_stops_in_one_line_naming_the_install(monkeypatch, tmp_path, capsys):
    """``vitlens report --png`` on a machine without Chromium: exit 2, one line with the install command,
    kaleido's download advice never shown, no PNG written."""
    pytest.importorskip("kaleido")
    from vitlens.cli import main

    hide_the_browser(monkeypatch, tmp_path)
    code = main(["report", "--model", "ref-vit", "--n-images", "1", "--out", str(tmp_path / "r.html"),
                 "--png", str(tmp_path / "png"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("vitlens: error: PNG export") and "apt-get install chromium" in err and "--png" in err
    assert "kaleido_get_chrome" not in err
    assert not (tmp_path / "png").exists()
