"""A Swin in the app (issue 32): distance per stage with its reading and a stage picker, rollout on the image and
one query's window per head on the Attention maps view, the methods defined for it on Attributions, and Compare beside
the embedded ViT against depth in image widths; the report and ``vitlens compare`` draw the same figures."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from streamlit.testing.v1 import AppTest

import vitlens as vl
from vitlens.views.windowed import WindowedDistanceResult

from test_app import APP, NO_BROWSER, asked_tables, chart, problems, session_with_model, settled

NAME = "vitlens_test_tiny_swin"


def _register() -> None:
    import timm
    from timm.models import register_model
    from timm.models.swin_transformer import _create_swin_transformer

    if NAME in timm.list_models(NAME):
        return

    @register_model
    def vitlens_test_tiny_swin(pretrained: bool = False, **kwargs):  # noqa: ANN202 (timm's entry point)
        return _create_swin_transformer("swin_tiny_patch4_window7_224", pretrained=False, img_size=56,
                                        window_size=4, embed_dim=16, depths=(2, 2, 2), num_heads=(2, 2, 4), **kwargs)


@pytest.fixture()
def swin_app() -> AppTest:
    _register()
    at = AppTest.from_file(APP, default_timeout=120)
    at.run()
    at.slider(key="n-shapes").set_value(8).run()
    at.radio(key="m1-source").set_value("Name").run()
    at.text_input(key="m1-timm").set_value(NAME).run()
    assert problems(at) == [] and not at.error, [e.value for e in at.error]
    return at


def test_a_swin_in_the_app_shows_its_windowed_views_and_the_attributions_defined_for_it(swin_app):
    app = swin_app
    assert "hierarchical" in app.sidebar.table[0].value.to_string()
    # Attention maps: the rollout through the stages, then one query's window per head
    app.radio(key="view").set_value("Attention maps").run()
    assert problems(app) == []
    assert any(h.value == "One query's attention" for h in app.subheader)
    assert any("patch mergings" in c.value for c in app.caption)
    app.slider(key="layer").set_value(3).run()  # block 3: stage 2, 7x7 grid
    assert problems(app) == []
    assert any("stage 2" in c.value and "7x7" in c.value for c in app.caption)
    # Attention distance: per stage, the reading, and the numbers of the stage picked
    app.session_state["n-dist"] = 4
    app.radio(key="view").set_value("Attention distance").run()
    assert problems(app) == [] and any("stage 1: median head" in md.value for md in app.markdown)
    app.radio(key="dist-stage").set_value("stage 2").run()
    table = app.dataframe[0].value
    assert set(table["stage"]) == {2} and {"window_uniform_px", "of_window"} <= set(table.columns)
    # Attributions: the methods the registry defines for a hierarchical model (Method.kinds), the rest named
    from vitlens.attribution.methods import methods_for, preselected_methods

    app.radio(key="view").set_value("Attributions").run()
    assert problems(app) == [] and not app.error, [e.value for e in app.error]
    picker = app.multiselect(key="methods")
    assert list(picker.options) == list(methods_for("hierarchical")) and "grad_rollout" not in picker.options
    assert list(picker.value) == list(preselected_methods("hierarchical"))
    assert any("hierarchical" in c.value and "grad_rollout" in c.value for c in app.caption)
    app.radio(key="view").set_value("Filters").run()
    assert problems(app) == []


def test_compare_and_report_draw_a_swin_beside_a_vit_against_depth(tmp_path):
    from vitlens import figures
    from vitlens.report.data import comparison

    _register()
    torch.manual_seed(0)
    swin = vl.load_model(NAME, pretrained=False)
    vit = vl.load_model("ref-vit")
    images = vl.sample_images()[:2]
    d_swin, d_vit = vl.attention_distance(swin, images), vl.attention_distance(vit, images)
    data = comparison([d_vit, d_swin], ["ref-vit", NAME], kinds=["vit", "hierarchical"])
    assert data.units == "width"  # 64 px beside 56 px
    fig = figures.distance_figure(data.distances, names=data.models, units=data.units)
    assert fig.layout.xaxis.title.text.startswith("Depth (fraction")
    swin_dots = [t for t in fig.data if t.name == NAME][0]
    np.testing.assert_allclose(sorted(set(swin_dots.x)), (np.arange(6) + 1) / 6)
    assert max(swin_dots.y) <= 1.0 and "image widths" in fig.layout.yaxis.title.text
    again = vl.load_result(data.save(tmp_path / "compare.json"))
    assert isinstance(again.distances[1], WindowedDistanceResult)
    # the report of the Swin alone: its views through the registry, no prefix section
    a = vl.analyze(swin, images)
    from vitlens.report.html import model_figures

    figs = model_figures(a, [np.asarray(i) for i in swin.display(images)])
    assert {"filters", "distance", "rollout"} <= set(figs)
    assert figs["distance"].layout.xaxis.title.text == "Network depth (block)"


def test_compare_in_the_app_draws_a_swin_beside_the_vit_and_says_why_cka_is_not_offered(swin_app):
    """The Compare page with a Swin: the distance against depth in image widths beside the embedded ViT on its tab,
    the CKA tab's refusal in one line there (it once stopped the whole page, the distance tab included)."""
    app = swin_app
    app.radio(key="view").set_value("Compare").run()
    app.selectbox(key="m2-ref").set_value("ref-vit").run()
    assert problems(app) == [] and not app.error, [e.value for e in app.error]
    axes = [chart(app, i)["layout"].get("xaxis", {}).get("title", {}).get("text", "")
            for i in range(len(app.get("plotly_chart")))]
    assert any(t.startswith("Depth (fraction") for t in axes), axes
    refusal = [i.value for i in app.info if "CKA" in i.value]
    assert len(refusal) == 1 and "hierarchical" in refusal[0], refusal


