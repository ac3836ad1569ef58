"""The numbers as tables: every result's rows (the CSV layouts), the comparison's per-layer table
and share of local heads, the spec in words, and results that print in a line and render in a
notebook. Hand-built results with known answers throughout."""
from __future__ import annotations

import csv
import io
import re

import numpy as np
import pytest

import vitlens as vl
from vitlens.attribution import AttributionResult, ComparisonTable, FaithfulnessResult
from vitlens.views.distance import AttentionDistanceResult
from vitlens.views.filters import FilterPCAResult
from vitlens.views.position import PositionSimilarityResult
from vitlens.views.rollout import RolloutResult
from vitlens.report.data import comparison, layer_table, local_head_share


def distance(mean_px: np.ndarray, width: int = 64, name: str = "m") -> AttentionDistanceResult:
    layers, heads = mean_px.shape
    return AttentionDistanceResult(mean_px=mean_px, std_px=np.full_like(mean_px, 0.5), m2=np.zeros_like(mean_px),
                                      n_images=4, image_size=(64, width), grid=(8, width // 8), stride_px=(8, 8),
                                      renormalize=True, model_name=name)


def uniform_8x8() -> float:
    """Uniform attention on the 8x8 grid of 8 px, computed independently of vitlens: the mean distance
    between two cell centres, self-pairs included (33.09 px)."""
    cells = [(y, x) for y in range(8) for x in range(8)]
    return 8 * float(np.mean([np.hypot(a[0] - b[0], a[1] - b[1]) for a in cells for b in cells]))


def test_local_head_share_counts_local_heads_by_the_one_rule_in_the_first_layers():
    from vitlens.views.distance import LOCAL_OF_UNIFORM

    # 64 px wide, 8x8 grid: local at or below 0.6 x 33.09 = 19.85 px
    limit = LOCAL_OF_UNIFORM * uniform_8x8()
    assert LOCAL_OF_UNIFORM == 0.6 and 19.8 < limit < 19.9
    d = distance(np.array([[5.0, 19.8, 19.9, 30.0], [9.5, 40.0, 2.0, 25.0], [1.0, 1.0, 1.0, 1.0]]))
    assert d.local_heads().tolist() == [[True, True, False, False], [True, False, True, False], [True] * 4]
    assert local_head_share(d, LOCAL_OF_UNIFORM, 1) == 0.5  # 5 and 19.8 of layer 1
    assert local_head_share(d, LOCAL_OF_UNIFORM, 2) == 4 / 8  # + 9.5 and 2.0
    assert local_head_share(d, LOCAL_OF_UNIFORM, 3) == 8 / 12
    assert local_head_share(d, 1.0, 1) == 1.0  # 30 px is below the uniform 33.09 px


def test_one_definition_of_a_local_head_in_every_reading():
    """The Distance view's and the report's sentence and the comparison's (CLI, app, compare.html) state the
    same rule, and count the same heads."""
    from vitlens.report.data import distance_reading
    from vitlens.report.html import comparison_html
    from vitlens.views.distance import local_rule

    a = distance(np.array([[5.0, 19.8, 19.9, 30.0], [30.0, 33.0, 34.0, 35.0]]), name="a")
    b = distance(np.array([[30.0, 31.0, 32.0, 33.0], [30.0, 33.0, 34.0, 35.0]]), name="b")
    data = comparison([a, b], first_layers=1)
    rule = local_rule()
    assert rule == "at most 0.6x the uniform-attention distance"
    assert data.local_statement() == f"local heads ({rule}) in layers 1-1: a 50%, b 0%"
    assert rule in data.summary() and f"2 of 4 layer-1 heads are local ({rule}" in distance_reading(a)
    page = comparison_html(data)
    assert rule in page and "of the image width, in the first" not in page


def test_layer_table_gives_min_median_max_per_layer_in_pixels_or_widths():
    a = distance(np.array([[4.0, 1.0, 9.0], [3.0, 3.0, 6.0]]), name="a")
    b = distance(np.array([[8.0, 8.0, 2.0], [0.0, 5.0, 1.0]]), width=128, name="b")
    rows = layer_table([a, b], ["a", "b"], "px")
    assert rows == [{"model": "a", "layer": 1, "min": 1.0, "median": 4.0, "max": 9.0},
                    {"model": "a", "layer": 2, "min": 3.0, "median": 3.0, "max": 6.0},
                    {"model": "b", "layer": 1, "min": 2.0, "median": 8.0, "max": 8.0},
                    {"model": "b", "layer": 2, "min": 0.0, "median": 1.0, "max": 5.0}]
    widths = layer_table([a, b], ["a", "b"], "width")
    assert widths[0]["max"] == 9.0 / 64 and widths[2]["median"] == 8.0 / 128


def test_comparison_chooses_units_and_reports_the_layer1_ratio():
    a = distance(np.array([[4.0, 1.0, 19.0]]), name="vit")
    b = distance(np.array([[8.0, 12.0, 20.0]]), name="hybrid")
    data = comparison([a, b])
    assert data.models == ["vit", "hybrid"] and data.units == "px"
    assert data.layer1_median_ratio() == 3.0
    assert data.local_share == [1.0, 2 / 3]  # at most 19.85 px (0.6x the uniform 33.09 px): not 20
    assert comparison([a, distance(np.array([[1.0]]), width=128)]).units == "width"
    with pytest.raises(vl.InvalidParameterError, match="two models"):
        comparison([a])


def parse(csv_bytes: bytes) -> list[dict]:
    return list(csv.DictReader(io.StringIO(csv_bytes.decode())))


def test_comparison_reads_flat_curves_and_the_fig11_contrast_from_the_numbers():
    # 8x8 grid of 8 px: uniform attention is at 33.09 px (independently: mean distance of two grid cells)
    cells = [(y, x) for y in range(8) for x in range(8)]
    uniform = 8 * float(np.mean([np.hypot(a[0] - b[0], a[1] - b[1]) for a in cells for b in cells]))
    flat = [distance(np.full((2, 4), uniform) * f, name=n) for f, n in ((0.97, "vit"), (1.02, "hybrid"))]
    data = comparison(flat)
    assert data.near_uniform_share() == [1.0, 1.0]
    assert data.reading().startswith("Flat")
    # one head in ten off by more than 10% still reads as flat; two in eight do not
    vit = distance(np.array([[10.0, 12.0, 30.0, 33.0], [30.0, 33.0, 33.0, 34.0]]), name="vit")
    hybrid = distance(np.array([[20.0, 25.0, 33.0, 33.0], [33.0, 33.0, 33.0, 33.0]]), name="hybrid")
    data = comparison([vit, hybrid], kinds=["vit", "hybrid"])
    assert data.near_uniform_share() == [pytest.approx(6 / 8), pytest.approx(6 / 8)]
    # layer-1 medians: vit (12 + 30) / 2 = 21, hybrid (25 + 33) / 2 = 29 -> 1.38
    assert data.reading() == ("Fig. 11's contrast: hybrid's layer-1 heads attend 1.38x as far as vit's (median), "
                              "as when a CNN stem has already done the local work.")
    assert comparison([hybrid, vit], kinds=["hybrid", "vit"]).reading() == data.reading()  # either order
    assert comparison([hybrid, vit]).reading() == "hybrid's layer-1 heads attend 1.38x as far as vit's (median)."
    alike = comparison([vit, distance(vit.mean_px * 1.05, name="b")])
    assert alike.reading().startswith("Layer 1 alike: median distance ratio b / vit = 1.05")


def test_a_cnn_stem_is_named_only_when_exactly_one_model_is_a_hybrid():
    """Issue 29: ref-vit against a random-init vit_tiny read as 'as when a CNN stem has already done the
    local work'. Two plain ViTs (or two hybrids, or kinds unknown) never read as Fig. 11's contrast, and
    random weights are said to show the untrained architecture."""
    near = distance(np.array([[10.0, 12.0, 30.0, 33.0], [30.0, 33.0, 33.0, 34.0]]), name="ref-vit")
    far = distance(np.array([[20.0, 25.0, 33.0, 33.0], [33.0, 33.0, 33.0, 33.0]]), name="vit_tiny")
    two_vits = comparison([near, far], weights=["embedded", "random init"], kinds=["vit", "vit"]).reading()
    assert two_vits == ("vit_tiny's layer-1 heads attend 1.38x as far as ref-vit's (median) (both are plain ViTs: "
                        "not Fig. 11's contrast); vit_tiny has random weights: its distances show the untrained "
                        "architecture, not what training learns.")
    for kinds in (["hybrid", "hybrid"], None, ["vit", ""]):
        assert "CNN stem" not in comparison([near, far], kinds=kinds).reading(), kinds
    reverse = comparison([near, far], kinds=["hybrid", "vit"]).reading()
    assert "CNN stem" not in reverse and "the reverse of Fig. 11" in reverse
    # the embedded pair is known by name: ref-hybrid is the hybrid
    pair = comparison([near, distance(far.mean_px, name="ref-hybrid")]).reading()
    assert pair.startswith("Fig. 11's contrast: ref-hybrid's")


def test_a_flat_reading_says_what_is_true_of_the_models_compared():
    from vitlens.report.data import distance_reading

    u = distance(np.ones((2, 4))).uniform_px
    vit, tiny = distance(np.full((2, 4), u), name="ref-vit"), distance(np.full((2, 4), 1.02 * u), name="vit_tiny")
    pair = comparison([vit, distance(np.full((2, 4), u), name="ref-hybrid")]).reading()
    assert pair.startswith("Flat:") and "the embedded pair, trained for minutes on shapes" in pair
    mixed = comparison([vit, tiny], weights=["embedded", "random init"]).reading()
    assert mixed.startswith("Flat:") and "embedded pair" not in mixed
    assert "ref-vit is an embedded model" in mixed and "vit_tiny has random weights" in mixed
    unknown = comparison([vit, tiny]).reading()  # weights not given: only what the names tell
    assert "embedded pair" not in unknown and "ref-vit is an embedded model" in unknown and "random" not in unknown
    hub = comparison([distance(np.full((2, 4), u), name="a"), tiny], weights=["pretrained", "pretrained"]).reading()
    assert "for the trained weights of a and vit_tiny a flat curve is unusual" in hub and "embedded" not in hub
    # one model's distance, the same reading (the report page, and the app's Attention distance view)
    one = distance_reading(tiny, weights="random init")
    assert one.startswith("Flat: 100% of vit_tiny's heads") and "vit_tiny has random weights" in one
    assert "embedded" not in one and "ref-vit is an embedded model" in distance_reading(vit)
    local = distance_reading(distance(np.array([[2.0, 3.0, 30.0, 33.0], [30.0, 33.0, 40.0, 33.0]]), name="v"))
    u = distance(np.ones((2, 4))).uniform_px  # 33.1 px on the 8x8 grid of 8 px: local at <= 19.9 px
    assert local == (f"v: 2 of 4 layer-1 heads are local (at most 0.6x the uniform-attention distance, {u:.1f} px); "
                     "the median head attends 0.26 of the width in layer 1 and 0.52 in layer 2, rising with depth, "
                     "as in Fig. 7 (right).")


def test_distance_rows_are_one_per_layer_and_head_one_based():
    d = distance(np.array([[1.0, 2.0], [3.0, 4.0]]))
    rows = d.to_rows()
    assert rows[1] == {"layer": 1, "head": 2, "mean_px": 2.0, "std_px": 0.5, "n_images": 4}
    assert rows[2]["layer"] == 2 and rows[2]["mean_px"] == 3.0
    parsed = parse(d.to_csv())
    assert list(parsed[0]) == ["layer", "head", "mean_px", "std_px", "n_images"] and parsed[3]["mean_px"] == "4.0"
    frame = d.to_pandas()
    assert frame.shape == (4, 5) and frame["mean_px"].tolist() == [1.0, 2.0, 3.0, 4.0]


def test_rollout_rows_are_one_per_image_row_and_column():
    maps = np.arange(2 * 2 * 3, dtype=float).reshape(2, 2, 3)
    r = RolloutResult(maps=maps, predictions=np.array([1, 0]), probabilities=np.array([0.9, 0.6]), grid=(2, 3),
                         image_size=(32, 48), head_fusion="mean", discard_ratio=0.0, source_token="class token",
                         predicted_labels=["cat", "dog"], model_name="m")
    rows = r.to_rows()
    assert len(rows) == 12 and rows[4] == {"image": 0, "row": 1, "col": 1, "rollout": 4.0}
    assert rows[6] == {"image": 1, "row": 0, "col": 0, "rollout": 6.0}
    assert r.caption(0) == "cat (90%)" and "mean fusion" in r.title()


def test_probabilities_are_shown_with_the_digits_they_need():
    from vitlens.views.rollout import format_probability

    shown = {p: format_probability(p) for p in (0.0, 0.0004, 0.002, 0.043, 0.0996, 0.9, 0.996, 0.9996, 1.0)}
    assert shown == {0.0: "0%", 0.0004: "<0.1%", 0.002: "0.2%", 0.043: "4.3%", 0.0996: "10.0%", 0.9: "90%",
                     0.996: "99.6%", 0.9996: ">99.9%", 1.0: "100%"}
    r = RolloutResult(maps=np.zeros((2, 1, 1)), predictions=np.array([3, 1]),
                         probabilities=np.array([0.002, 0.0001]), grid=(1, 1), image_size=(16, 16), head_fusion="mean", discard_ratio=0.0,
                         source_token="class token", predicted_labels=["langur", "dog"])
    assert r.caption(0) == "langur (0.2%)" and r.caption(1) == "dog (<0.1%)"  # never "langur (0%)"


def test_position_rows_are_one_per_pair_of_patches():
    sim = np.arange(16, dtype=float).reshape(1, 4, 1, 4) / 16
    p = PositionSimilarityResult(similarity=sim, grid=(1, 4), model_grid=(1, 4), resized=False)
    rows = p.to_rows()
    assert len(rows) == 16 and rows[6] == {"row": 0, "col": 1, "row2": 0, "col2": 2, "cosine": 6 / 16}


def test_filter_rows_are_one_per_component():
    f = FilterPCAResult(components=np.zeros((3, 3, 2, 2)), explained_variance_ratio=np.array([0.5, 0.3, 0.1]),
                           source="s", module="patch_embed.proj", n_filters=8)
    assert f.to_rows() == [{"component": 1, "explained_variance_ratio": 0.5},
                           {"component": 2, "explained_variance_ratio": 0.3},
                           {"component": 3, "explained_variance_ratio": 0.1}]


def test_attribution_and_faithfulness_rows():
    a = AttributionResult(method="saliency", maps=np.array([[[0.0, 1.0]]]), targets=np.array([3]), grid=(1, 2),
                             image_size=(8, 16), seconds_per_image=0.1)
    assert a.to_rows() == [{"method": "saliency", "image": 0, "target": 3, "row": 0, "col": 0, "value": 0.0},
                           {"method": "saliency", "image": 0, "target": 3, "row": 0, "col": 1, "value": 1.0}]
    f = FaithfulnessResult(method="saliency", fractions=np.array([0.0, 1.0]), deletion=np.ones((2, 2)),
                              insertion=np.ones((2, 2)), deletion_auc=np.array([0.2, 0.4]),
                              insertion_auc=np.array([0.9, 0.7]), baseline="mean")
    assert f.to_rows()[1] == {"method": "saliency", "image": 1, "deletion_auc": 0.4, "insertion_auc": 0.7,
                              "protocol": "vitlens", "ordering": "signed"}  # every row says what made it


def test_results_print_in_one_short_line_and_render_as_html():
    d = distance(np.array([[1.0, 2.0], [3.0, 4.0]]), name="ref-vit")
    text = repr(d)
    assert text.startswith("AttentionDistanceResult(ref-vit: 2 layers x 2 heads over 4 images")
    assert "\n" not in text and len(text) < 200
    html = d._repr_html_()
    assert "<table>" in html and "mean_px" in html
    table = ComparisonTable(rows=[{"method": "rollout", "deletion_auc": 0.1}] * 3, n_images=64,
                               attributions=[AttributionResult("rollout", np.zeros((64, 14, 14)), np.zeros(64),
                                                                  (14, 14), (224, 224), 0.1)] * 3)
    assert len(repr(table)) < 120  # it once printed 77,731 characters
    assert table.to_pandas().shape == (3, 2)


def test_spec_describes_itself_in_words():
    spec = vl.ModelSpec(name="m", kind="hybrid", image_size=(224, 160), grid=(14, 10), stride_px=(16, 16),
                        num_prefix_tokens=2, num_layers=12, num_heads=6, embed_dim=384, has_class_token=True,
                        has_pos_embed=False, num_classes=0, num_params=21_700_000)
    d = spec.describe()
    assert d["kind"] == "hybrid (CNN + ViT)" and d["input"] == "224x160 px" and d["grid"] == "14x10 tokens"
    assert d["stride"] == "16 px" and d["prefix tokens"] == "2 (class, 1 more (distillation/register))"
    assert d["parameters"] == "21.7M" and d["classes"] == "none (feature model)"
    with pytest.raises(TypeError):  # a spec is a dataclass, not a dict (no dict-style shim)
        spec["grid"]


def test_counts_and_cut_lists_read_as_words():
    """Issue 29 items 15 and 18: "maps of 1 images", "7 head(s) park ..." listing 6 with no "…"."""
    from vitlens.words import counted, listed_some

    assert counted(1, "image") == "1 image" and counted(2, "image") == "2 images" and counted(0, "head") == "0 heads"
    assert listed_some(list("abcdefg"), 6) == "a, b, c, d, e, f, … (1 more)" and listed_some(["a", "b"], 6) == "a, b"
    one = distance(np.ones((1, 2)))
    one.n_images = 1
    assert "over 1 image," in one.summary()


# --- units and layout of the report's tables

def test_compare_table_names_its_unit(ref_vit):
    from vitlens.report.data import comparison

    images = [np.zeros((64, 64, 3), np.uint8), np.full((64, 64, 3), 200, np.uint8)]
    d = vl.attention_distance(ref_vit, images)
    data = comparison([d, d], ["a", "b"])
    frame = data.table_with_units()
    assert data.unit_label() == "px" and {"min (px)", "median (px)", "max (px)"} <= set(frame.columns)
    assert list(frame["median (px)"]) == [r["median"] for r in data.to_rows()]


def test_report_tables_scroll_inside_the_page_instead_of_running_past_it():
    from vitlens.report.html import _CSS, html_table

    page = html_table([{"method": "integrated_gradients", **{f"metric_{i}": 0.5 for i in range(14)}}])
    assert page.startswith("<div class='table-wrap'><table>") and page.endswith("</table></div>")
    assert html_table([{"a": 1}], sortable=True).startswith("<div class='table-wrap'><table class='sortable'>")
    rule = re.search(r"\.table-wrap\{([^}]*)\}", _CSS).group(1)
    assert "overflow-x:auto" in rule and "max-width:100%" in rule
