"""Figures say what the numbers say: every heatmap has image row 0 at the top, labels are real text
(never Plotly's "new text" placeholder), and titles fit an exported PNG. Read from the figures'
own data and axis settings."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest

import vitlens as vl
from vitlens import figures
from vitlens.results import significant


def y_runs_downward(axis) -> bool:
    """True when the axis draws its first row at the top (reversed autorange or a decreasing range)."""
    if axis.autorange == "reversed":
        return True
    return axis.range is not None and axis.range[0] > axis.range[1]


def one_hot_similarity(grid=(3, 7), hot=(1, 6)) -> vl.PositionSimilarityResult:
    """Patch (1, 6) is similar only to itself and to patch (0, 0): an asymmetric, checkable picture."""
    gh, gw = grid
    sim = np.zeros((gh, gw, gh, gw))
    sim[hot][hot] = 1.0
    sim[hot][0, 0] = 0.5
    return vl.PositionSimilarityResult(similarity=sim, grid=grid, model_grid=grid, resized=False)


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
        r = vl.RolloutResult(maps=values[None], predictions=np.array([-1]), probabilities=np.array([np.nan]),
                             grid=(2, 3), image_size=(32, 48), head_fusion="mean", discard_ratio=0.0,
                             source_token="class token")
        fig = figures.rollout_figure(r, image)
    img, heat = fig.data[0], fig.data[1]
    assert isinstance(img, go.Image) and np.asarray(img.z)[0, 0].tolist() == [255, 255, 255]
    up = np.asarray(heat.z)
    assert up.shape == (32, 48) and up[:16, 32:].mean() > up[16:, :16].mean()  # hot corner at the top right
    for axis in [a for name, a in fig.layout.to_plotly_json().items() if name.startswith("yaxis")]:
        assert axis.get("autorange") == "reversed"


def distance(grid=(8, 8), stride=(8, 8), name="m") -> vl.AttentionDistanceResult:
    mean = np.full((3, 4), 20.0)
    return vl.AttentionDistanceResult(mean_px=mean, std_px=mean * 0, m2=mean * 0, n_images=2,
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
    r = vl.RolloutResult(maps=np.ones((1, 2, 2)), predictions=np.array([2]), probabilities=np.array([0.5]),
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
