"""The space-time views' figures (issue 50; vitlens/figures/spacetime.py): hand-built results with known numbers,
checked in the traces the figures draw -- each panel draws the maps of its axis (a divided model's temporal maps in
time only, spatial maps in space only), seconds are frames / fps, the baselines are the result's, and the rollout
draws each time step's map as it is."""
from __future__ import annotations

import numpy as np
import pytest

from vitlens.errors import InvalidParameterError
from vitlens.figures import figure_for
from vitlens.figures.spacetime import (spacetime_compare_figure, spacetime_distance_figure, spacetime_rollout_figure,
                                       step_labels)
from vitlens.views.spacetime import SpaceTimeDistanceResult, SpaceTimeRolloutResult


def distance(roles: tuple[str, ...], fps: float | None, name: str = "m") -> SpaceTimeDistanceResult:
    n, heads = len(roles), 2
    step = 2 if "temporal" in roles else 1
    spatial = np.arange(n * heads, dtype=float).reshape(n, heads) + 1
    temporal = spatial / 10
    for i, role in enumerate(roles):  # the other distance of a divided block's map is 0 by construction
        if role == "temporal":
            spatial[i] = 0
        if role == "spatial":
            temporal[i] = 0
    return SpaceTimeDistanceResult(
        model=name, roles=roles, blocks=tuple(i // step for i in range(n)), spatial_px=spatial,
        within_px=spatial / 2, temporal_frames=temporal, spatial_std_px=spatial * 0, temporal_std_frames=temporal * 0,
        baseline_spatial_px=np.full(n, 9.0), baseline_within_px=np.full(n, 9.0),
        baseline_temporal_frames=np.full(n, 1.25), max_spatial_px=24.0, max_temporal_frames=3.0, n_clips=2, fps=fps)


def dots(fig, col: int) -> list:
    axis = "x" if col == 1 else "x2"
    return [t for t in fig.data if t.mode == "markers" and t.xaxis == axis]


def test_distance_figure_joint_and_divided() -> None:
    joint = distance(("joint", "joint"), fps=4.0)
    fig = figure_for(joint)  # registered for the result class
    (space,), (time,) = dots(fig, 1), dots(fig, 2)
    np.testing.assert_array_equal(space.y, joint.spatial_px.ravel())
    np.testing.assert_allclose(time.y, joint.temporal_frames.ravel() / 4.0)  # seconds
    assert "seconds" in fig.layout.yaxis2.title.text
    divided = distance(("temporal", "spatial", "temporal", "spatial"), fps=None)
    fig = spacetime_distance_figure(divided)
    (space,), (time,) = dots(fig, 1), dots(fig, 2)
    assert space.name == "spatial maps" and time.name == "temporal maps"
    np.testing.assert_array_equal(space.y, divided.spatial_px[[1, 3]].ravel())
    np.testing.assert_array_equal(time.y, divided.temporal_frames[[0, 2]].ravel())
    np.testing.assert_array_equal(space.x, [1, 1, 2, 2])  # blocks counted from 1
    assert "frames" in fig.layout.yaxis2.title.text and "by construction" in fig.layout.title.text
    base = [t for t in fig.data if t.mode == "lines" and t.xaxis == "x2"][0]
    assert np.nanmax(np.asarray(base.y, dtype=float)) == 1.25


def test_compare_figure() -> None:
    a, b = distance(("joint",) * 3, fps=8.0, name="a"), distance(("temporal", "spatial") * 2, fps=None, name="b")
    fig = spacetime_compare_figure([a, b], ["a", "b"])
    time = dots(fig, 2)
    assert [t.name for t in time] == ["a", "b"]
    np.testing.assert_array_equal(time[0].y, a.temporal_frames.ravel())  # frames: one model has no frame rate
    lines = {t.name: t.y[0] for t in fig.data if t.mode == "lines" and t.xaxis == "x"}
    assert lines == {"uniform attention (a)": 9.0, "uniform attention (b)": 9.0}
    with pytest.raises(InvalidParameterError):
        spacetime_compare_figure([a, b], ["a"])


def test_rollout_figure() -> None:
    maps = np.random.default_rng(0).random((2, 3, 2, 4))
    result = SpaceTimeRolloutResult(model="m", maps=maps, source_token="class", head_fusion="mean",
                                    time_centres=np.array([0.5, 2.5, 4.5]))
    fig = spacetime_rollout_figure(result, index=1)
    heat = [t for t in fig.data if t.type == "heatmap"]
    assert len(heat) == 3
    for s, t in enumerate(heat):
        np.testing.assert_array_equal(t.z, maps[1, s])
    assert [a.text for a in fig.layout.annotations] == ["frames 0-1", "frames 2-3", "frames 4-5"]
    frames = np.zeros((6, 16, 32, 3), np.uint8)
    over = spacetime_rollout_figure(result, frames=frames)
    assert sum(t.type == "image" for t in over.data) == 3
    assert step_labels(np.arange(3.0)) == ["frame 0", "frame 1", "frame 2"]
    with pytest.raises(InvalidParameterError):
        spacetime_rollout_figure(result, index=2)
