"""One registry of views (``vitlens.views.registry``): every place that offers views reads it, a
new view is one entry, and a survey's statistics are ordinary consumers that travel as states."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

import vitlens as vl
from vitlens import figures
from vitlens import cli
from vitlens.report.html import model_figures, model_section
from vitlens.results import Result
from vitlens.survey import shapes_source
from vitlens.survey.stats import SURVEY_VIEW_NAMES, SURVEY_VIEWS, Predictions, RolloutStats, merge, read_state
from vitlens.survey.worker import run_shard
from vitlens.views import registry
from vitlens.views.analyze import VIEWS as ANALYZE_VIEWS
from vitlens.engine import AttentionConsumer
from vitlens.views.distance import AttentionDistanceAccumulator
from vitlens.views.rollout import RolloutAccumulator


def test_analyze_the_command_line_and_the_survey_offer_the_registry_views():
    # "VIEWS" is one thing: the registry, which analyze reads at call time (not a snapshot of its names)
    assert ANALYZE_VIEWS is registry.VIEWS
    assert tuple(registry.VIEWS) == registry.VIEW_NAMES == ("filters", "position", "relpos", "distance", "rollout",
                                                            "prefix", "video_filters", "video_position",
                                                            "spacetime_distance", "spacetime_rollout")
    assert registry.DEFAULT_VIEWS == ("filters", "position", "distance", "rollout")  # the paper's four
    # the survey's list is the views' own statistics (``View.survey``, in the registry's order), then its own
    assert SURVEY_VIEW_NAMES == tuple(SURVEY_VIEWS) == ("distance", "rollout", "predictions", "components", "spacetime",
                                                        "weights")
    for name in ("distance", "rollout"):
        assert SURVEY_VIEWS[name].from_state is registry.VIEWS[name].survey.from_state, name
    assert SURVEY_VIEWS["rollout"].from_state == RolloutStats.from_state
    assert SURVEY_VIEWS["predictions"].from_state == Predictions.from_state and SURVEY_VIEWS["weights"].build is None
    assert all(isinstance(v.result_type, type) for v in registry.VIEWS.values())
    survey = cli.build_parser()._subparsers._group_actions[0].choices["survey"]  # type: ignore[union-attr]
    views = next(a for a in survey._actions if a.dest == "views")
    assert list(views.choices) == list(SURVEY_VIEW_NAMES) and views.default is None  # None: the default views (cmd_survey)
    with pytest.raises(vl.InvalidParameterError, match="views must be among filters, position, relpos, distance"):
        registry.check_views(("distance", "nope"))


def test_every_view_gives_its_declared_result_and_its_figure_draws_it(tiny):
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    a = vl.analyze(tiny, x, views=registry.VIEW_NAMES, n_components=4)
    for name, view in registry.VIEWS.items():
        if name in a.notes:  # a weight view this model does not have (a ViT has no relative-position bias), or a
            assert a.view(name) is None and (view.kind == "weights" or view.for_kind is not None), name  # video view
        else:
            assert isinstance(a.view(name), view.result_class()), name
        assert view.result_type in figures.DRAWERS, view.name  # its figure, registered by its result class
    # tests/test_relpos_view.py gives relpos a model that has one, tests/test_video_report.py the video views
    video = {"video_filters", "video_position", "spacetime_distance", "spacetime_rollout"}
    assert set(a.notes) == {"relpos"} | video
    figs = model_figures(a, [np.zeros((224, 224, 3), dtype=np.uint8)] * 2)
    assert set(figs) == set(registry.VIEW_NAMES) - {"prefix", "relpos"} - video | ({"prefix"} if a.prefix.labels
                                                                                 else set())
    assert all(isinstance(f, go.Figure) for f in figs.values())


@dataclass(eq=False, repr=False)
class QueryCountResult(Result):
    """Test-only view: how many query rows each block's attention had, and their total mass."""

    kind = "test_query_count"
    rows: np.ndarray
    mass: np.ndarray

    def to_rows(self) -> list[dict]:
        return [{"layer": i + 1, "rows": int(r), "mass": float(w)} for i, (r, w) in enumerate(zip(self.rows, self.mass))]


class QueryCounter(AttentionConsumer):
    """Known answers: every block has T query rows per image, and each row sums to 1."""

    def __init__(self, layers: int) -> None:
        self.rows = np.zeros(layers, dtype=np.int64)
        self.mass = np.zeros(layers)

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        self.rows[layer] += attn.shape[0] * attn.shape[-2]
        self.mass[layer] += float(attn.double().sum())

    def result(self, spec) -> QueryCountResult:
        return QueryCountResult(rows=self.rows.copy(), mass=self.mass.copy())


