"""The report's components section (issue 51, ``vitlens report --components``): on the reference ViT its numbers
in the data file are the library's on the same images, the page shows the ledger, the top heads, the lens and the
norms; a model the components refuse gets no section and the report is still written."""
from __future__ import annotations

import html
import json

import numpy as np
import pytest

import vitlens as vl
from vitlens.report.data import ReportData
from vitlens.reference.shapes import HELD_OUT_SEED, generate
from vitlens.cli import main
from vitlens.results import significant


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("components-report") / "report.html"
    assert main(["report", "--model", "ref-vit", "--n-images", "3", "--components", "--component-images", "2",
                 "--out", str(out), "--quiet"]) == 0
    return out


def test_the_components_section_holds_the_librarys_numbers(report) -> None:
    data = ReportData.load(report.with_suffix(".json"))
    section = data.components[0]
    images = list(generate(3, seed=HELD_OUT_SEED).images[:2])
    m = vl.load_model("ref-vit")
    d = vl.decompose(m, images)
    np.testing.assert_array_equal(section["decomposition"].heads, d.heads)
    np.testing.assert_array_equal(section["decomposition"].output, d.output)
    assert section["decomposition"].closes() and len(section["decomposition"].output) == 2
    np.testing.assert_array_equal(section["logit_lens"].pooled, vl.logit_lens(m, images).pooled)
    np.testing.assert_array_equal(section["token_norms"].norms, vl.token_norms(m, images).norms)
    page = report.read_text()
    assert "Components: the output as an exact sum" in page
    for b in range(2):
        assert f"{d.ledger()[b]:.1e}" in page  # each image's ledger, in the table
    l, h, v = d.top_heads(1, None)[0]
    assert (l, h) == section["decomposition"].top_heads(1, None)[0][:2]
    assert "Top heads" in page and significant(v) in page
    for r in (vl.logit_lens(m, images), vl.token_norms(m, images)):
        assert html.escape(r.summary()) in page


def test_a_model_the_components_refuse_gets_no_section(tmp_path, capsys) -> None:
    import timm

    out = tmp_path / "r.html"
    name = "vitlens_test_tiny_mvit"
    from test_mvit_app import _register

    _register()
    assert name in timm.list_models(name)
    assert main(["report", "--model", name, "--random-init", "--n-images", "2", "--components", "--out", str(out),
                 "--batch-size", "2"]) == 0
    assert "no components section" in capsys.readouterr().err
    # read as plain JSON: a hierarchical model's report file does not load back as a ReportData (its distance is a
    # WindowedDistanceResult where AnalysisResult declares an AttentionDistanceResult), a defect of its own
    assert json.loads(out.with_suffix(".json").read_text())["components"] == [None]
    assert "Components: the output as an exact sum" not in out.read_text()
