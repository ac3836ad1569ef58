"""A view is a plug-in (issue 44, item 3): one ``register_view`` call, written here and nowhere else, and the view
is computed by ``analyze`` (from the one forward every attention view shares), drawn by ``figures.figure_for``, and
kept by a survey, whose shards merge through the view's own state (no class beside it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import plotly.graph_objects as go
import pytest
import torch

import vitlens as vl
from vitlens import figures
from vitlens.engine import AttentionConsumer, BatchInfo, query_rows
from vitlens.kinds import HIERARCHICAL
from vitlens.results import Result
from vitlens.survey import shapes_source
from vitlens.survey.stats import merge, read_state, survey_views
from vitlens.survey.store import table_rows
from vitlens.survey.worker import run_shard
from vitlens.views import registry


@dataclass(eq=False, repr=False)
class ParkedMassResult(Result):
    """Test-only view: each block's attention on the first token (the class token), per head, mean over images."""

    kind = "test_parked_mass"
    mean: np.ndarray  # [L, H]
    n_images: int

    def to_rows(self) -> list[dict]:
        return [{"layer": l + 1, "head": h + 1, "mass": float(self.mean[l, h])} for l, h in np.ndindex(*self.mean.shape)]


class ParkedMass(AttentionConsumer):
    """Known answer: the mean over patch queries of A[q, 0], summed over images per block and head; its state is
    the sums and the image count, which add up across shards."""

    def __init__(self, layers: int, heads: int) -> None:
        self.sums = np.zeros((layers, heads))
        self.n = np.zeros(layers, dtype=np.int64)

    def begin_batch(self, batch: BatchInfo) -> None:
        pass

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        start, _stop, last = query_rows(attn, rows)
        assert start == 0 and last  # whole maps at this size
        self.sums[layer] += attn[:, :, 1:, 0].double().mean(-1).sum(0).cpu().numpy()
        self.n[layer] += attn.shape[0]

    def result(self, spec: Any) -> ParkedMassResult:
        return ParkedMassResult(mean=self.sums / self.n[:, None], n_images=int(self.n[0]))

    def state(self) -> dict[str, np.ndarray]:
        return {"sums": self.sums, "n": self.n}

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> "ParkedMass":
        out = cls(*np.asarray(state["sums"]).shape)
        out.sums, out.n = np.asarray(state["sums"], dtype=np.float64), np.asarray(state["n"])
        return out

    def merge(self, other: "ParkedMass") -> "ParkedMass":
        out = ParkedMass(*self.sums.shape)
        out.sums, out.n = self.sums + other.sums, self.n + other.n
        return out

    def table_rows(self, spec: dict, classes: list[str], renormalize: bool = True) -> list[dict]:
        mean = self.sums / np.maximum(self.n, 1)[:, None]
        return [dict(metric="parked_mass", value=mean[l, h], n=int(self.n[l]), layer=l + 1, head=h + 1)
                for l, h in np.ndindex(*mean.shape)]


def parked_figure(result: ParkedMassResult) -> go.Figure:
    return go.Figure(go.Heatmap(z=result.mean))


@pytest.fixture()
def toy_view():
    """The toy view, registered for one test and taken out again (the registry is the process's)."""
    before = dict(registry.VIEWS)
    view = registry.register_view(registry.View(
        "parked", "Attention parked on the class token", "", "attention",
        lambda m, p: ParkedMass(m.spec.num_layers, m.spec.num_heads), ParkedMassResult, default=False,
        label="Parked mass", draw=parked_figure,
        survey=registry.SurveyStat("each head's attention on the class token", ParkedMass.from_state)))
    yield view
    registry.VIEWS.clear()
    registry.VIEWS.update(before)


def test_a_view_registered_as_a_default_is_computed_by_analyze_without_views(tiny):
    """The registry is read when analyze is called, not when it was imported: a default view registered later is
    computed by ``vl.analyze(m, x)`` (its default views), and leaves with the registration."""
    before = dict(registry.VIEWS)
    try:
        registry.register_view(registry.View(
            "parked_default", "Attention parked on the class token", "", "attention",
            lambda m, p: ParkedMass(m.spec.num_layers, m.spec.num_heads), ParkedMassResult, default=True,
            draw=parked_figure))
        assert "parked_default" in registry.DEFAULT_VIEWS and "parked_default" in registry.default_views()
        x = torch.rand(2, 3, 224, 224)
        a = vl.analyze(tiny, x, n_components=2)
        assert "parked_default" in a.views and a.view("parked_default").n_images == 2
        direct = ParkedMass(tiny.spec.num_layers, tiny.spec.num_heads)
        vl.stream_attention(tiny, x, [direct])
        np.testing.assert_allclose(a.view("parked_default").mean, direct.result(tiny.spec).mean, rtol=1e-5)
    finally:
        registry.VIEWS.clear()
        registry.VIEWS.update(before)
    assert "parked_default" not in registry.DEFAULT_VIEWS and "parked_default" not in vl.analyze(
        tiny, torch.rand(1, 3, 224, 224), n_components=2).views


@pytest.mark.parametrize("name", ["notes", "spec", "views", "others", "position_note", "summary", "save", "kind",
                                  "_hidden", "two words", ""])
def test_a_view_may_not_take_a_name_the_analysis_result_holds_something_else_under(name):
    view = registry.View(name, "t", "", "weights", lambda m, p: None, ParkedMassResult, default=False)
    with pytest.raises(vl.InvalidParameterError, match="pick another name"):
        registry.register_view(view)
    assert name not in registry.VIEWS


