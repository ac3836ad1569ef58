"""Figures say what the numbers say: every heatmap has image row 0 at the top, labels are real text
(never Plotly's "new text" placeholder), and titles fit an exported PNG. Read from the figures'
own data and axis settings."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest

import vitlens as vl
from vitlens.attribution import AttributionResult
from vitlens.views.distance import AttentionDistanceResult
from vitlens.views.position import PositionSimilarityResult
from vitlens.views.rollout import RolloutResult
from vitlens import figures
from vitlens.results import significant


def y_runs_downward(axis) -> bool:
    """True when the axis draws its first row at the top (reversed autorange or a decreasing range)."""
    if axis.autorange == "reversed":
        return True
    return axis.range is not None and axis.range[0] > axis.range[1]


def one_hot_similarity(grid=(3, 7), hot=(1, 6)) -> PositionSimilarityResult:
    """Patch (1, 6) is similar only to itself and to patch (0, 0): an asymmetric, checkable picture."""
    gh, gw = grid
    sim = np.zeros((gh, gw, gh, gw))
    sim[hot][hot] = 1.0
    sim[hot][0, 0] = 0.5
    return PositionSimilarityResult(similarity=sim, grid=grid, model_grid=grid, resized=False)


def test_enlarged_tile_puts_patch_row_0_at_the_top_without_padding():
    fig = figures.similarity_tile_figure(one_hot_similarity(), 1, 6)
    heat = fig.data[0]
    z = np.asarray(heat.z)
    assert z[1, 6] == 1.0 and z[0, 0] == 0.5  # z rows are patch rows, top first
    assert list(heat.y) == [0, 1, 2] and list(heat.x) == list(range(7))
    assert y_runs_downward(fig.layout.yaxis)
    assert tuple(fig.layout.yaxis.range) == (2.5, -0.5) and tuple(fig.layout.xaxis.range) == (-0.5, 6.5)


def test_tile_mosaic_puts_tile_row_0_at_the_top():
    res = one_hot_similarity()
    fig = figures.position_figure(res)
    z = np.asarray(fig.data[0].z, dtype=float)
    gh, gw = res.grid
    top, left = 1 * (gh + 1), 6 * (gw + 1)  # tile (1, 6) of the mosaic
    assert z[top + 1, left + 6] == 1.0 and z[top, left] == 0.5
    assert y_runs_downward(fig.layout.yaxis)
    assert np.asarray(fig.data[0].customdata)[top + 1, left + 6].tolist() == [1, 6, 1, 6]


@pytest.mark.parametrize("build", ["overlay", "grid", "rollout"])
def test_overlays_put_image_row_0_at_the_top(build):
    image = np.zeros((32, 48, 3), np.uint8)
    image[:4] = 255  # a white band along the top of the image
    values = np.zeros((2, 3))
    values[0, 2] = 1.0  # the top-right patch
    if build == "overlay":
        fig = figures.heatmap_overlay_figure(image, values, "t")
    elif build == "grid":
        fig = figures.overlay_grid_figure([(image, values, "a"), (image, values, "b")], "t")
    else:
        r = RolloutResult(maps=values[None], predictions=np.array([-1]), probabilities=np.array([np.nan]),
                             grid=(2, 3), image_size=(32, 48), head_fusion="mean", discard_ratio=0.0,
                             source_token="class token")
        fig = figures.rollout_figure(r, image)
    img, heat = fig.data[0], fig.data[1]
    assert isinstance(img, go.Image) and np.asarray(img.z)[0, 0].tolist() == [255, 255, 255]
    z = np.asarray(heat.z)
    assert z.shape == (2, 3) and z[0, 2] == 1.0  # one cell per token, z row 0 = patch row 0
    assert heat.y0 == 16 / 2 - 0.5 and heat.dy == 16 and heat.x0 == 16 / 2 - 0.5 and heat.dx == 16  # on its pixels
    for axis in [a for name, a in fig.layout.to_plotly_json().items() if name.startswith("yaxis")]:
        assert axis.get("autorange") == "reversed"


def distance(grid=(8, 8), stride=(8, 8), name="m") -> AttentionDistanceResult:
    mean = np.full((3, 4), 20.0)
    return AttentionDistanceResult(mean_px=mean, std_px=mean * 0, m2=mean * 0, n_images=2,
                                      image_size=(grid[0] * stride[0], grid[1] * stride[1]), grid=grid,
                                      stride_px=stride, renormalize=True, model_name=name)


def test_uniform_attention_lines_are_named_with_text_never_a_placeholder():
    def lines(fig):
        return [t.name for t in fig.data if t.mode == "lines"]

    two_same = figures.distance_figure([distance(name="vit"), distance(name="hybrid")])
    assert lines(two_same) == ["uniform attention (vit)"]  # one line for the shared level
    assert not two_same.layout.annotations  # no text over the dots, never Plotly's "new text"
    two_levels = figures.distance_figure([distance(name="a"), distance(grid=(14, 14), stride=(16, 16), name="b")])
    assert lines(two_levels) == ["uniform attention (a)", "uniform attention (b)"]  # 33 vs 116 px
    assert lines(figures.distance_figure(distance())) == ["uniform attention"]


def test_titles_fit_an_exported_figure():
    d = distance()
    r = RolloutResult(maps=np.ones((1, 2, 2)), predictions=np.array([2]), probabilities=np.array([0.5]),
                         grid=(2, 2), image_size=(16, 16), head_fusion="mean", discard_ratio=0.0,
                         source_token="class token", predicted_labels=["triangle"])
    for fig in (figures.distance_figure([d, d], names=["a", "b"]), figures.rollout_figure(r, np.zeros((16, 16, 3),
                                                                                                       np.uint8))):
        first_line = fig.layout.title.text.split("<br>")[0]
        assert len(first_line) <= 70, first_line


def test_attribution_title_names_the_class_and_aucs_keep_significant_digits():
    from vitlens.attribution.faithfulness import FaithfulnessResult
    from vitlens.attribution.methods import AttributionResult

    a = AttributionResult(method="saliency", maps=np.ones((1, 2, 2)), targets=np.array([4]), grid=(2, 2),
                          image_size=(16, 16), seconds_per_image=0.1, label_names=["a", "b", "c", "d", "ring", "star"])
    fig = figures.attribution_figure([a], np.zeros((16, 16, 3), np.uint8))
    assert "Attributions for ring " in fig.layout.title.text
    unnamed = AttributionResult(method="saliency", maps=np.ones((1, 2, 2)), targets=np.array([286]), grid=(2, 2),
                                image_size=(16, 16), seconds_per_image=0.1)
    assert "Attributions for class 286 " in figures.attribution_figure([unnamed], np.zeros((16, 16, 3), np.uint8)).layout.title.text
    curves = np.array([[1.0, 0.0012, 0.0]])
    f = FaithfulnessResult(method="saliency", fractions=np.array([0.0, 0.5, 1.0]), deletion=curves * 0.001,
                           insertion=curves * 0.002, deletion_auc=np.array([0.000753]), insertion_auc=np.array([0.00151]),
                           baseline="mean")
    fig = figures.faithfulness_figure([f])
    shown = [t.name for t in fig.data if t.showlegend]  # the one legend under both panels
    assert shown == ["saliency (AUC deletion 0.000753, insertion 0.00151)"]  # not 0.001 and 0.002, and both
    assert fig.layout.margin.r >= 30  # room for the last x tick, "1"
    assert "0.000753" in f.summary() and "0.00151" in f.summary()


def test_significant_digits_round_numbers_not_decimals():
    import pandas as pd

    from vitlens.results import round_significant, significant

    assert significant(0.0012345) == "0.00123" and significant(123.456) == "123"
    frame = round_significant(pd.DataFrame({"auc": [0.0012345, 0.98765], "name": ["a", "b"]}))
    assert frame["auc"].tolist() == [0.00123, 0.988] and frame["name"].tolist() == ["a", "b"]


def test_prefix_heatmap_has_whole_head_ticks_for_few_heads():
    from types import SimpleNamespace

    prefix = SimpleNamespace(mass=np.full((4, 3, 1), 0.2), labels=["cls"])
    fig = figures.prefix_figure(prefix)
    assert fig.layout.xaxis.dtick == 1 and fig.layout.yaxis.dtick == 1


def test_uniform_attention_is_named_in_the_legend_not_over_the_last_layer():
    from vitlens.views.distance import AttentionDistanceResult

    d = AttentionDistanceResult(mean_px=np.full((6, 8), 30.0), std_px=np.zeros((6, 8)), m2=np.zeros((6, 8)),
                                n_images=2, image_size=(64, 64), grid=(8, 8), stride_px=(8, 8), renormalize=True,
                                model_name="m")
    fig = figures.distance_figure([d, d], names=["vit", "hybrid"])
    assert not fig.layout.annotations  # no text drawn over the dots
    lines = [t for t in fig.data if t.mode == "lines"]
    assert len(lines) == 1 and lines[0].name == "uniform attention (vit)"  # one level, named once
    assert lines[0].y[0] == pytest.approx(d.uniform_px) and tuple(lines[0].x) == (0.5, 6.5)


def test_the_deletion_insertion_legend_gives_both_aucs_and_every_method_its_own_colour():
    """Issue 29: with all 15 methods the colours repeated (rollout, gradcam, eigengradcam all blue), and the
    insertion AUCs appeared nowhere on the figure."""
    from vitlens.attribution.faithfulness import FaithfulnessResult
    from vitlens.attribution.methods import METHODS

    n = len(METHODS)  # 17: AttnLRP's variants (issue 34) have colours of their own too
    assert n >= 15 and len(figures.METHOD_PALETTE) >= n
    rng = np.random.default_rng(0)
    results = [FaithfulnessResult(method=m, fractions=np.linspace(0, 1, 5), deletion=rng.random((2, 5)),
                                  insertion=rng.random((2, 5)), deletion_auc=np.array([0.1 + i / 100, 0.1]),
                                  insertion_auc=np.array([0.5 + i / 100, 0.5]), baseline="mean")
               for i, m in enumerate(METHODS)]
    fig = figures.faithfulness_figure(results)
    legend = [t for t in fig.data if t.showlegend]
    assert len(legend) == n and len({t.line.color for t in legend}) == n
    for i, t in enumerate(legend):
        dele, ins = significant(float(np.mean([0.1 + i / 100, 0.1]))), significant(float(np.mean([0.5 + i / 100, 0.5])))
        assert t.name.endswith(f"(AUC deletion {dele}, insertion {ins})"), t.name
    # a method keeps its colour in every figure, whatever else is drawn beside it
    assert figures.faithfulness_figure(results[3:4]).data[0].line.color == legend[3].line.color


# ---------------------------------------------------------------- issue 45, item 3: tokens drawn as tokens
def rollout_of(values: np.ndarray) -> RolloutResult:
    return RolloutResult(maps=values[None], predictions=np.array([-1]), probabilities=np.array([np.nan]),
                            grid=values.shape, image_size=(64, 64), head_fusion="mean", discard_ratio=0.0,
                            source_token="class token")


def test_a_rollout_normalised_to_1_is_drawn_with_its_peak_at_1_one_cell_per_token():
    """Issue 45: the 8x8 rollout ÷ max was upsampled bilinearly to 64 px, so the drawn peak was 0.916 and the colour
    bar stopped there; jet drew false edges. Now the cells are the tokens' own values, the bar from 0 to the max."""
    rng = np.random.default_rng(0)
    values = rng.random((8, 8)) * 0.5
    values[3, 4] = 1.0  # an isolated peak, which bilinear smoothing pulled down
    image = np.zeros((64, 64, 3), np.uint8)
    for fig in (figures.rollout_figure(rollout_of(values), image),
                figures.rollout_grid_figure(rollout_of(values), [image])):
        heat = fig.data[1]
        np.testing.assert_array_equal(np.asarray(heat.z), values)  # no resampling
        assert heat.zsmooth is False or heat.zsmooth == "False" or not heat.zsmooth
        scale = heat if heat.coloraxis is None else fig.layout.coloraxis
        lo, hi = (scale.zmin, scale.zmax) if heat.coloraxis is None else (scale.cmin, scale.cmax)
        assert (lo, hi) == (0.0, 1.0)
        names = [c[1].lower() for c in scale.colorscale]
        assert names == [c[1].lower() for c in go.Heatmap(colorscale="Viridis").colorscale]  # perceptually uniform


