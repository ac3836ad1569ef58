"""Pooling attention in the windowed views (issue 32: Hiera's pooled queries, MViT v2's pooled keys): blocks whose
queries and keys are tokens of different grids, checked on hand-built geometries against explicit dense
token-to-token matrices (distance in pixels and the rollout composed by brute force), and the stated pooling
transport against hand-written cases."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vitlens.core.windows import Transport, WindowGeometry, pooling_transport, transport_centres
from vitlens.views.windowed import WindowedDistanceAccumulator
from vitlens.views.windowed_rollout import windowed_rollout_row
from vitlens.engine.consumer import BatchInfo


def centres(grid: tuple[int, int], stride: int) -> np.ndarray:
    ys, xs = np.meshgrid((np.arange(grid[0]) + 0.5) * stride, (np.arange(grid[1]) + 0.5) * stride, indexing="ij")
    return np.stack([ys.ravel(), xs.ravel()], axis=1)


def test_a_pooling_transport_is_the_mean_of_the_tokens_its_kernel_covers_inside_the_grid():
    t = pooling_transport((4, 4), kernel=(3, 3), stride=(2, 2), padding=(1, 1))
    m = t.dense()
    assert m.shape == (4, 16)
    np.testing.assert_allclose(m.sum(1), 1.0)
    # the first pooled token covers rows/cols -1..1 of the grid: tokens (0,0), (0,1), (1,0), (1,1)
    want = np.zeros(16)
    want[[0, 1, 4, 5]] = 0.25
    np.testing.assert_allclose(m[0], want)
    # the last covers rows/cols 1..3: nine tokens
    want = np.zeros(16)
    want[[5, 6, 7, 9, 10, 11, 13, 14, 15]] = 1 / 9
    np.testing.assert_allclose(m[3], want)
    # its centre is the mean of the centres it covers, in pixels (stride 4): (8, 8) and (10, 10)
    c = transport_centres(t, centres((4, 4), 4))
    np.testing.assert_allclose(c[0], [4.0, 4.0])
    np.testing.assert_allclose(c[3], [10.0, 10.0])
    # pull is v P
    v = torch.rand(2, 4, dtype=torch.float64)
    np.testing.assert_allclose(t.pull(v).numpy(), v.numpy() @ m)


def geometries() -> list[WindowGeometry]:
    """Three blocks on a 4x4 grid at 8 px: plain 2x2-token windows; a Hiera-like block whose queries are pooled to
    2x2 (each the 2x2 block of tokens it max-pools, one window: the keys the 16 input tokens); an MViT-like
    block on the 2x2 grid whose keys are pooled to 1x2 by a 1x2 kernel."""
    fine, coarse = centres((4, 4), 8), None
    win = np.array([[r * 4 + c for r in rr for c in cc] for rr in ((0, 1), (2, 3)) for cc in ((0, 1), (2, 3))])
    b0 = WindowGeometry(0, (4, 4), (8, 8), win, np.ones((4, 4, 4), bool), "window", query_centres=fine)
    q_pool = pooling_transport((4, 4), (2, 2), (2, 2), (0, 0))
    coarse = transport_centres(q_pool, fine)
    b1 = WindowGeometry(1, (2, 2), (16, 16), np.arange(4)[None], np.ones((1, 4, 16), bool), "query-pooled",
                        key_index=np.arange(16)[None], key_grid=(4, 4), query_centres=coarse, key_centres=fine,
                        input_grid=(4, 4), query_from=q_pool)
    k_pool = pooling_transport((2, 2), (2, 1), (2, 1), (0, 0))  # 1x2 keys: each the mean of a column
    b2 = WindowGeometry(1, (2, 2), (16, 16), np.arange(4)[None], np.ones((1, 4, 2), bool), "pooled",
                        key_index=np.arange(2)[None], key_grid=(1, 2), query_centres=coarse,
                        key_centres=transport_centres(k_pool, coarse), key_from=k_pool)
    return [b0, b1, b2]


def random_maps(gs: list[WindowGeometry], b: int, heads: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.softmax(3 * torch.randn(b * w.num_windows, heads, w.window_tokens, w.key_tokens, generator=g,
                                          dtype=torch.float64), -1) for w in gs]


def dense_block(probs: np.ndarray, g: WindowGeometry) -> np.ndarray:
    """[query tokens, key tokens] of one image's head-fused maps [windows, Nq, Nk]."""
    out = np.zeros((g.num_tokens, g.keys_grid[0] * g.keys_grid[1]))
    for w in range(g.num_windows):
        out[np.ix_(g.index[w], g.keys[w])] = probs[w]
    return out


def test_the_rollout_through_pooled_queries_and_keys_is_the_dense_composition():
    gs = geometries()
    maps = random_maps(gs, b=2, heads=3)
    fused = [m.mean(1).reshape(2, g.num_windows, g.window_tokens, g.key_tokens) for m, g in zip(maps, gs)]
    row = windowed_rollout_row(fused, gs).numpy()
    assert row.shape == (2, 16)
    for i in range(2):
        v = np.full(4, 0.25)  # the mean of the last block's 2x2 tokens
        for g, f in reversed(list(zip(gs, fused))):
            a = dense_block(f[i].numpy(), g)
            kp = np.eye(a.shape[1]) if g.key_from is None else g.key_from.dense()
            qp = np.eye(g.num_tokens) if g.query_from is None else g.query_from.dense()
            m = a @ kp + qp
            v = v @ (m / m.sum(1, keepdims=True))
        np.testing.assert_allclose(row[i], v, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(row.sum(1), 1.0)


def test_the_distance_of_pooled_blocks_is_the_dense_pixel_computation():
    gs = geometries()
    maps = random_maps(gs, b=2, heads=3, seed=4)
    acc = WindowedDistanceAccumulator(gs, [3, 3, 3], (32, 32))
    acc.begin_batch(BatchInfo.of((4, 4), (32, 32), size=2))
    for layer, m in enumerate(maps):
        acc.on_attention(layer, m.float())
    acc.end_batch()
    res = acc.result("synthetic")
    for layer, (g, m) in enumerate(zip(gs, maps)):
        qc = g.query_centres
        kc = g.key_centres if g.key_centres is not None else qc
        d = np.linalg.norm(qc[:, None] - kc[None], axis=-1)
        per_image = []
        for i in range(2):
            probs = m.float().double().reshape(2, g.num_windows, 3, g.window_tokens, g.key_tokens)[i]
            dense = np.stack([dense_block(probs[:, h].numpy(), g) for h in range(3)])  # [H, Tq, Tk]
            per_image.append((dense * d).sum(-1).sum(-1) / g.num_tokens)
        np.testing.assert_allclose(res.mean_px[layer], np.mean(per_image, 0), rtol=1e-6)
        uniform = d.mean(1).mean() if g.key_index is not None else None
        if uniform is not None:
            np.testing.assert_allclose(res.window_uniform_px[layer], uniform, rtol=1e-12)
    assert res.kinds == ("window", "query-pooled", "pooled")


def test_a_transport_whose_rows_do_not_sum_to_one_is_still_a_plain_matrix_product():
    t = Transport(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([0.5, 0.5, 1.0]), (2, 2))
    np.testing.assert_allclose(t.dense(), [[0.5, 0.5], [0.0, 1.0]])
    with pytest.raises(IndexError):
        Transport(np.array([3]), np.array([0]), np.array([1.0]), (2, 2)).dense()
