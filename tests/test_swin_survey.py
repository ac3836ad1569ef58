"""Surveys of a hierarchical model (issue 32): the windowed distance and rollout statistics of a tiny Swin merge
exactly across shards in any order, equal one process's ``vl.attention_distance``, and say each row's stage in
the tidy table (per head, per block, per stage)."""
from __future__ import annotations

import numpy as np
import pytest

import vitlens as vl
from vitlens.views.windowed import WindowedDistanceResult
from vitlens.survey import shapes_source
from vitlens.survey.sources import Shard
from vitlens.survey.stats import merge, read_state
from vitlens.survey.store import distance_result, table_rows, write_table
from vitlens.survey.worker import run_shard

from test_swin import load, tiny_swin

N = 7
VIEWS = ("distance", "rollout", "predictions")


@pytest.fixture(scope="module")
def swin():
    return load(tiny_swin())


@pytest.fixture(scope="module")
def whole(swin):
    source = shapes_source(N)
    # one image a batch, here and in the shards below: an image's float32 maps then do not depend on which images
    # share its batch (another CPU's BLAS may round a batch of 4 and of 2 differently), so the merges are checked
    # to float64 rounding alone
    return source, run_shard(swin, source, Shard(0, 0, N), VIEWS, batch_size=1)["states"]


def test_windowed_statistics_merge_exactly_whatever_the_shards_and_their_order(swin, whole):
    source, states = whole
    assert "window_uniform_px" in states["distance"]
    parts = [run_shard(swin, source, s, VIEWS, batch_size=1)["states"] for s in source.shards(3)]
    for order in (parts, parts[::-1]):
        merged = order[0]
        for p in order[1:]:
            merged = merge(merged, p)
        for key in ("mean", "m2", "class_mean", "class_m2"):
            np.testing.assert_allclose(merged["distance"][key], states["distance"][key], rtol=1e-9, atol=1e-9)
        np.testing.assert_array_equal(merged["distance"]["class_n"], states["distance"]["class_n"])
        assert int(merged["distance"]["n"]) == N
        np.testing.assert_allclose(merged["rollout"]["sums"], states["rollout"]["sums"], rtol=1e-9)
        np.testing.assert_array_equal(merged["rollout"]["counts"], states["rollout"]["counts"])


def test_the_survey_distance_is_the_one_process_windowed_distance(swin, whole):
    source, states = whole
    images, labels, _masks, _skipped = source.read(Shard(0, 0, N))
    direct = vl.attention_distance(swin, images, batch_size=1)
    merged = distance_result(states, swin.spec.to_dict(), "tiny-swin")
    assert isinstance(merged, WindowedDistanceResult)
    np.testing.assert_allclose(merged.mean_px, direct.mean_px, rtol=1e-9)
    np.testing.assert_allclose(merged.window_uniform_px, direct.window_uniform_px)
    assert merged.kinds == direct.kinds and merged.n_images == N
    np.testing.assert_array_equal(merged.stages, direct.stages)
    # per class: the mean over that class's images
    for c in np.unique(labels):
        one = vl.attention_distance(swin, [im for im, l in zip(images, labels) if l == c], batch_size=1)
        np.testing.assert_allclose(np.asarray(states["distance"]["class_mean"])[c],
                                   np.nan_to_num(one.mean_px, nan=0.0), rtol=1e-9, atol=1e-12)


def test_the_table_names_each_rows_stage_and_a_stage_row_is_the_mean_of_its_heads(swin, whole, tmp_path):
    import pandas as pd

    source, states = whole
    rows = table_rows("tiny-swin", swin.spec.to_dict(), states, N, list(source.classes), {})
    write_table(tmp_path, rows)
    table = pd.read_parquet(tmp_path / "table.parquet")
    assert str(table["stage"].dtype) == "Int64"
    d = read_state("distance", states["distance"]).result()
    heads = table[(table.metric == "mean_distance_px") & table["class"].isna() & table["layer"].notna()]
    assert len(heads) == int(np.isfinite(d.mean_px).sum())
    assert sorted(heads["stage"].unique().tolist()) == [1, 2, 3]
    stage_rows = table[(table.metric == "mean_distance_px") & table["layer"].isna() & table["stage"].notna()]
    for _, row in stage_rows.iterrows():
        assert row["value"] == pytest.approx(np.nanmean(d.mean_px[d.stages == row["stage"] - 1]))
        assert row["value"] == pytest.approx(heads[heads.stage == row["stage"]]["value"].mean())
    of_window = table[(table.metric == "mean_distance_of_window") & table["layer"].notna()]
    np.testing.assert_allclose(of_window["value"].to_numpy(), d.of_window[np.isfinite(d.of_window)])
    # a ViT's rows leave the stage empty
    assert rows[-1]["metric"] == "images_used" and rows[-1]["stage"] is None


def test_the_survey_page_draws_a_hierarchical_model_beside_a_vit(swin, whole, tmp_path):
    """The survey report's figures and summary read a Swin's table (its per-stage rows have no head)."""
    from vitlens.report.survey import depth_figure, layer1_figure, summary_rows
    from vitlens.survey.store import SurveyResult

    import pandas as pd

    source, states = whole
    spec = swin.spec.to_dict()
    rows = table_rows("tiny-swin", spec, states, N, list(source.classes), {}, weights="random init")
    write_table(tmp_path, rows)
    manifest = {"models": {"a": {"name": "tiny-swin", "label": "tiny-swin", "status": "done", "spec": spec,
                                 "weights": "random init", "key": "a"}}, "source": source.to_dict()
                if hasattr(source, "to_dict") else {}}
    result = SurveyResult(tmp_path, pd.read_parquet(tmp_path / "table.parquet"), manifest)
    trace = depth_figure(result).data[0]
    assert len(trace.x) == swin.spec.num_layers and "hierarchical" in trace.name
    assert len(layer1_figure(result).data[0].y) == 2  # block 1's two heads
    (summary,) = summary_rows(result)
    assert summary["kind"] == "hierarchical" and summary["images"] == N