def test_the_colour_range_spans_the_data_from_0_or_below():
    assert figures.colour_range([np.array([[0.2, 0.7]]), np.array([[0.5, 0.9]])]) == (0.0, 0.9)
    assert figures.colour_range([np.array([[-0.3, 0.4]])]) == (-0.3, 0.4)
    heads = figures.heads_figure(np.zeros((32, 32, 3), np.uint8), np.random.default_rng(1).random((3, 4, 4)), 0,
                                 "the class token")
    assert (heads.layout.coloraxis.cmin, heads.layout.coloraxis.cmax) == (0.0, 1.0)  # each head ÷ its max
    one = figures.head_figure(np.zeros((32, 32, 3), np.uint8), np.full((2, 4, 4), 0.0625), 0, 1, "the class token")
    assert (one.data[1].zmin, one.data[1].zmax) == (0.0, 0.0625)  # the weights as they are: the max is the max


# ---------------------------------------------------------------- issue 45, item 4: a model keeps its colour
def survey_of(models: list[tuple[str, str]], classes: tuple[str, ...] = ()) -> "SurveyResult":
    """A hand-built survey table: 2 layers x 2 heads per model (and per-class rows given classes)."""
    import pandas as pd

    from vitlens.survey.store import SurveyResult

    rows = []
    for k, (model, weights) in enumerate(models):
        for layer in (1, 2):
            for head in (1, 2):
                rows.append(dict(model=model, weights=weights, layer=layer, head=head, metric="mean_distance_width",
                                 value=0.1 * layer + 0.01 * head + 0.001 * k, **{"class": None}))
        for c, name in enumerate(classes):
            rows.append(dict(model=model, weights=weights, layer=None, head=None, metric="mean_distance_width",
                             value=0.45 + 0.05 * c, **{"class": name}))
    manifest = {"models": {f"m{k}": {"name": m, "weights": w, "status": "done",
                                     "spec": {"kind": "hybrid" if "hybrid" in m else "vit"}}
                           for k, (m, w) in enumerate(models)}, "source": {}}
    return SurveyResult(path=None, table=pd.DataFrame(rows), manifest=manifest)