def test_the_cka_refusal_says_what_cka_compares_and_leaves_no_bar_behind(swin_app):
    """Issue 45.1: the refusal under a bar that stayed at 0% for good (``remembered`` cleared its bar on success only);
    the refusal said CKA "reads a ViT's attention" and pointed to Python functions, not the app's own views."""
    app = swin_app
    app.radio(key="view").set_value("Compare").run()
    app.selectbox(key="m2-ref").set_value("ref-vit").run()
    assert problems(app) == [] and not app.error, [e.value for e in app.error]
    refusal = [i.value for i in app.info if "CKA" in i.value]
    assert len(refusal) == 1, refusal
    text = refusal[0]
    assert text.startswith("CKA compares two models' representations") and "attention over one token grid" not in text
    assert NAME in text and "stage to stage" in text  # why this model's blocks are not compared
    assert "Attention distance and Attention maps views" in text and "vl." not in text and "vitlens." not in text
    assert not [p for p in app.get("progress")], "a progress bar was left on the page"


def test_the_swin_distance_table_is_shown_whole(swin_app, monkeypatch):
    """Issue 45.8: the per-block table of a windowed model's distance was cut in a scroll box of ten rows."""
    app = swin_app
    asked = asked_tables(monkeypatch)
    app.session_state["n-dist"] = 4
    app.radio(key="view").set_value("Attention distance").run()
    assert problems(app) == [] and not app.error
    heads = [k for frame, k in asked if "of_window" in frame.columns]
    assert heads and all(k.get("height") == "content" for k in heads)
    assert len(app.dataframe[0].value) == 2 * 2 + 2 * 2 + 2 * 4  # every (block, head): blocks (2, 2, 2), heads (2, 2, 4)


def test_the_facts_show_the_stages_and_heads_per_stage(swin_app):
    """Issue 45.7: "layers x heads" gave the block count by the most heads of any block."""
    facts = dict(swin_app.sidebar.table[0].value[["fact", "value"]].itertuples(index=False))
    assert facts["stages"] == "3 (2, 2, 2 blocks)" and facts["heads per stage"] == "2, 2, 4"
    assert "layers x heads" not in facts


FACTS_FIT = """() => {
    const t = document.querySelector("[data-testid='stSidebar'] [data-testid='stTable']");
    const right = t.getBoundingClientRect().right;
    return [...t.querySelectorAll("td, th")].map(c => ({text: c.innerText.trim(), over: c.getBoundingClientRect().right - right,
                                                       clipped: c.scrollWidth - c.clientWidth}));
}"""


