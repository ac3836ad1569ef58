"""Attention distance (paper Fig. 7 right, Fig. 11): hand-built cases with known answers, an
independent brute-force computation, streaming merges and batch invariance."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import vitlens as vl
from conftest import get_model
from view_references import per_image_distance
from vitlens.views.distance import FLOAT32_RTOL, KEY_BLOCK, AttentionDistanceAccumulator, token_distance_matrix


def brute_force_distance(attn: np.ndarray, grid, stride, prefix: int, renormalize: bool) -> np.ndarray:
    """Pure-Python loops over queries and keys: [B, H, T, T] -> [B, H]."""
    gh, gw = grid
    b, h = attn.shape[:2]
    out = np.zeros((b, h))
    for i in range(b):
        for j in range(h):
            total = 0.0
            for q in range(gh * gw):
                row = attn[i, j, prefix + q, prefix:]
                acc = 0.0
                for k in range(gh * gw):
                    dy = (q // gw - k // gw) * stride[0]
                    dx = (q % gw - k % gw) * stride[1]
                    acc += row[k] * math.sqrt(dy * dy + dx * dx)
                total += acc / row.sum() if renormalize else acc
            out[i, j] = total / (gh * gw)
    return out


def run_accumulator(attn: torch.Tensor, grid, stride, prefix: int, renormalize: bool = True):
    acc = AttentionDistanceAccumulator(1, attn.shape[1], prefix, stride, renormalize)
    acc.begin_batch(vl.BatchInfo.of(grid, (grid[0] * stride[0], grid[1] * stride[1])))
    acc(0, attn)
    return acc.result("hand-built")


def test_attention_to_the_query_itself_gives_zero_distance():
    n, prefix = 16, 1
    attn = torch.zeros(1, 2, n + prefix, n + prefix)
    attn[0, :, prefix:, prefix:] = torch.eye(n) * 0.7
    attn[0, :, prefix:, 0] = 0.3  # some mass on the class token; renormalisation removes it
    attn[0, :, 0, 0] = 1.0
    for renormalize in (True, False):
        r = run_accumulator(attn, (4, 4), (16, 16), prefix, renormalize)
        assert np.all(r.mean_px == 0.0)


def test_uniform_attention_on_14x14_grid_of_16px_is_116_5():
    n = 196
    attn = torch.full((1, 1, n + 1, n + 1), 1.0 / (n + 1))
    r = run_accumulator(attn, (14, 14), (16, 16), 1, renormalize=True)
    # the mean Euclidean distance between two cells of a 14x14 grid (self-pairs included), in pixels
    cells = [(y, x) for y in range(14) for x in range(14)]
    expected = 16 * sum(math.dist(a, b) for a in cells for b in cells) / len(cells) ** 2
    # the sums over keys are float32 matrix products over blocks of keys (derived bound FLOAT32_RTOL;
    # uniform attention, all terms positive and equal, is the worst case); the rest runs in float64
    assert r.mean_px[0, 0] == pytest.approx(expected, rel=FLOAT32_RTOL)
    assert r.mean_px[0, 0] == pytest.approx(116.5, abs=0.1)
    raw = run_accumulator(attn, (14, 14), (16, 16), 1, renormalize=False)
    assert raw.mean_px[0, 0] == pytest.approx(expected * 196 / 197, rel=FLOAT32_RTOL)


def test_renormalize_discounts_attention_parked_on_the_class_token():
    grid, prefix = (3, 3), 1
    attn = torch.zeros(1, 1, 10, 10)
    for q in range(9):
        attn[0, 0, prefix + q, 0] = 0.9  # parked on the class token
        k = q + 1 if q % 3 < 2 else q - 1  # a horizontal neighbour, one patch away
        attn[0, 0, prefix + q, prefix + k] = 0.1
    assert run_accumulator(attn, grid, (16, 16), prefix, True).mean_px[0, 0] == pytest.approx(16.0)
    assert run_accumulator(attn, grid, (16, 16), prefix, False).mean_px[0, 0] == pytest.approx(1.6)


@pytest.mark.parametrize("grid,stride,prefix", [((3, 5), (16, 16), 1), ((4, 2), (8, 24), 2), ((3, 3), (32, 32), 0)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_brute_force_on_random_attention_including_non_square_grids(grid, stride, prefix, renormalize):
    n = grid[0] * grid[1] + prefix
    attn = torch.rand(3, 2, n, n, generator=torch.Generator().manual_seed(5)).softmax(-1)
    got = per_image_distance(attn, token_distance_matrix(grid, stride), prefix, renormalize).numpy()
    np.testing.assert_allclose(got, brute_force_distance(attn.double().numpy(), grid, stride, prefix, renormalize),
                               rtol=FLOAT32_RTOL)


def test_hybrid_distance_uses_the_cnn_total_stride():
    m = get_model("vit_tiny_r_s16_p8_224")
    assert m.spec.kind == "hybrid" and m.spec.stride_px == (32, 32) and m.spec.grid == (7, 7)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(6))
    with torch.no_grad(), vl.capture_attention(m) as cap:
        m.model(x)
    r = vl.attention_distance(m, x)
    for layer in (0, 5, 11):
        want = brute_force_distance(cap.maps[layer].double().numpy(), (7, 7), (32, 32), 1, True).mean(0)
        np.testing.assert_allclose(r.mean_px[layer], want, rtol=FLOAT32_RTOL)


def test_model_with_zero_queries_and_keys_has_uniform_attention_everywhere():
    import copy

    m = copy.copy(get_model("vit_tiny_patch16_224"))
    m.model = copy.deepcopy(m.model)
    with torch.no_grad():
        for block in m.model.blocks:
            dim = block.attn.head_dim * block.attn.num_heads
            block.attn.qkv.weight[: 2 * dim] = 0  # q = k = 0: every score equal, softmax uniform
            block.attn.qkv.bias[: 2 * dim] = 0
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(7))
    r = vl.attention_distance(m, x)
    cells = [(y, x_) for y in range(14) for x_ in range(14)]
    expected = 16 * sum(math.dist(a, b) for a in cells for b in cells) / len(cells) ** 2
    np.testing.assert_allclose(r.mean_px, expected, rtol=FLOAT32_RTOL)  # float32 sums over keys
    np.testing.assert_allclose(r.std_px, 0, atol=FLOAT32_RTOL * expected)  # the std's bound is in pixels


def test_two_partial_results_merge_into_the_result_over_both(tiny):
    x = torch.randn(7, 3, 224, 224, generator=torch.Generator().manual_seed(8))
    whole = vl.attention_distance(tiny, x, batch_size=4)
    merged = vl.attention_distance(tiny, x[:3], batch_size=2).merge(vl.attention_distance(tiny, x[3:], batch_size=3))
    assert merged.n_images == whole.n_images == 7
    # the images ran in other batches: each per-image value is within FLOAT32_RTOL of float64 either way
    np.testing.assert_allclose(merged.mean_px, whole.mean_px, rtol=2 * FLOAT32_RTOL)
    np.testing.assert_allclose(merged.std_px, whole.std_px, rtol=0, atol=2 * FLOAT32_RTOL * whole.mean_px.max())


def test_merging_is_exact_for_the_same_per_image_values():
    values = np.random.default_rng(3).random((9, 2, 3)) * 50  # 9 images x [2 layers, 3 heads]
    parts = []
    for chunk in (values[:2], values[2:7], values[7:]):
        acc = AttentionDistanceAccumulator(2, 3, 1, (16, 16))
        acc.begin_batch(vl.BatchInfo.of((4, 4), (64, 64)))
        for layer in range(2):
            acc.add(layer, chunk[:, layer])
        parts.append(acc)
    got = parts[0].merge(parts[1]).merge(parts[2]).result("m")
    np.testing.assert_allclose(got.mean_px, values.mean(0), rtol=1e-13)
    np.testing.assert_allclose(got.std_px, values.std(0), rtol=1e-12)


def test_streamed_statistics_equal_per_image_values_over_stored_maps(tiny):
    x = torch.randn(5, 3, 224, 224, generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), vl.capture_attention(tiny) as cap:
        tiny.model(x)
    per_image = np.stack([brute_force_distance(a.double().numpy()[:, :1], (14, 14), (16, 16), 1, True)[:, 0]
                          for a in cap.maps[:2]])  # [2 layers, 5 images], head 0
    r = vl.attention_distance(tiny, x, batch_size=2)
    np.testing.assert_allclose(r.mean_px[:2, 0], per_image.mean(1), rtol=FLOAT32_RTOL)
    # the spread over images (~0.014 px) is tiny beside the means (~116 px): its bound is in pixels,
    # the largest change of one image's value (FLOAT32_RTOL of the largest mean), not relative to itself
    np.testing.assert_allclose(r.std_px[:2, 0], per_image.std(1), rtol=0, atol=FLOAT32_RTOL * per_image.max())


def test_batch_size_does_not_change_the_result(tiny):
    x = torch.randn(4, 3, 224, 224, generator=torch.Generator().manual_seed(10))
    a = vl.attention_distance(tiny, x, batch_size=4)
    b = vl.attention_distance(tiny, x, batch_size=1)
    np.testing.assert_allclose(a.mean_px, b.mean_px, rtol=2 * FLOAT32_RTOL)  # each within the bound of float64


def test_merging_results_of_different_settings_is_refused(tiny):
    x = torch.randn(1, 3, 224, 224)
    with pytest.raises(vl.InvalidParameterError):
        vl.attention_distance(tiny, x).merge(vl.attention_distance(tiny, x, renormalize=False))


def test_the_derived_float32_bound_is_below_1e_5():
    assert FLOAT32_RTOL == (2 * KEY_BLOCK + 3) * 2.0 ** -24 < 1e-5


@pytest.mark.parametrize("grid", [(14, 14), (32, 32), (7, 24)])  # 196 and 168 keys: uneven last blocks
@pytest.mark.parametrize("kind", ["uniform", "peaked", "random"])
def test_float32_sums_over_keys_stay_within_the_derived_bound_of_float64(grid, kind):
    """The fast path (float32 products over blocks of keys, uneven last blocks included) against
    the same sums in float64; the bound is derived for any summation order (FLOAT32_RTOL)."""
    n = grid[0] * grid[1] + 1
    g = torch.Generator().manual_seed(11)
    if kind == "uniform":  # the worst case: every term positive and equal
        attn = torch.full((2, 3, n, n), 1.0 / n)
    elif kind == "peaked":
        attn = (torch.randn(2, 3, n, n, generator=g) * 8).softmax(-1)
    else:
        attn = torch.rand(2, 3, n, n, generator=g).softmax(-1)
    d = token_distance_matrix(grid, (16, 16))
    for renormalize in (True, False):
        got = per_image_distance(attn, d, 1, renormalize).numpy()
        a = attn.double()[:, :, 1:, 1:]
        per_query = (a * d).sum(-1) / (a.sum(-1) if renormalize else 1.0)
        np.testing.assert_allclose(got, per_query.mean(-1).numpy(), rtol=FLOAT32_RTOL)