@pytest.mark.parametrize("order", [("ref-vit", "ref-hybrid"), ("ref-hybrid", "ref-vit")])
def test_a_model_keeps_its_colour_in_compare_and_survey_figures_whatever_the_order(order):
    """Issue 45: compare.html drew ref-vit blue and ref-hybrid red; the survey (sorted by name) and the app's Compare
    with the hybrid picked first swapped them."""
    from vitlens.report.survey import depth_figure, layer1_figure

    blue, red = figures.PALETTE[:2]
    want = {"ref-vit": blue, "ref-hybrid": red}
    fig = figures.distance_figure([distance(name=n) for n in order], names=list(order))
    markers = {t.name: t.marker.color for t in fig.data if t.mode == "markers"}
    assert markers == want
    depth = figures.depth_distance_figure([distance(name=n) for n in order], names=list(order))
    assert {t.name: t.marker.color for t in depth.data if t.mode == "markers"} == want
    survey = survey_of([(n, "embedded") for n in order])
    assert {t.name.split(" (")[0]: t.line.color for t in depth_figure(survey).data} == want
    assert {t.name.split(" (")[0]: t.marker.color for t in layer1_figure(survey).data} == want


def test_model_colours_are_by_a_stable_rule_presets_first_then_names():
    assert figures.model_colours(["b", "a", "ref-hybrid"]) == [figures.PALETTE[2], figures.PALETTE[1],
                                                                figures.PALETTE[0]]
    # one model's two runs: told apart by their weights, whatever their order
    one = figures.model_colours(["x", "x"], ["random init", "pretrained"])
    assert one == figures.model_colours(["x", "x"], ["pretrained", "random init"])[::-1] and len(set(one)) == 2


