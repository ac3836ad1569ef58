"""Issue 29's smaller items: colour-bar titles and the queried patch on the maps, units on tables, readable
CKA ranges, tables that fit the page, a word on tiny images, progress with time left, the quick default
attribution set of the report, and setup.sh's editable install without setuptools' flat-layout note."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens import figures

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ref_vit():
    return vl.load_model("ref-vit", device="cpu")


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


def test_compare_table_names_its_unit(ref_vit):
    from vitlens.report.data import comparison

    images = [np.zeros((64, 64, 3), np.uint8), np.full((64, 64, 3), 200, np.uint8)]
    d = vl.attention_distance(ref_vit, images)
    data = comparison([d, d], ["a", "b"])
    frame = data.table_with_units()
    assert data.unit_label() == "px" and {"min (px)", "median (px)", "max (px)"} <= set(frame.columns)
    assert list(frame["median (px)"]) == [r["median"] for r in data.to_rows()]


def test_cka_ranges_read_as_ranges_and_negatives_are_explained():
    from vitlens.compare.cka import CKAResult
    from vitlens.words import value_range

    assert value_range(-0.73, -0.02) == "\u22120.73 to \u22120.02" and value_range(0.5, 0.504) == "0.50"
    m = np.array([[-0.73, 0.1], [0.2, -0.02]])
    res = CKAResult(matrix=m, ci_low=m, ci_high=m, layers_a=["a", "b"], layers_b=["a", "b"], estimator="unbiased",
                    token_policy="mean", n_images=8, batch_size=4, n_batches=2, model_a="A", model_b="B")
    text = res.summary()
    assert "diagonal \u22120.73 to \u22120.02" in text and "--" not in text
    assert "unbiased HSIC estimator" in text and "4 images per minibatch" in text
    positive = CKAResult(matrix=np.abs(m), ci_low=m, ci_high=m, layers_a=["a", "b"], layers_b=["a", "b"],
                         estimator="unbiased", token_policy="mean", n_images=8, batch_size=4, n_batches=2)
    assert "estimator" not in positive.summary()  # nothing below 0, nothing to explain


def test_report_tables_scroll_inside_the_page_instead_of_running_past_it():
    from vitlens.report.html import _CSS, html_table

    page = html_table([{"method": "integrated_gradients", **{f"metric_{i}": 0.5 for i in range(14)}}])
    assert page.startswith("<div class='table-wrap'><table>") and page.endswith("</table></div>")
    assert html_table([{"a": 1}], sortable=True).startswith("<div class='table-wrap'><table class='sortable'>")
    rule = re.search(r"\.table-wrap\{([^}]*)\}", _CSS).group(1)
    assert "overflow-x:auto" in rule and "max-width:100%" in rule


def test_a_tiny_image_gets_the_one_warning_in_uploads_and_on_the_command_line():
    import io

    from PIL import Image

    from vitlens.images import TINY_IMAGE_PX, read_uploads, tiny_image_warning

    def png(size):
        buf = io.BytesIO()
        Image.new("RGB", size).save(buf, format="PNG")
        return buf.getvalue()

    got = read_uploads([("dot.png", png((1, 1))), ("ok.png", png((TINY_IMAGE_PX, TINY_IMAGE_PX)))])
    assert got.names == ["dot.png", "ok.png"] and got.tiny == [tiny_image_warning("dot.png", (1, 1))]
    assert got.tiny[0].startswith("dot.png (1x1 px) is smaller than 16 px")
    assert tiny_image_warning("ok.png", (TINY_IMAGE_PX, 400)) == ""


def test_time_left_reads_the_rate_so_far():
    from vitlens.progress import time_left

    assert time_left(10.0, 1, 5) == "about 40 s left"
    assert time_left(60.0, 1, 4) == "about 3 min left"
    assert time_left(5.0, 0, 4) == "" and time_left(5.0, 4, 4) == ""


def test_compare_methods_reports_one_progress_over_methods_and_images(ref_vit):
    from vitlens.attribution import compare_methods

    seen = []
    x = torch.rand(3, 3, 64, 64)
    compare_methods(ref_vit, x, methods=["rollout", "saliency"], metrics=("deletion_insertion",), steps=2,
                    batch_size=2, progress=lambda done, total: seen.append((done, total)))
    assert {t for _, t in seen} == {12} and seen[-1][0] == 12  # 2 methods x 3 images x (map, scores)
    dones = [d for d, _ in seen]
    assert dones == sorted(dones) and {3, 6, 9} <= set(dones)  # maps, then scores, of one method after the other


def test_the_sanity_cascade_reports_one_progress_over_methods_and_steps(ref_vit):
    from vitlens.attribution.sanity import parameter_groups, sanity_table

    seen = []
    sanity_table(ref_vit, torch.rand(1, 3, 64, 64), methods=["rollout", "saliency"],
                 progress=lambda done, total: seen.append((done, total)))
    total = 2 * (len(parameter_groups(ref_vit)) + 1)  # the original maps, then each step of the cascade
    assert seen == [(k, total) for k in range(1, total + 1)]


def test_the_reports_default_attributions_are_the_quick_preselected_set():
    from vitlens.attribution.methods import METHOD_TABLE, available_methods, preselected_methods
    from vitlens.report import cli

    default = cli.report_methods(None)
    assert default == [k for k in preselected_methods() if k in available_methods()] and default
    assert not any(METHOD_TABLE[k].slow for k in default) and "occlusion" not in default
    assert cli.report_methods(["all"]) == list(available_methods())
    assert cli.report_methods(["occlusion"]) == ["occlusion"]
    args = cli.build_parser().parse_args(["report", "--attributions", "--methods", "all"])
    assert args.methods == ["all"]


def test_setup_sh_silences_only_setuptools_editable_note():
    """scripts/app.sh runs setup.sh, whose ``pip install -e .`` made setuptools print "Please be careful with
    folders in your working directory with the same name as your package" (the flat layout's note: here that
    folder is the package). The install runs under a PYTHONWARNINGS filter for that one warning."""
    text = (ROOT / "scripts" / "setup.sh").read_text()
    line = next(ln for ln in text.splitlines() if "pip install" in ln and " -e ." in ln)
    value = re.search(r'PYTHONWARNINGS="([^"]+)"', line).group(1)
    action, message = value.split(":")[:2]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings(action, message=re.escape(message))
        warnings.warn("Editable installation.\n!!\n\nPlease be careful with folders in your working directory")
        warnings.warn("Some other setuptools warning")
    assert [str(w.message) for w in caught] == ["Some other setuptools warning"]