def test_a_registered_view_is_computed_drawn_and_surveyed(tiny, toy_view):
    assert "parked" in registry.VIEW_NAMES and "parked" not in registry.DEFAULT_VIEWS
    assert registry.check_views(("distance", "parked")) == ("distance", "parked")
    assert list(survey_views()) == ["distance", "rollout", "parked", "predictions", "components", "spacetime",
                                    "weights"]
    # computed: from the same forward as the distance, with the known answer
    source = shapes_source(4)
    images = source.read(source.shards(4)[0])[0]
    a = vl.analyze(tiny, images, batch_size=2, views=("distance", "parked"))
    direct = ParkedMass(tiny.spec.num_layers, tiny.spec.num_heads)
    vl.stream_attention(tiny, images, [direct], batch_size=4)
    np.testing.assert_allclose(a.view("parked").mean, direct.result(tiny.spec).mean, rtol=1e-5)
    assert a.view("parked").n_images == 4
    # drawn: by its own draw function, through the one entry point the report and the app use
    fig = figures.figure_for(a.view("parked"))
    assert isinstance(fig, go.Figure) and np.allclose(np.asarray(fig.data[0].z), a.view("parked").mean)
    # surveyed: two shards' states merge into the states of one shard over the same images
    halves = [run_shard(tiny, source, s, ("parked", "distance"), batch_size=2)["states"] for s in source.shards(2)]
    whole = run_shard(tiny, source, source.shards(4)[0], ("parked", "distance"), batch_size=2)["states"]
    merged = merge(*halves)
    assert type(read_state("parked", merged["parked"])) is ParkedMass
    np.testing.assert_allclose(merged["parked"]["sums"], whole["parked"]["sums"], rtol=1e-12)
    np.testing.assert_array_equal(merged["parked"]["n"], [4] * tiny.spec.num_layers)
    rows = table_rows("tiny", tiny.spec.to_dict(), merged, 4, list(source.classes), {})
    parked = [r for r in rows if r["metric"] == "parked_mass"]
    assert len(parked) == tiny.spec.num_layers * tiny.spec.num_heads
    np.testing.assert_allclose([r["value"] for r in parked], a.view("parked").mean.ravel(), rtol=1e-5)


def test_a_view_not_defined_for_a_kind_is_not_surveyed_for_it(tiny, toy_view, monkeypatch):
    stat = survey_views()["parked"]
    view = registry.VIEWS["parked"]
    assert stat.build is not None and stat.describes == view.survey.describes
    assert view.kinds == ("vit", "hybrid")  # no readers of its own: the kinds whose maps are one token sequence
    assert stat.build(tiny, 0, True) is not None  # a ViT: defined
    windowed = SimpleNamespace(spec=dataclasses.replace(tiny.spec, kind=HIERARCHICAL.name))
    assert survey_views()["parked"].build(windowed, 0, True) is None  # a hierarchical model's: not defined


def test_register_view_refuses_a_taken_name_and_an_unknown_kind(toy_view):
    with pytest.raises(vl.InvalidParameterError, match="'parked' is registered already"):
        registry.register_view(toy_view)
    with pytest.raises(vl.InvalidParameterError, match="says 'gradients'"):
        registry.register_view(registry.View("g", "G", "", "gradients", lambda m, p: None, ParkedMassResult))
    assert registry.register_view(toy_view, replace=True) is toy_view


def test_figure_for_draws_every_result_type_it_knows_and_says_what_it_cannot():
    class Nothing:
        pass

    with pytest.raises(vl.InvalidParameterError, match="No figure draws a Nothing"):
        figures.figure_for(Nothing())
    with pytest.raises(vl.InvalidParameterError, match="empty list"):
        figures.figure_for([])
    # the attribution, metric, CKA and sanity results are registered drawers too
    from vitlens.attribution import (AttributionResult, ComparisonTable, FaithfulnessResult, SanityResult)
    from vitlens.attribution.perturbation import PerturbationResult, RoadResult
    from vitlens.compare import CKAResult

    for t in (AttributionResult, ComparisonTable, FaithfulnessResult, SanityResult, PerturbationResult, RoadResult,
              CKAResult):
        assert figures.drawer_for(t) is not None, t.__name__


def test_rollout_sources_say_whether_a_model_pools_through_an_attention_pool(tiny):
    """The library says which rows rollout can start from (the app asked by opening a pool capture itself)."""
    import timm

    assert vl.rollout_sources(tiny) == (None,)  # a class token: no attention pool
    torch.manual_seed(0)
    module = timm.create_model("vit_base_patch16_siglip_224", pretrained=False, img_size=32, patch_size=8,
                               embed_dim=32, depth=2, num_heads=2, num_classes=5)
    m = vl.LoadedModel.from_module(module, name="tiny-siglip-map", device="cpu")
    assert vl.rollout_sources(m) == (None, "pool")
    hooks = sum(len(b._forward_hooks) + len(b._forward_pre_hooks) for b in m.model.modules())
    r = vl.attention_rollout(m, torch.randn(1, 3, 32, 32), source=vl.rollout_sources(m)[-1])
    assert r.source_token == "attention pool"
    assert sum(len(b._forward_hooks) + len(b._forward_pre_hooks) for b in m.model.modules()) == hooks