# ---------------------------------------------------------------- issue 45, item 15: the per-class scale
def test_the_survey_per_class_scale_starts_at_0_and_says_its_range():
    """Issue 45: a colour range of 0.45-0.50 image widths made 0.05 look like yellow against dark purple."""
    from vitlens.report.survey import class_figure

    fig = class_figure(survey_of([("ref-vit", "embedded")], classes=("circle", "square")))
    heat = fig.data[0]
    assert heat.zmin == 0.0 and heat.zmax == pytest.approx(0.5)
    assert "0.450-0.500" in fig.layout.title.text and "from 0 to 0.500" in fig.layout.title.text


# ---------------------------------------------------------------- issue 45, item 10: Fig. 7 centre labelled
def test_the_mosaic_axes_name_the_input_patch_and_the_tile_has_a_colour_bar_title():
    res = one_hot_similarity(grid=(3, 7))
    fig = figures.position_figure(res)
    assert fig.layout.xaxis.title.text.startswith("input patch column")
    assert fig.layout.yaxis.title.text.startswith("input patch row")
    assert fig.layout.xaxis.visible is not False and fig.layout.yaxis.visible is not False
    # a tick at each tile's centre: tile column c sits at c * (gw + 1) + (gw - 1) / 2 of the mosaic
    assert list(fig.layout.xaxis.tickvals) == [c * 8 + 3 for c in range(7)] and list(fig.layout.xaxis.ticktext) == [
        str(c) for c in range(7)]
    assert list(fig.layout.yaxis.tickvals) == [r * 4 + 1 for r in range(3)]
    tile = figures.similarity_tile_figure(res, 1, 6)
    assert tile.data[0].colorbar.title.text == "cosine"