@pytest.mark.skipif(NO_BROWSER, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_the_sidebar_facts_of_a_swin_wrap_inside_the_sidebar_in_chromium(browser_app):
    """Issue 45.13: a Swin's name and "hierarchical (windowed stages)" ran past the sidebar's edge, clipped; every
    cell now ends inside the table's box, its whole text shown (wrapped). A new session of the suite's app server, in
    its Chromium (conftest's ``browser_app``)."""
    name = "swin_tiny_patch4_window7_224"  # random init (the Pretrained box is off): a long name, not a download
    with session_with_model(browser_app, name) as (page, sidebar):
        sidebar.get_by_text("heads per stage").wait_for(timeout=180000)
        settled(page)
        cells = page.evaluate(FACTS_FIT)
    texts = [c["text"] for c in cells]
    assert name in texts and "hierarchical (windowed stages)" in [t.replace("\n", " ") for t in texts], texts
    assert all(c["over"] <= 1 and c["clipped"] <= 1 for c in cells), [c for c in cells if c["over"] > 1 or c["clipped"] > 1]


def test_compares_reading_says_a_windowed_models_ratio_measures_its_windows():
    """Issue 45.7: "ref-hybrid's layer-1 heads attend 5.88x as far" beside a Swin mostly measured the Swin's windows;
    the reading says so and sets each model's layer-1 median head against the uniform distance over what it may
    attend (its window, or the whole grid), computed here from the results' own numbers."""
    from vitlens.report.data import comparison

    _register()
    torch.manual_seed(0)
    swin = vl.load_model(NAME, pretrained=False)
    hybrid = vl.load_model("ref-hybrid")
    images = vl.sample_images()[:2]
    d_hybrid, d_swin = vl.attention_distance(hybrid, images), vl.attention_distance(swin, images)
    data = comparison([d_hybrid, d_swin], ["ref-hybrid", NAME], kinds=["hybrid", "hierarchical"])
    text = data.reading()
    assert "attend" in text and f"{NAME} attends within windows, so that ratio mostly measures the windows" in text
    hybrid_of = np.median(d_hybrid.mean_px[0]) / d_hybrid.uniform_px
    swin_of = np.nanmedian(d_swin.mean_px[0] / d_swin.window_uniform_px[0])
    assert f"ref-hybrid {hybrid_of:.2f}x, {NAME} {swin_of:.2f}x" in text, text
    both_vits = comparison([d_hybrid, vl.attention_distance(vl.load_model("ref-vit"), images)], ["ref-hybrid", "ref-vit"])
    assert "windows" not in both_vits.reading()


@pytest.mark.skipif(NO_BROWSER, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_a_davits_channel_attention_is_said_not_drawn_in_chromium(browser_app):
    """Issue 49: a DaViT typed by name (random init) shows in Chromium the fact that its channel attention is not a
    token attention and is not drawn, inside the sidebar, and its rollout on the Attention maps view says it crossed
    the channel blocks undrawn; no map of a channel block is offered as a token attention (the layer picker counts
    the spatial blocks alone). A session of the suite's app server (conftest's ``browser_app``)."""
    with session_with_model(browser_app, "davit_tiny") as (page, sidebar):
        sidebar.get_by_text("not drawn", exact=True).wait_for(timeout=180000)
        settled(page)
        cells = page.evaluate(FACTS_FIT)
        page.get_by_text("Attention maps", exact=True).first.click()
        page.get_by_text("One query's attention").wait_for(timeout=180000)
        settled(page)
        titles = page.evaluate("() => [...document.querySelectorAll('.js-plotly-plot')].map("
                               "g => String(g.layout.title?.text ?? g.layout.title))")
        layers = page.evaluate("() => [...document.querySelectorAll(\"[data-testid='stSlider']\")].map("
                               "s => s.innerText)")
    texts = [c["text"].replace("\n", " ") for c in cells]
    fact = texts[texts.index("not drawn") + 1]
    assert fact.startswith("channel attention") and "not a token attention" in fact, fact
    assert all(c["over"] <= 1 and c["clipped"] <= 1 for c in cells)
    assert any("channel attention not drawn" in t for t in titles), titles
    # the block picker runs over the spatial blocks alone: davit_tiny's 1 + 1 + 3 + 1
    assert any(s.startswith("Block") and s.split()[-1] == "6" for s in layers), layers
