"""Results round-trip through JSON and npz; figures are pure functions of results; ``analyze``
computes distance and rollout from one forward per batch."""
from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

import vitlens as vl
from vitlens.views.position import PositionSimilarityResult
from vitlens.views.rollout import RolloutResult
from vitlens import figures
from vitlens.results import atomic_write_bytes


@pytest.fixture(scope="module")
def analysis(tiny):
    x = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    return vl.analyze(tiny, x, batch_size=2, n_components=6)


@pytest.mark.parametrize("suffix", [".json", ".npz"])
def test_every_result_round_trips(tmp_path, analysis, suffix):
    for name, res in [("filters", analysis.filters), ("position", analysis.position),
                      ("distance", analysis.distance), ("rollout", analysis.rollout)]:
        path = res.save(tmp_path / f"{name}{suffix}")
        back = vl.load_result(path)
        assert type(back) is type(res) and back.equals(res), name
        assert type(res).load(path).equals(res)
    whole = vl.load_result(analysis.save(tmp_path / f"all{suffix}"))
    assert whole.equals(analysis)


def test_loading_a_result_as_another_kind_is_refused(tmp_path, analysis):
    p = analysis.distance.save(tmp_path / "d.json")
    with pytest.raises(vl.InvalidParameterError, match="attention_distance"):
        RolloutResult.load(p)
    with pytest.raises(vl.InvalidParameterError, match=".json or .npz"):
        analysis.distance.save(tmp_path / "d.csv")


def test_atomic_write_leaves_the_old_file_when_writing_fails(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("good")

    with pytest.raises(TypeError):
        atomic_write_bytes(target, 12345)  # type: ignore[arg-type]  # fails mid-write
    assert target.read_text() == "good"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_analyze_runs_one_forward_per_batch_and_matches_the_single_views(tiny):
    x = torch.randn(5, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    calls = []
    handle = tiny.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        r = vl.analyze(tiny, x, batch_size=2, n_components=4, discard_ratio=0.3)
    finally:
        handle.remove()
    assert len(calls) == 3  # ceil(5 / 2)
    assert r.distance.equals(vl.attention_distance(tiny, x, batch_size=2), rtol=1e-12)
    assert r.rollout.equals(vl.attention_rollout(tiny, x, discard_ratio=0.3, batch_size=2), rtol=1e-12)
    assert r.position.equals(vl.position_similarity(tiny))
    assert r.filters.equals(vl.embedding_filter_pca(tiny, 4))


def test_analyze_without_position_embedding_says_why():
    from conftest import get_model

    m = get_model("vit_tiny_patch16_224", pos_embed="none")
    r = vl.analyze(m, torch.randn(1, 3, 224, 224), n_components=3)
    assert r.position is None and "not available" in r.position_note


def test_filters_figure_shows_each_component_as_an_rgb_image(analysis):
    fig = figures.filters_figure(analysis.filters)
    assert len(fig.data) == 6 and all(isinstance(t, go.Image) for t in fig.data)
    assert fig.data[0].z.shape == (16, 16, 3)
    titles = [a.text for a in fig.layout.annotations]
    assert titles[0].startswith("PC1 ") and titles[0].endswith("%")


def test_component_rgb_scales_each_component_to_the_full_range():
    comp = np.stack([np.full((2, 2), -1.0), np.full((2, 2), 0.0), np.array([[0.0, 1.0], [1.0, 0.5]])])
    img = figures.component_rgb(comp)
    assert img.min() == 0 and img.max() == 255 and img.shape == (2, 2, 3)


def test_position_mosaic_places_tile_r_c_at_its_block():
    sim = np.arange(2 * 3 * 2 * 3, dtype=float).reshape(2, 3, 2, 3)
    res = PositionSimilarityResult(similarity=sim, grid=(2, 3), model_grid=(2, 3), resized=False)
    mosaic, coords = figures.position_mosaic(res)
    assert mosaic.shape == (2 * 3 - 1, 3 * 4 - 1)
    np.testing.assert_array_equal(mosaic[3:5, 4:7], sim[1, 1])
    assert np.isnan(mosaic[2]).all() and np.isnan(mosaic[:, 3]).all()
    assert coords[3, 5].tolist() == [1, 1, 0, 1]
    assert isinstance(figures.position_figure(res).data[0], go.Heatmap)


def test_distance_figure_has_one_dot_per_head_per_model(analysis):
    fig = figures.distance_figure([analysis.distance, analysis.distance], names=["vit", "hybrid"])
    assert [t.name for t in fig.data if t.mode == "markers"] == ["vit", "hybrid"]
    assert len(fig.data[0].x) == 12 * 3
    assert "layer %{customdata[0]}, head %{customdata[1]}" in fig.data[0].hovertemplate
    widths = figures.distance_figure(analysis.distance, units="width")
    np.testing.assert_allclose(widths.data[0].y, analysis.distance.mean_px.ravel() / 224)


def test_rollout_figure_overlays_the_map_on_the_image(analysis):
    image = np.zeros((224, 224, 3), np.uint8)
    fig = figures.rollout_figure(analysis.rollout, image, index=1, opacity=0.4)
    assert isinstance(fig.data[0], go.Image) and isinstance(fig.data[1], go.Heatmap)
    # one cell per token over the token's 16 x 16 pixels (issue 45: tokens drawn as tokens)
    assert fig.data[1].z.shape == (14, 14) and fig.data[1].opacity == 0.4 and fig.data[1].dx == 16
    np.testing.assert_array_equal(fig.data[1].z, analysis.rollout.maps[1])


def test_upsampling_keeps_a_constant_map_constant():
    np.testing.assert_allclose(figures.upsample_map(np.full((3, 4), 0.25), (30, 40)), 0.25)