# ---------------------------------------------------------------- issue 45, item 11: readable attribution figures
def hue(colour: str) -> float:
    import colorsys

    r, g, b = (int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))
    return 360 * colorsys.rgb_to_hsv(r, g, b)[0]


def test_the_methods_shown_together_have_distinct_hues():
    """Issue 45: gradient rollout (pink) and saliency (red) were hard to tell apart."""
    from vitlens.attribution.methods import METHODS, preselected_methods

    together = [*preselected_methods(), "attnlrp"]
    hues = [hue(figures.method_colour(m)) for m in together]
    for i in range(len(hues)):
        for j in range(i):
            gap = abs(hues[i] - hues[j]) % 360
            assert min(gap, 360 - gap) >= 60, (together[i], together[j])
    assert len({figures.method_colour(m) for m in METHODS}) == len(METHODS)


def test_figures_and_tables_read_labels_from_the_registries():
    """Issue 45: legends and column names were raw identifiers (chefer_positive_auc, mass_ratio)."""
    from vitlens.attribution import METHOD_TABLE, METRIC_TABLE, ComparisonTable
    from vitlens.attribution.perturbation import PerturbationResult

    assert all(mt.label for mt in METHOD_TABLE.values())  # a label per entry
    assert all(mt.label and set(mt.column_labels) for mt in METRIC_TABLE.values())
    rng = np.random.default_rng(0)
    results = [PerturbationResult(method=m, fractions=np.linspace(0, 0.9, 4), positive=rng.random((2, 4)),
                                  negative=rng.random((2, 4)), positive_auc=np.array([0.2, 0.3]),
                                  negative_auc=np.array([0.5, 0.6]), score="probability")
               for m in ("grad_rollout", "saliency")]
    fig = figures.metric_figure(METRIC_TABLE["perturbation"], results)
    legend = [t.name for t in fig.data if t.showlegend]
    assert legend[0].startswith("gradient rollout (positive perturbation AUC 0.25, negative perturbation AUC 0.55")
    assert not any("_" in name for name in legend)
    assert fig.layout.yaxis2.matches == "y"  # one y range across the metric's panels, titled once
    assert fig.layout.yaxis.title.text == "target-class probability" and fig.layout.yaxis2.title.text is None
    table = ComparisonTable(rows=[{"method": "grad_rollout", "chefer_positive_auc": 0.2, "deletion_auc": 0.1,
                                   "seconds_per_image": 0.5, "mass_ratio": 1.5, "pointing_game": 1.0}], n_images=2)
    (row,) = table.readable_rows()
    assert row == {"method": "gradient rollout", "positive perturbation AUC": 0.2, "deletion AUC": 0.1,
                   "seconds per image": 0.5, "mass ratio (1: uniform)": 1.5, "pointing game": 1.0}
    assert table.to_rows()[0]["chefer_positive_auc"] == 0.2  # the CSV and JSON keep the identifiers
    maps = figures.attribution_figure([AttributionResult(method="grad_rollout", maps=np.ones((1, 2, 2)),
                                                            targets=np.array([0]), grid=(2, 2), image_size=(8, 8),
                                                            seconds_per_image=0.0)],
                                      np.zeros((8, 8, 3), np.uint8))
    assert maps.layout.annotations[0].text == "gradient rollout"


