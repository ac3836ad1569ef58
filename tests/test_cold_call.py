"""Issue 52, one cold call: what the views hold across blocks caps the images per forward (rollout's maps at high
resolution), the same numbers per image; the grid's distance matrix built without float64 temporaries of its size,
the same numbers; the cold bench's phase breakdown (``analyses/bench_cold.py``), in-process on a small model."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.views.distance import AttentionDistanceAccumulator
from vitlens.engine import AttentionConsumer, stream_attention
from vitlens.engine import plan as plan_module
from vitlens.engine.plan import HELD_BLOCKS, HELD_FLOOR_MB, default_budget_mb, images_per_forward
from vitlens.views.distance import token_distance_matrix, whole_distances
from vitlens.views.rollout import RolloutAccumulator
from conftest import get_model

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def small():
    return get_model("vit_tiny_patch16_224", img_size=64, depth=2)


def test_images_per_forward_keeps_what_the_views_hold_within_the_forwards_own_activations():
    vit_b_rollout = lambda t: 4 * 11 * t * t  # noqa: E731  # L - 1 = 11 float32 maps of T x T per image
    assert images_per_forward(16, 197, 768, vit_b_rollout(197)) == 16  # 224 px: 1.7 MB an image, no split
    assert images_per_forward(4, 2305, 768, vit_b_rollout(2305)) == 1  # 768 px: 223 MB an image
    assert images_per_forward(2, 4097, 768, vit_b_rollout(4097)) == 1  # 1024 px: 704 MB an image
    assert images_per_forward(8, 4097, 768, 0) == 8  # nothing held: the caller's batch
    assert images_per_forward(1, 4097, 768, vit_b_rollout(4097)) == 1
    # the rule itself: as many images as fit in HELD_BLOCKS of the batch's MLP activations, never under the floor
    assert images_per_forward(5, 325, 192, 4 * 11 * 325 * 325) == 5  # 23 MB in all: under HELD_FLOOR_MB, no split
    budget = max(HELD_FLOOR_MB, HELD_BLOCKS * default_budget_mb(64, 577, 192)) * 2**20
    per_image = 4 * 11 * 577 * 577
    assert images_per_forward(64, 577, 192, per_image) == int(budget // per_image) < 64


def test_rollout_says_what_it_holds_per_image(small):
    t, layers = 17, small.spec.num_layers
    assert RolloutAccumulator.for_model(small).held_bytes_per_image(t) == 4 * (layers - 1) * t * t  # last streamed
    assert RolloutAccumulator.for_model(small, discard_ratio=0.5).held_bytes_per_image(t) == 4 * layers * t * t


class _Sizes(AttentionConsumer):
    def __init__(self) -> None:
        self.sizes: list[int] = []

    def begin_batch(self, batch) -> None:
        self.sizes.append(batch.size)

    def result(self, spec):
        return self.sizes


def _views(m, x, sizes: _Sizes):
    d, r = AttentionDistanceAccumulator.for_model(m.spec), RolloutAccumulator.for_model(m)
    stream_attention(m, x, [d, r, sizes], batch_size=len(x), capture_mode=None)
    return d.result(m.spec), r.result(m.spec)


def test_a_capped_batch_runs_in_sub_batches_with_the_same_numbers(small, monkeypatch):
    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    whole = _Sizes()
    d0, r0 = _views(small, x, whole)
    assert whole.sizes == [3]  # small maps: the caller's batch
    monkeypatch.setattr(plan_module, "HELD_BLOCKS", 1e-12)  # nothing fits: one image per forward
    monkeypatch.setattr(plan_module, "HELD_FLOOR_MB", 0.0)
    split = _Sizes()
    d1, r1 = _views(small, x, split)
    assert split.sizes == [1, 1, 1]
    # per image the same computation; only the batch's BLAS rounding differs
    np.testing.assert_allclose(r1.maps, r0.maps, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(r1.predictions, r0.predictions)
    np.testing.assert_allclose(d1.mean_px, d0.mean_px, rtol=1e-5)
    assert d1.n_images == d0.n_images == 3
    # a named capture is the caller's: no cap
    named = _Sizes()
    stream_attention(small, x, [RolloutAccumulator.for_model(small), named], batch_size=3, capture_mode="side")
    assert named.sizes == [3]


@pytest.mark.parametrize("grid, stride", [((14, 14), (16, 16)), ((5, 7), (16, 8)), ((3, 1), (14, 14)),
                                          ((40, 33), (16, 16))])
def test_the_whole_distance_matrix_has_the_float64_matrix_numbers_rounded_once(grid, stride):
    got = whole_distances.__wrapped__(grid, stride, torch.device("cpu"))  # built afresh, not from the cache
    assert got.dtype == torch.float32 and got.shape == (grid[0] * grid[1],) * 2
    assert torch.equal(got, token_distance_matrix(grid, stride).float())


def test_the_cold_bench_breaks_one_call_into_phases_in_process(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_cold", ROOT / "analyses" / "bench_cold.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import vitlens.core.native as native
    import vitlens.engine.stream as stream
    import vitlens.views.distance as distance
    import vitlens.views.rollout as rollout

    for module, name in ((native, "_load"), (stream, "capture_plan"), (distance, "whole_distances"),
                         (rollout, "rollout_row")):
        monkeypatch.setattr(module, name, getattr(module, name))  # the probe's wrappers are undone after the test
    out = bench.child("analyze", "vit_tiny_patch16_224", 32, 2, torch.get_num_threads(), 2, True, depth=2)
    assert out["row"] == "analyze" and len(out["calls"]) == 2
    for call in out["calls"]:
        ph = call["phases"]
        assert len(ph["block_seconds"]) == len(ph["block_faults"]) == 2  # one per block
        assert ph["capture_plan"] >= 0 and ph["rollout_chain"] >= 0
        # every figure is rounded to the millisecond (``blocks`` is the rounded sum of the rounded block times): the
        # parts may exceed the total by half a millisecond per rounding
        slack = (4 + len(ph["block_seconds"])) * 5e-4 + 1e-9
        assert 0 <= ph["before_blocks"] + ph["blocks"] + ph["after_blocks"] <= ph["total"] + slack
        assert call["seconds"] >= ph["blocks"]
    plain = bench.child("plain", "vit_tiny_patch16_224", 32, 2, torch.get_num_threads(), 1, False, depth=1)
    assert "phases" not in plain["calls"][0] and plain["calls"][0]["seconds"] > 0


def test_a_split_batch_keeps_the_callers_budget_for_its_row_blocks(small, monkeypatch):
    """Fewer images per forward hold rollout's maps; the probabilities' budget stays the caller's batch's MLP
    activation (``default_budget_mb`` at the asked batch), so the row blocks are not made smaller too. A budget the
    caller names is kept."""
    import vitlens.engine.stream as stream_module

    seen = []
    real = stream_module.capture_plan

    def recording(m, batch, **kwargs):
        seen.append((batch, kwargs.get("memory_budget_mb")))
        return real(m, batch, **kwargs)

    monkeypatch.setattr(stream_module, "capture_plan", recording)
    x = torch.randn(3, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    _views(small, x, _Sizes())
    assert seen == [(3, None)]  # no split: the plan's own default
    monkeypatch.setattr(plan_module, "HELD_BLOCKS", 1e-12)
    monkeypatch.setattr(plan_module, "HELD_FLOOR_MB", 0.0)
    seen.clear()
    _views(small, x, _Sizes())
    t = small.spec.num_tokens()
    assert seen == [(1, default_budget_mb(3, t, small.spec.embed_dim))]
    seen.clear()
    d, r = AttentionDistanceAccumulator.for_model(small.spec), RolloutAccumulator.for_model(small)
    stream_attention(small, x, [d, r], batch_size=3, capture_mode=None, memory_budget_mb=0.5)
    assert seen == [(1, 0.5)]
