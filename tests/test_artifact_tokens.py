"""analyses/artifact_tokens.py (issue 51, item 4): token norms of a ViT without and with registers on the sample
photos and the shape scenes, one offline HTML page and a CSV; the numbers are ``vl.token_norms``'s on the same
model and images; offline without weights it stops in one line and writes nothing."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import vitlens as vl

ROOT = Path(__file__).resolve().parents[1]
PAIR = ("vit_small_patch14_dinov2", "vit_small_patch14_reg4_dinov2")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("artifact_tokens_script", ROOT / "analyses" / "artifact_tokens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_and_table_hold_token_norms_of_both_models(script, tmp_path):
    out = tmp_path / "at.html"
    assert script.main(["--models", *PAIR, "--random-init", "--img-size", "56", "--n-scenes", "2", "--no-samples",
                        "--out", str(out)]) == 0
    page = out.read_text()
    assert page.count("plotly.js v") == 1 and "<script src=" not in page  # inlined once, offline
    assert "Untrained weights" in page and PAIR[0] in page and PAIR[1] in page
    table = pd.read_csv(out.with_suffix(".csv"))
    images, _ = script.images_of(script.parse(["--n-scenes", "2", "--no-samples"]))
    for name in PAIR:
        torch.manual_seed(0)
        want = vl.token_norms(vl.load_model(name, pretrained=False, img_size=56), images)
        got = table[table.model == name]
        assert len(got) == 2 * want.norms.shape[1]  # a row per (image, depth)
        np.testing.assert_allclose(got["max_norm"].to_numpy(), want.norms.max(-1).reshape(-1), rtol=1e-12)
        registers = got["register_attention"].to_numpy()[1:]
        assert np.isnan(registers).all() == (want.num_registers == 0)
    assert {r["registers"] for r in script.summary_rows(PAIR[1], want, ["a", "b"])} == {4}


def test_without_weights_offline_it_stops_in_one_line_and_writes_nothing(script, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "at.html"
    assert script.main(["--models", "vit_small_patch14_dinov2.lvd142m", "--n-scenes", "1", "--no-samples",
                        "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--random-init" in err[0] and "vit_small_patch14_dinov2.lvd142m" in err[0]
    assert list(tmp_path.iterdir()) == []