def test_the_reports_attribution_table_reads_labels_too():
    import plotly.graph_objects as go

    from vitlens.attribution import ComparisonTable
    from vitlens.report.html import attribution_section

    table = ComparisonTable(rows=[{"method": "grad_rollout", "chefer_positive_auc": 0.2, "mass_ratio": 1.5}],
                            n_images=2, protocols={"perturbation": "chefer2021, signed"})
    page = attribution_section(table, {"attributions": go.Figure()})
    assert "gradient rollout" in page and "positive perturbation AUC" in page and "mass ratio (1: uniform)" in page
    assert "Perturbation: chefer2021, signed" in page
    assert "chefer_positive_auc" not in page and "grad_rollout" not in page and "mass_ratio" not in page
@pytest.mark.parametrize("heads, shape", [(8, (2, 4)), (12, (2, 6)), (3, (1, 3)), (16, (4, 4)), (24, (4, 6))])
def test_the_heads_are_laid_out_to_fit_their_count_with_each_image_under_its_title(heads, shape):
    """Issue 45.9: 8 heads were laid out 6 + 2 with a blank area, and a square image was centred in a taller cell,
    ~80 px below its "head N". Now the columns leave no empty cell where a count allows, and each image's domain
    shrinks to the top of its cell (Plotly's constrain="domain", constraintoward="top"), under its title."""
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    fig = figures.heads_figure(image, np.random.default_rng(0).random((heads, 4, 4)), 0, "the class token")
    layout = fig.to_plotly_json()["layout"]
    xs = sorted({tuple(layout[k]["domain"]) for k in layout if k.startswith("xaxis")})
    ys = sorted({tuple(layout[k]["domain"]) for k in layout if k.startswith("yaxis")})
    assert (len(ys), len(xs)) == shape
    for k in layout:
        if k.startswith("yaxis"):
            assert layout[k]["constrain"] == "domain" and layout[k]["constraintoward"] == "top"
        if k.startswith("xaxis"):
            assert layout[k]["constrain"] == "domain"
    titles = [a for a in layout["annotations"] if a["text"].startswith("head ")]
    assert len(titles) == heads and {round(a["y"], 6) for a in titles} == {round(y[1], 6) for y in ys}
# --- colour-bar titles and the queried patch on the maps

def _colorbar_title(fig) -> str:
    heat = [t for t in fig.data if t.type == "heatmap"]
    if heat and heat[0].colorbar.title.text:
        return heat[0].colorbar.title.text
    return fig.layout.coloraxis.colorbar.title.text


def test_rollout_head_and_attribution_maps_title_their_colour_bars(ref_vit):
    image = np.zeros((64, 64, 3), np.uint8)
    roll = vl.attention_rollout(ref_vit, [image])
    maps = np.random.default_rng(0).random((4, 8, 8))
    assert _colorbar_title(figures.rollout_figure(roll, image)) == "rollout (÷ max)"
    assert _colorbar_title(figures.heads_figure(image, maps, 0, "patch (2, 5)")) == "attention (÷ head's max)"
    assert _colorbar_title(figures.head_figure(image, maps, 0, 1, "patch (2, 5)")) == "attention weight"
    att = vl.attribute(ref_vit, [image], method="saliency")
    assert _colorbar_title(figures.attribution_figure([att], image)) == "evidence (÷ map's max)"


def test_the_queried_patch_is_outlined_on_every_heads_map():
    image = np.zeros((64, 96, 3), np.uint8)  # 8 x 12 grid of 8 px patches
    maps = np.random.default_rng(0).random((3, 8, 12))
    one = figures.head_figure(image, maps, 2, 0, "patch (2, 5)", patch=(2, 5))
    (rect,) = one.layout.shapes
    assert (rect.x0, rect.x1, rect.y0, rect.y1) == (5 * 8 - 0.5, 6 * 8 - 0.5, 2 * 8 - 0.5, 3 * 8 - 0.5)
    every = figures.heads_figure(image, maps, 2, "patch (2, 5)", patch=(2, 5))
    assert len(every.layout.shapes) == 3  # one per head's panel, each on its own axes
    assert len({s.xref for s in every.layout.shapes}) == 3
    assert not figures.heads_figure(image, maps, 2, "the class token").layout.shapes  # no patch, no outline
