"""Issue 67: the bench's phase table (``analyses/bench_phases.py``, ``bench.py --phase-table``) and the cold bench's
base with the MLP's buffers (``bench_cold.py --base plain_mlp_buffers``), in-process on small models: the rows'
structure, positive phase times that nest as the table says, bytes counted from what the consumers were handed.
Not timings."""
from __future__ import annotations

import importlib.util
import math
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "analyses" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def phases():
    return _module("bench_phases")


def _by_phase(r: dict) -> dict:
    return {row["phase"]: row for row in r["phases"]}


@pytest.mark.parametrize("native", ["0", pytest.param("1", marks=pytest.mark.skipif(
    shutil.which("g++") is None, reason="no C++ compiler (g++) to build the kernels"))])
def test_the_phase_table_splits_the_views_call_into_phases_that_nest_within_it(phases, monkeypatch, native):
    """A 2-block ViT-tiny at 64 px (T = 17), batch 2, one repetition; ``VITLENS_COMPILE=1`` takes the native softmax
    pass with the views' taps (the path of 1,024 tokens and more), ``0`` the eager one (below)."""
    import vitlens.core.attention as attention

    monkeypatch.setenv("VITLENS_COMPILE", native)
    before = attention.attention_probs
    r = phases.run("vit_tiny_patch16_224", 64, 2, 1, depth=2)
    assert attention.attention_probs is before  # the clock's wrappers are removed after
    assert r["base"] == "plain_mlp_buffers" and set(r["seconds"]) == {"plain_mlp_buffers", "views"}
    assert r["tokens"] == 17 and r["layers"] == 2 and r["bandwidth_gb_s"] > 0
    assert all(v > 0 for vs in r["seconds"].values() for v in vs)
    lo, hi = r["ratio_spread"]
    assert lo <= r["ratio"] <= hi
    # every layer's probabilities were handed to distance once: L x B x heads x T^2 float32
    assert r["probs_bytes"] == 2 * 2 * 3 * 17 ** 2 * 4
    assert (r["fused_passes"] > 0) == (native == "1") == r["pass_split"]["native"]
    rows = _by_phase(r)
    assert {"qk_product", "softmax_pass", "distance_sums", "head_mean", "pv_product_and_copies", "rollout_chain",
            "rest_over_base"} <= set(rows)
    clock = r["views_clock"]
    for key in ("attention_rows", "scores_softmax", "distance_reading", "rollout_reading", "rollout_chain"):
        assert clock[key] > 0, key
    # the phases inside the attention add up to it (the clock's nesting; rounding to 0.1 ms each)
    inside = sum(rows[k]["seconds"] for k in ("qk_product", "softmax_pass", "distance_sums", "head_mean",
                                              "pv_product_and_copies", "rollout_store"))
    inside += rows.get("consumers_other", {"seconds": 0.0})["seconds"]
    assert inside == pytest.approx(clock["attention_rows"], abs=1e-3 + 0.1 * clock["attention_rows"])
    assert clock["attention_rows"] <= min(r["seconds"]["views"]) + 1e-3
    assert r["base_phases"]["fused_attention"] > 0  # the plain forward's SDPA, timed
    # the least bytes follow from the probabilities' bytes S: q k^T writes S, the softmax reads and writes it
    s = r["probs_bytes"]
    assert rows["qk_product"]["least_bytes"] == s and rows["softmax_pass"]["least_bytes"] == 2 * s
    assert rows["softmax_pass"]["bound_seconds"] == pytest.approx(2 * s / (r["bandwidth_gb_s"] * 1e9), abs=1e-4)
    split = r["pass_split"]["seconds_per_layer_forward"]
    assert set(split) == {"softmax", "softmax_distance", "softmax_distance_mean"} and min(split.values()) > 0
    assert "vit_tiny_patch16_224 at 64 px" in phases.format_table(r)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) to build the kernels")