def test_a_new_view_is_one_registry_entry_and_shares_the_one_forward(tiny, monkeypatch):
    toy = registry.View("queries", "Query rows per block", "", "attention",
                        lambda m, p: QueryCounter(m.spec.num_layers), QueryCountResult,
                        default=False, label="Queries")
    monkeypatch.setitem(registry.VIEWS, "queries", toy)
    monkeypatch.setitem(figures.DRAWERS, QueryCountResult, figures.Drawer(lambda r: go.Figure(go.Bar(y=r.rows))))
    x = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    calls = []
    handle = tiny.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        a = vl.analyze(tiny, x, batch_size=2, views=("distance", "queries"))
    finally:
        handle.remove()
    assert len(calls) == 2  # one forward per batch for both attention views
    t = 1 + 14 * 14
    np.testing.assert_array_equal(a.view("queries").rows, np.full(tiny.spec.num_layers, 3 * t))
    np.testing.assert_allclose(a.view("queries").mass, 3 * t * tiny.spec.num_heads, rtol=1e-5)
    assert a.distance.equals(vl.attention_distance(tiny, x, batch_size=2), rtol=1e-12)
    figs = model_figures(a, [])
    assert set(figs) == {"distance", "queries"}
    with pytest.raises(vl.InvalidParameterError, match="No view 'nope'"):
        a.view("nope")
    page = model_section(a, figs, {})
    assert "<h3>Query rows per block</h3>" in page and "Mean attention distance (Fig. 7 right)" in page
    assert "Embedding filters" not in page  # a view not asked for has no section


def test_survey_statistics_travel_as_states_and_merge_through_their_consumers(tiny):
    source = shapes_source(6)
    views = ("distance", "rollout", "predictions")
    halves = [run_shard(tiny, source, s, views, batch_size=3)["states"] for s in source.shards(3)]
    whole = run_shard(tiny, source, source.shards(6)[0], views, batch_size=3)["states"]
    for name in views:
        state = halves[0][name]
        back = read_state(name, state).state()
        assert set(back) == set(state) and all(np.array_equal(back[k], state[k]) for k in state), name
    merged = merge(*halves)
    np.testing.assert_allclose(merged["distance"]["mean"], whole["distance"]["mean"], rtol=1e-6)
    np.testing.assert_allclose(merged["distance"]["class_mean"], whole["distance"]["class_mean"], rtol=1e-6, atol=1e-9)
    # the old RolloutStats inherited RolloutAccumulator.merge, which dropped its sums: they now add up
    np.testing.assert_allclose(merged["rollout"]["sums"], halves[0]["rollout"]["sums"] + halves[1]["rollout"]["sums"])
    np.testing.assert_array_equal(merged["rollout"]["counts"], whole["rollout"]["counts"])
    np.testing.assert_array_equal(merged["predictions"]["total"], whole["predictions"]["total"])
    assert not issubclass(RolloutStats, RolloutAccumulator)  # it feeds one; it reads none of its fields
    # the distance view's own accumulator is the survey's state: no second class beside it
    assert type(read_state("distance", merged["distance"])) is AttentionDistanceAccumulator
    d = read_state("distance", merged["distance"]).result("tiny")
    assert d.n_images == 6 and d.grid == (14, 14)


def test_a_consumers_own_hooks_are_removed_when_the_pass_fails(tiny, tmp_path):
    good = tmp_path / "good.png"
    vl.sample_images(["chelsea"])[0].save(good)
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8 broken")
    before = [len(b._forward_hooks) for b in tiny.blocks()]
    with pytest.raises(vl.ImageLoadError, match="bad.jpg"):
        vl.prefix_diagnostics(tiny, [good, good, bad], batch_size=2)  # fails in the second batch
    assert [len(b._forward_hooks) for b in tiny.blocks()] == before
    r = vl.prefix_diagnostics(tiny, [good, good], batch_size=2)
    assert r.n_images == 2 and np.isfinite(r.prefix_norm).all()


def test_each_survey_statistic_says_its_table_rows(tiny):
    source = shapes_source(4)
    states = run_shard(tiny, source, source.shards(4)[0], ("distance", "rollout", "predictions"), batch_size=4)["states"]
    spec = tiny.spec.to_dict()
    classes = list(source.classes)
    d = read_state("distance", states["distance"]).table_rows(spec, classes)
    layers, heads = tiny.spec.num_layers, tiny.spec.num_heads
    overall = [r for r in d if r.get("cls") is None]
    assert len(overall) == 1 + 3 * layers * heads and overall[0]["metric"] == "uniform_distance_px"
    direct = vl.attention_distance(tiny, source.read(source.shards(4)[0])[0], batch_size=4)
    means = [r["value"] for r in overall if r["metric"] == "mean_distance_px"]
    np.testing.assert_allclose(means, direct.mean_px.ravel(), rtol=1e-6)
    r = RolloutStats.from_state(states["rollout"]).table_rows(spec, classes)
    assert [row["metric"] for row in r] == ["rollout_prefix_mass", "rollout_entropy", "rollout_mass_in_mask"]
    p = Predictions.from_state(states["predictions"]).table_rows(spec, classes)
    assert p[0]["metric"] == "accuracy" and p[0]["n"] == 4 and sum(row["n"] for row in p[1:]) == 4
