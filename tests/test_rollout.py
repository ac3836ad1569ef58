"""Attention rollout (paper Fig. 6): known answers, an independent per-image numpy
implementation, discard rules, and batch invariance."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from conftest import get_model
from view_references import residual_normalize, rollout_from_maps
from vitlens.views.rollout_math import discard_smallest


def numpy_rollout(maps: list[np.ndarray], prefix: int, has_cls: bool, grid, fusion="mean", discard=0.0) -> np.ndarray:
    """One image at a time, one layer at a time, with explicit loops where it matters."""
    b = maps[0].shape[0]
    out = []
    for i in range(b):
        t = maps[0].shape[-1]
        r = np.eye(t)
        for a in maps:
            f = {"mean": np.mean, "max": np.max, "min": np.min}[fusion](a[i].astype(np.float64), axis=0)
            if discard > 0:
                flat = f.flatten()
                order = [j for j in np.argsort(flat, kind="stable") if not (has_cls and j == 0)]
                for j in order[: int(t * t * discard)]:
                    flat[j] = 0.0
                f = flat.reshape(t, t)
            a2 = f + np.eye(t)
            for row in range(t):
                a2[row] = a2[row] / a2[row].sum()
            r = a2 @ r
        v = r[0, prefix:] if has_cls else r[prefix:, prefix:].mean(0)
        out.append((v / v.max()).reshape(grid))
    return np.stack(out)


def test_uniform_attention_rolls_out_to_a_flat_map():
    t = 1 + 9
    maps = [torch.full((1, 2, t, t), 1.0 / t) for _ in range(3)]
    np.testing.assert_allclose(rollout_from_maps(maps, 1, True, (3, 3)), np.ones((1, 3, 3)), rtol=1e-12)


def test_attention_on_one_patch_rolls_out_to_that_patch():
    t = 1 + 4
    a = torch.zeros(1, 1, t, t)
    a[..., 3] = 1.0  # every token attends only to patch 2 (token 3)
    got = rollout_from_maps([a, a], 1, True, (2, 2))
    np.testing.assert_allclose(got[0], [[0, 0], [1, 0]], atol=1e-12)


def test_rows_are_normalised_per_row_not_broadcast_the_wrong_way():
    a = torch.tensor([[[0.9, 0.1, 0.0], [0.2, 0.2, 0.6], [0.0, 0.5, 0.5]]], dtype=torch.float64)
    n = residual_normalize(a)
    np.testing.assert_allclose(n.sum(-1).numpy(), 1.0, rtol=1e-15)
    np.testing.assert_allclose(n[0, 0].numpy(), [1.9 / 2, 0.1 / 2, 0.0])


def test_layers_are_multiplied_first_block_first():
    a1 = torch.tensor([[[0.1, 0.8, 0.1], [0.3, 0.3, 0.4], [0.2, 0.2, 0.6]]]).unsqueeze(1)
    a2 = torch.tensor([[[0.5, 0.1, 0.4], [0.9, 0.05, 0.05], [0.1, 0.1, 0.8]]]).unsqueeze(1)
    got = rollout_from_maps([a1, a2], 1, True, (1, 2))
    r1, r2 = (residual_normalize(a.squeeze(1).double())[0].numpy() for a in (a1, a2))
    v = (r2 @ r1)[0, 1:]
    np.testing.assert_allclose(got[0, 0], v / v.max(), rtol=1e-12)
    wrong = (r1 @ r2)[0, 1:]
    assert not np.allclose(got[0, 0], wrong / wrong.max())


def test_discard_never_zeroes_the_class_tokens_self_attention():
    fused = torch.rand(2, 5, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.1
    fused[:, 0, 0] = 1e-6  # the smallest weight of all
    out = discard_smallest(fused, 0.9, protect_class_token=True)
    assert torch.all(out[:, 0, 0] == 1e-6)
    assert int((out == 0).sum()) == 2 * int(25 * 0.9)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("discard", [0.0, 0.6])
def test_matches_independent_numpy_rollout_on_captured_maps(fusion, discard, tiny):
    x = torch.randn(3, 3, 224, 224, generator=torch.Generator().manual_seed(1))
    # the maps of the capture the view runs (inline by query rows, the softmax pass its own): discarding the smallest
    # weights ranks them, so maps a rounding apart (another capture's softmax) may discard other entries
    with torch.no_grad(), vl.capture_attention(tiny, mode="inline", query_rows=x.shape[-1]) as cap:
        tiny.model(x)
    want = numpy_rollout([a.numpy() for a in cap.maps], 1, True, (14, 14), fusion, discard)
    got = vl.attention_rollout(tiny, x, head_fusion=fusion, discard_ratio=discard)
    # the head mean runs in float32 like the attention; the product of layers in float64
    np.testing.assert_allclose(got.maps, want, rtol=1e-6, atol=1e-9)
    assert got.source_token == "class token"


def test_batch_of_b_equals_b_single_runs():
    m = get_model("deit_tiny_distilled_patch16_224")
    x = torch.randn(4, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    batch = vl.attention_rollout(m, x, discard_ratio=0.5, batch_size=4)
    singles = np.concatenate([vl.attention_rollout(m, x[i:i + 1], discard_ratio=0.5).maps for i in range(4)])
    np.testing.assert_allclose(batch.maps, singles, rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(batch.predictions, [vl.attention_rollout(m, x[i:i + 1]).predictions[0]
                                                      for i in range(4)])


def test_model_without_class_token_uses_the_mean_over_patch_rows():
    m = get_model("vit_little_patch16_reg4_gap_256", img_size=128)
    assert not m.spec.has_class_token and m.spec.num_prefix_tokens == 4
    x = torch.randn(2, 3, 128, 128, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), vl.capture_attention(m) as cap:
        m.model(x)
    r = vl.attention_rollout(m, x)
    assert r.source_token == "mean over patch tokens"
    np.testing.assert_allclose(r.maps, numpy_rollout([a.numpy() for a in cap.maps], 4, False, (8, 8)), rtol=1e-6)
    assert r.maps.max(axis=(1, 2)).tolist() == [1.0, 1.0]


def test_bad_rollout_parameters_are_named():
    m = get_model("vit_tiny_patch16_224")
    x = torch.randn(1, 3, 224, 224)
    with pytest.raises(vl.InvalidParameterError, match="head_fusion"):
        vl.attention_rollout(m, x, head_fusion="median")
    with pytest.raises(vl.InvalidParameterError, match="discard_ratio"):
        vl.attention_rollout(m, x, discard_ratio=1.0)