def test_where_the_softmax_pass_writes_rollouts_float16_maps_the_store_is_its_share(phases, monkeypatch):
    """Float16 maps at 17 tokens (``HALF_ABOVE_MB`` set to 0: the rule of 1024 px on a ViT-B), the native pass: the
    views' passes write the float16 maps (no ``store_half``), the split times that variant, and the head mean's share
    is its increment, the store included; the store as a pass of its own needs no bytes and took none."""
    import vitlens.views.rollout_store as rollout_store

    monkeypatch.setenv("VITLENS_COMPILE", "1")
    monkeypatch.setattr(rollout_store, "HALF_ABOVE_MB", 0.0)
    r = phases.run("vit_tiny_patch16_224", 64, 2, 1, depth=2)
    assert r["rollout_maps"] == "float16" and r["half_passes"] > 0 and r["half_passes"] <= r["fused_passes"]
    split = r["pass_split"]
    assert split["native"] and "head_mean_half" in split
    assert split["seconds_per_layer_forward"]["softmax_distance_half_mean"] > 0
    rows = _by_phase(r)
    assert rows["rollout_store"]["seconds"] == 0 and rows["rollout_store"]["least_bytes"] == 0
    assert "rollout_store" not in r["views_clock"]  # store_half was not called
    s, heads = r["probs_bytes"], r["heads"]
    assert rows["head_mean"]["least_bytes"] == s // heads // 2  # the mean written once, in float16
    per = split["seconds_per_layer_forward"]
    fused = r["views_clock"]["softmax_pass"]
    want = fused * split["head_mean_half"] / per["softmax_distance_half_mean"]
    assert rows["head_mean"]["seconds"] == pytest.approx(want, abs=2e-6)


def test_the_phase_table_times_a_windowed_models_inline_capture(phases):
    """A 4-block SAM encoder (windows of 3 padded to 9x9, two global blocks) at 56 px: the plain forward is the base;
    the views' inline capture (vitlens's own path, whole maps) is timed inside: the scores, bias and softmax made
    once, the windowed views' reading and P v are phases of their own that add up to the attention's clock."""
    kwargs = dict(patch_size=8, embed_dim=32, depth=4, num_heads=2, window_size=3, global_attn_indexes=(1, 3),
                  neck_chans=16)
    r = phases.run("samvit_base_patch16", 56, 2, 1, **kwargs)
    assert r["base"] == "plain" and r["pass_split"] is None
    rows = _by_phase(r)
    assert {"scores_bias_softmax", "distance_sums", "head_mean", "pv_product_and_copies", "rollout_chain",
            "rest_over_base"} <= set(rows) and "scores_softmax_again" not in rows
    assert rows["scores_bias_softmax"]["least_bytes"] == 3 * r["probs_bytes"]
    clock = r["views_clock"]
    for key in ("attention_rows", "scores_softmax", "distance_reading", "rollout_reading", "rollout_chain"):
        assert clock[key] > 0, key
    inside = sum(rows[k]["seconds"] for k in ("scores_bias_softmax", "distance_sums", "head_mean",
                                              "pv_product_and_copies"))
    assert inside == pytest.approx(clock["attention_rows"], abs=1e-3)
    assert r["probs_bytes"] > 0 and math.isfinite(r["ratio"])


def test_the_cold_bench_divides_by_the_forward_with_the_mlps_buffers():
    """``bench_cold.py --base plain_mlp_buffers``: the base row is a process of its own that times the forward with
    the MLP's buffers installed for the call and removed after."""
    cold = _module("bench_cold")
    out = cold.child("plain_mlp_buffers", "vit_tiny_patch16_224", 32, 2, torch.get_num_threads(), 1, False, depth=1)
    assert out["row"] == "plain_mlp_buffers" and out["calls"][0]["seconds"] > 0
    assert "map_storage" not in out["calls"][0]
    assert cold.parser().parse_args(["--base", "plain_mlp_buffers"]).base == "plain_mlp_buffers"
