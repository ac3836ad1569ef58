"""The report's SAE section (issue 66, item 8; ``vitlens report --sae FILE`` / ``--train-sae``): the features in the
data file are ``vl.sae_features``'s of the same SAE on the same images, the page shows them and the ablation; an SAE
of another model's width gets no section and the report is still written; a missing file and both options at once
are refused before any model is loaded (exit 2)."""
from __future__ import annotations

import html

import numpy as np
import pytest

import vitlens as vl
from vitlens.cli import main
from vitlens.reference.shapes import HELD_OUT_SEED, generate
from vitlens.report.data import ReportData
from vitlens.sae import SAEConfig, SparseAutoencoder, save_sae


@pytest.fixture(scope="module")
def sae_file(tmp_path_factory):
    m = vl.load_model("ref-vit")
    sae = vl.train_sae(m, list(generate(40, seed=7).images), site="blocks.3.hook_resid_post", n_features=32, k=4,
                    tokens="patches", epochs=1).sae
    return sae, save_sae(sae, tmp_path_factory.mktemp("sae") / "sae")


def test_the_sae_section_holds_the_librarys_features_and_the_ablation(sae_file, tmp_path) -> None:
    _, folder = sae_file
    out = tmp_path / "report.html"
    assert main(["report", "--model", "ref-vit", "--n-images", "6", "--sae", str(folder), "--out", str(out),
                 "--quiet"]) == 0
    section = ReportData.load(out.with_suffix(".json")).sae[0]
    scenes = generate(6, seed=HELD_OUT_SEED)
    m = vl.load_model("ref-vit")
    r = vl.sae_features(m, vl.load_sae(folder), list(scenes.images), labels=scenes.labels, top=4)
    np.testing.assert_allclose(section["features"].frequency, r.frequency)
    np.testing.assert_allclose(section["features"].writers_all, r.writers_all, atol=1e-6)
    shown = [int(f) for f in r.order("frequency")[:3]]
    assert section["shown"].tolist() == shown
    edit = section["intervention"]
    top = section["features"].top_images[section["features"].row(shown[0])]
    assert edit.feature == shown[0] and edit.logits_before.shape[0] == int((top >= 0).sum()) > 0
    page = out.read_text()
    assert "Features of the residual stream" in page and html.escape(r.summary()) in page
    assert html.escape(edit.summary()) in page and f"Feature {shown[0]}" in page


def test_an_sae_of_another_width_gets_no_section(tmp_path, capsys) -> None:
    folder = save_sae(SparseAutoencoder(SAEConfig(d_in=64, n_features=8, k=2, site="blocks.1.hook_resid_post")),
                      tmp_path / "narrow")
    out = tmp_path / "r.html"
    assert main(["report", "--model", "ref-vit", "--n-images", "2", "--sae", str(folder), "--out", str(out)]) == 0
    assert "no SAE section" in capsys.readouterr().err and out.exists()


def test_a_missing_sae_or_both_options_are_refused_before_any_model(tmp_path, capsys) -> None:
    out = tmp_path / "r.html"
    assert main(["report", "--sae", str(tmp_path / "nothing"), "--out", str(out), "--quiet"]) == 2
    assert main(["report", "--sae", str(tmp_path), "--train-sae", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--train-sae" in err and not out.exists()


def test_train_sae_adds_a_section_of_an_sae_trained_on_the_reports_images(tmp_path) -> None:
    out = tmp_path / "t.html"
    assert main(["report", "--model", "ref-vit", "--n-images", "8", "--train-sae", "--sae-features", "32", "--sae-k",
                 "2", "--sae-epochs", "1", "--out", str(out), "--quiet"]) == 0
    section = ReportData.load(out.with_suffix(".json")).sae[0]
    assert section["features"].site == "blocks.3.hook_resid_post" and len(section["features"].frequency) == 32
