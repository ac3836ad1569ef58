"""MViT v2 (issue 32: pooling attention, keys and values at a coarser grid than the queries): the capture against
the block's attention written out here in float64 from its weights (its q/k pooling and the decomposed
relative-position term with offsets scaled between the two grids), the outputs bit-identical with capture on,
the grids and centres against hand-written poolings, the distance in pixels against a dense float64 computation
whose key grid is not the query grid, and the rollout against a brute-force composition of dense matrices with
the stated transports written out here."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlens as vl
from vitlens.views.distance import FLOAT32_RTOL
from vitlens.views.windowed import WindowedDistanceResult


def tiny_mvit(mode: str = "conv", img: int = 64, seed: int = 0, **cfg) -> torch.nn.Module:
    """A 3-stage MViT v2 on a 16x16 grid of 4 px tokens (depths 1, 2, 1; heads 1, 2, 4): stage 0's keys pooled by
    4 to 4x4, stage 1 queries 8x8 (keys 8x8 at its first block, 4x4 at its second), stage 2's queries 4x4 over 8x8 keys (pooled
    3x3 at stride 1: the keys finer than the queries); large random q/k weights and relative-position tables so the attention is far from uniform."""
    from timm.models.mvitv2 import MultiScaleVit, MultiScaleVitCfg

    torch.manual_seed(seed)
    args = dict(depths=(1, 2, 1), embed_dim=8, num_heads=1, stride_q=((1, 1), (2, 2), (2, 2)), mode=mode)
    args.update(cfg)
    model = MultiScaleVit(MultiScaleVitCfg(**args), img_size=img, num_classes=5).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in model.stages:
            for block in stage.blocks:
                if not hasattr(block.attn, "qkv"):  # pool_first: q, k, v apart (refused)
                    continue
                block.attn.qkv.weight.normal_(0.0, 0.6, generator=g)
                block.attn.rel_pos_h.normal_(0.0, 0.6, generator=g)
                block.attn.rel_pos_w.normal_(0.0, 0.6, generator=g)
                for norm in (block.attn.norm_q, block.attn.norm_k):
                    if norm is not None:
                        norm.weight.normal_(2.0, 0.5, generator=g)
    return model


def load(model: torch.nn.Module) -> vl.LoadedModel:
    return vl.LoadedModel.from_module(model, name="tiny-mvit")


def images(n: int = 3, size: int = 64, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(seed))


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [b for stage in model.stages for b in stage.blocks]


def _pool(t: torch.Tensor, grid: tuple[int, int], pool: torch.nn.Module | None, norm: torch.nn.Module | None,
          mode: str) -> tuple[torch.Tensor, tuple[int, int]]:
    """[B, heads, N, d] float64 pooled over the token grid with the module's own kernel/stride/padding and weights,
    then its LayerNorm: ([B, heads, N', d], grid')."""
    if pool is not None:
        b, h, _n, d = t.shape
        x = t.reshape(b * h, *grid, d).permute(0, 3, 1, 2)
        if mode == "conv":
            x = F.conv2d(x, pool.weight.double(), stride=pool.stride, padding=pool.padding, groups=d)
        elif mode == "max":
            x = F.max_pool2d(x, pool.kernel_size, pool.stride, pool.padding)
        else:  # AvgPool2d's default: the zero padding counted
            x = F.avg_pool2d(x, pool.kernel_size, pool.stride, pool.padding, count_include_pad=True)
        grid = (x.shape[2], x.shape[3])
        t = x.reshape(b, h, d, -1).transpose(2, 3)
    if norm is not None:
        t = F.layer_norm(t, (t.shape[-1],), norm.weight.double(), norm.bias.double(), norm.eps)
    return t, grid


def rel_index(q: int, k: int) -> np.ndarray:
    """[q, k] the relative-position table row of query i and key j along one axis (MViT v2, Li et al. 2022): the
    offset between them with the coarser grid's positions scaled up to the finer one's, shifted to be >= 0."""
    q_ratio, k_ratio = max(k / q, 1.0), max(q / k, 1.0)
    return np.array([[int(i * q_ratio - j * k_ratio + (k - 1) * k_ratio) for j in range(k)] for i in range(q)])


def reference_probs(attn: torch.nn.Module, x: torch.Tensor, grid: tuple[int, int], mode: str) -> torch.Tensor:
    """The block's pooling attention written out in float64: q, k from its qkv weights, each pooled and normalised,
    softmax(q k^T / sqrt(d) + q . R_h[i_h(q, k)] + q . R_w[i_w(q, k)]), [B, heads, Nq, Nk]."""
    b, n, _c = x.shape
    qkv = F.linear(x.double(), attn.qkv.weight.double(), attn.qkv.bias.double())
    q, k, _v = qkv.reshape(b, n, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    q, q_grid = _pool(q, grid, attn.pool_q, attn.norm_q, mode)
    k, k_grid = _pool(k, grid, attn.pool_k, attn.norm_k, mode)
    scores = (q * attn.head_dim ** -0.5) @ k.transpose(-2, -1)
    rh = attn.rel_pos_h.double()[torch.from_numpy(rel_index(q_grid[0], k_grid[0]))]  # [qh, kh, d]
    rw = attn.rel_pos_w.double()[torch.from_numpy(rel_index(q_grid[1], k_grid[1]))]  # [qw, kw, d]
    qg = q.reshape(b, attn.num_heads, *q_grid, -1)
    bias = (torch.einsum("bnyxd,ykd->bnyxk", qg, rh)[..., :, None]
            + torch.einsum("bnyxd,xkd->bnyxk", qg, rw)[..., None, :])
    scores = scores + bias.reshape(scores.shape)
    return scores.softmax(-1)


def recording_block_inputs(model: torch.nn.Module) -> tuple[list, list]:
    """Hooks that record what every block's attention is fed in a forward: (norm1 of its input, its grid)."""
    feeds: list = []
    hooks = [b.attn.register_forward_pre_hook(lambda _m, args: feeds.append((args[0], tuple(args[1]))))
             for b in blocks(model)]
    return feeds, hooks


def captured_forward(model: torch.nn.Module, m: object, x: torch.Tensor, mode: str) -> tuple:
    """(plain output, output under capture, what each block's attention was fed, the capture) of one forward."""
    with torch.no_grad():
        plain = model(x)
        feeds, hooks = recording_block_inputs(model)
        with vl.capture_attention(m, mode=mode) as cap:
            out = model(x)
        for h in hooks:
            h.remove()
    return plain, out, feeds, cap


def pool_matrix(fine: tuple[int, int], kernel: int, stride: int, padding: int) -> np.ndarray:
    """[coarse tokens, fine tokens]: each pooled token the mean of the fine tokens its kernel covers inside the grid,
    written out (the stated transport)."""
    h, w = fine
    oh, ow = (h + 2 * padding - kernel) // stride + 1, (w + 2 * padding - kernel) // stride + 1
    out = np.zeros((oh * ow, h * w))
    for i in range(oh):
        for j in range(ow):
            cells = [(y, x) for y in range(i * stride - padding, i * stride - padding + kernel)
                     for x in range(j * stride - padding, j * stride - padding + kernel) if 0 <= y < h and 0 <= x < w]
            for y, x in cells:
                out[i * ow + j, y * w + x] = 1.0 / len(cells)
    return out


#: the tiny model's blocks, written out: (input grid, query grid, key grid, the keys' pooling (kernel, stride,
#: padding), the output tokens' (the residual's) pooling or None)
HAND = [((16, 16), (16, 16), (4, 4), (3, 4, 1), None),
        ((16, 16), (8, 8), (8, 8), (3, 2, 1), (3, 2, 1)),
        ((8, 8), (8, 8), (4, 4), (3, 2, 1), None),
        ((8, 8), (4, 4), (8, 8), (3, 1, 1), (3, 2, 1))]


def hand_geometry() -> list[dict]:
    """Each block's query and key centres in pixels and its transports, from HAND: the first grid's tokens at
    (r + 0.5) x 4 px, a pooled token at the mean of the centres of the tokens its kernel covers."""
    ys, xs = np.meshgrid((np.arange(16) + 0.5) * 4, (np.arange(16) + 0.5) * 4, indexing="ij")
    centres = np.stack([ys.ravel(), xs.ravel()], 1)
    out = []
    for fine, q_grid, k_grid, key_pool, out_pool in HAND:
        kp = pool_matrix(fine, *key_pool)
        qp = np.eye(fine[0] * fine[1]) if out_pool is None else pool_matrix(fine, *out_pool)
        assert kp.shape[0] == k_grid[0] * k_grid[1] and qp.shape[0] == q_grid[0] * q_grid[1]
        out.append(dict(q_centres=qp @ centres, k_centres=kp @ centres, kp=kp, qp=qp, q_grid=q_grid, k_grid=k_grid))
        centres = qp @ centres
    return out


def test_the_grids_centres_and_transports_are_the_hand_written_poolings():
    model = tiny_mvit()
    m = load(model)
    assert m.spec.kind == "hierarchical" and m.family.name == "timm-mvitv2"
    assert m.spec.image_size == (64, 64) and m.spec.grid == (16, 16) and m.spec.num_prefix_tokens == 0
    windows = m.family.windows(m.model, m.spec.image_size)
    assert [(g.stage, g.grid, g.keys_grid, g.in_grid, g.stride_px, g.kind) for g in windows] == [
        (0, (16, 16), (4, 4), (16, 16), (4, 4), "pooled"), (1, (8, 8), (8, 8), (16, 16), (8, 8), "pooled"),
        (1, (8, 8), (4, 4), (8, 8), (8, 8), "pooled"), (2, (4, 4), (8, 8), (8, 8), (16, 16), "pooled")]
    for g, want in zip(windows, hand_geometry()):
        assert g.num_windows == 1 and g.allowed.all()  # one window: every query attends every pooled key
        np.testing.assert_array_equal(g.index, np.arange(g.num_tokens)[None])
        np.testing.assert_allclose(g.query_centres, want["q_centres"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(g.key_centres, want["k_centres"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(g.key_from.dense(), want["kp"], rtol=0, atol=1e-15)
        qp = np.eye(g.num_tokens) if g.query_from is None else g.query_from.dense()
        np.testing.assert_allclose(qp, want["qp"], rtol=0, atol=1e-15)
    # the stated output transport follows the residual's pooling, which is pool_q's kernel/stride/padding here
    for b in blocks(model):
        if b.shortcut_pool_attn is not None:
            skip, pool_q = b.shortcut_pool_attn, b.attn.pool_q
            assert (tuple(skip.kernel_size), tuple(skip.stride), tuple(skip.padding)) == (
                tuple(pool_q.kernel_size), tuple(pool_q.stride), tuple(pool_q.padding)) == ((3, 3), (2, 2), (1, 1))


@pytest.mark.parametrize("pool", ["conv", "max", "avg"])
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_capture_is_the_blocks_own_pooling_attention_and_leaves_the_outputs(pool, mode):
    model = tiny_mvit(mode=pool)
    m = load(model)
    x = images()
    plain, out, feeds, cap = captured_forward(model, m, x, mode)
    assert torch.equal(out, plain)  # bit for bit: both modes read the model's own softmax
    windows = m.family.windows(m.model, m.spec.image_size)
    assert len(cap.maps) == len(feeds) == len(windows) == 4
    for block, (feed, grid), got, g in zip(blocks(model), feeds, cap.maps, windows):
        want = reference_probs(block.attn, feed, grid, pool)
        assert got.shape == (3, block.attn.num_heads, g.window_tokens, g.key_tokens) == want.shape
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert max(float(p.max()) for p in cap.maps) > 0.5  # far from uniform


def test_inline_capture_without_detach_hands_over_the_probabilities_the_output_is_computed_from():
    model = tiny_mvit()
    m = load(model)
    x = images(1).requires_grad_(True)
    with vl.capture_attention(m, mode="inline", detach=False) as cap:
        out = model(x)
    assert all(p.requires_grad for p in cap.maps)
    grad = torch.autograd.grad(out[0, 0], cap.maps[-1])[0]
    assert grad.abs().sum() > 0  # the output depends on the captured maps


def assert_pooled_distance_is_a_dense_float64_computation(m: vl.LoadedModel, x: torch.Tensor,
                                                          geometry: list[dict]) -> WindowedDistanceResult:
    """``vl.attention_distance`` against float64 over each block's dense [query tokens, key tokens] maps and the
    pixel distances between the hand-placed query and key centres (key grid != query grid), and the uniform
    distance against attention spread evenly over the pooled keys."""
    n = x.shape[0]
    got = vl.attention_distance(m, x)
    assert isinstance(got, WindowedDistanceResult) and got.n_images == n
    with vl.capture_attention(m) as cap, torch.no_grad():
        m.logits(x)
    for layer, (probs, hand) in enumerate(zip(cap.maps, geometry)):
        d = np.linalg.norm(hand["q_centres"][:, None] - hand["k_centres"][None], axis=-1)  # [Tq, Tk]
        a = probs.double().numpy()  # [B, heads, Tq, Tk]
        per_image = ((a * d).sum(-1) / a.sum(-1)).mean(-1)
        heads = a.shape[1]
        np.testing.assert_allclose(got.mean_px[layer, :heads], per_image.mean(0), rtol=FLOAT32_RTOL, atol=1e-12)
        np.testing.assert_allclose(got.std_px[layer, :heads], per_image.std(0), rtol=1e-8, 
                                   atol=max(1e-10, FLOAT32_RTOL * per_image.max()))
        assert np.isnan(got.mean_px[layer, heads:]).all()
        assert got.window_uniform_px[layer] == pytest.approx(d.mean(), rel=1e-12)
    return got


def test_distance_in_pixels_over_the_pooled_keys_equals_a_dense_float64_computation(tmp_path):
    m = load(tiny_mvit())
    got = assert_pooled_distance_is_a_dense_float64_computation(m, images(3), hand_geometry())
    assert got.kinds == ("pooled",) * 4 and got.stages.tolist() == [0, 1, 1, 2]
    assert np.nanmax(got.of_window) - np.nanmin(got.of_window) > 0.1  # peaky weights: heads differ
    rows = got.to_rows()
    assert len(rows) == 1 + 2 + 2 + 4 and {r["attention"] for r in rows} == {"pooled"}
    # each block says the grids of its queries and keys, and they survive a save and load
    assert [(r["queries"], r["keys"]) for r in rows if r["head"] == 1] == [
        ("16x16", "4x4"), ("8x8", "8x8"), ("8x8", "4x4"), ("4x4", "8x8")]
    again = vl.load_result(got.save(tmp_path / "distance.json"))
    assert again.equals(got) and again.to_rows() == rows


def test_known_answer_uniform_attention_is_the_uniform_distance_over_the_pooled_keys():
    """With q = k = 0 (zero qkv weights and biases, zero LayerNorm biases) every score is 0, relative term
    included: each query spreads evenly over the pooled keys, exactly the uniform distance."""
    model = tiny_mvit()
    with torch.no_grad():
        for b in blocks(model):
            b.attn.qkv.weight.zero_(), b.attn.qkv.bias.zero_()
            for norm in (b.attn.norm_q, b.attn.norm_k):
                norm.bias.zero_()
    got = vl.attention_distance(load(model), images(2))
    np.testing.assert_allclose(np.nan_to_num(got.of_window, nan=1.0), 1.0, rtol=0, atol=FLOAT32_RTOL)  # NaN: no such head


def test_rollout_through_the_poolings_equals_a_brute_force_dense_composition():
    """Per block (A K + Q) / rowsum with A the head-fused map [Tq, Tk], K the keys' pooling and Q the output
    tokens' (the residual's) pooling written out (each pooled token the mean of the tokens its kernel covers), the
    source the mean over the last stage's tokens (the model's average pool), down to the patch grid."""
    m = load(tiny_mvit())
    x = images(2)
    got = vl.attention_rollout(m, x)
    with vl.capture_attention(m) as cap, torch.no_grad():
        m.logits(x)
    geometry = hand_geometry()
    last = geometry[-1]["q_centres"].shape[0]
    want = np.zeros((2, 16, 16))
    for i in range(2):
        v = np.full(last, 1.0 / last)
        for probs, hand in reversed(list(zip(cap.maps, geometry))):
            a = probs[i].mean(0).double().numpy()  # heads fused by their mean, in float32 as the rollout fuses them
            mix = a @ hand["kp"] + hand["qp"]
            v = v @ (mix / mix.sum(1, keepdims=True))
        want[i] = v.reshape(16, 16) / v.max()
    np.testing.assert_allclose(got.maps, want, rtol=1e-10, atol=1e-12)
    assert got.grid == (16, 16) and got.image_size == (64, 64) and "poolings (stated transport" in got.source_token


def test_one_querys_attention_is_on_its_pooled_keys():
    from vitlens.views.windowed_rollout import query_window_attention, window_maps

    m = load(tiny_mvit())
    x = images(1)
    maps = window_maps(m, x)
    windows = m.family.windows(m.model, m.spec.image_size)
    got = query_window_attention(maps[1], windows[1], 3, 5)  # stage 1's first block: 8x8 queries over 8x8 keys
    assert got.shape == (2, 8, 8)
    np.testing.assert_allclose(got.reshape(2, -1), maps[1][0, :, 3 * 8 + 5].double().numpy())
    assert query_window_attention(maps[0], windows[0], 15, 15).shape == (1, 4, 4)  # 16x16 queries, 4x4 keys


def test_analyze_and_the_html_report_run_on_a_tiny_mvit():
    from vitlens.report.data import ReportData, distance_reading
    from vitlens.report.html import model_figures, report_html

    m = load(tiny_mvit())
    x = images(2)
    a = vl.analyze(m, x)
    assert isinstance(a.distance, WindowedDistanceResult) and a.rollout.maps.shape == (2, 16, 16)
    assert a.filters is not None and a.position is None and "relative-position term" in a.position_note
    shown = [np.asarray(i) for i in m.display(x)]
    figs = model_figures(a, shown)
    assert {"filters", "distance", "rollout"} <= set(figs)
    assert "stage 3" in distance_reading(a.distance, "tiny-mvit")
    data = ReportData(models=["tiny-mvit"], analyses=[a], image_set={"count": 2}, environment={})
    page = report_html(data, [shown])
    assert "<h2>tiny-mvit</h2>" in page and "stage 3: median head" in page


def test_a_vit_view_is_refused_in_one_line():
    m = load(tiny_mvit())
    with pytest.raises(vl.UnsupportedModelError, match="attention_maps.*hierarchical"):
        vl.attention_maps(m, images(1))


@pytest.mark.parametrize("cfg, what", [(dict(use_cls_token=True), "class token"),
                                       (dict(pool_first=True), "MultiScaleAttentionPoolFirst")])
def test_the_class_token_and_pool_first_variants_are_refused_in_one_line(cfg, what):
    with pytest.raises(vl.UnsupportedModelError, match=what) as err:
        load(tiny_mvit(**cfg))
    assert "\n" not in str(err.value)


def test_an_absolute_position_table_is_the_position_view():
    m = load(tiny_mvit(use_abs_pos=True))
    table, grid = m.family.position_table(m.model, m.spec)
    assert grid == (16, 16) and table.shape == (1, 256, 8)


@pytest.fixture(scope="module")
def padded_mvit() -> torch.nn.Module:
    """tiny_mvit at 56 px: 14 -> 7 -> 4 tokens, the last pooling padded (timm's feat_size says 3 by floor division)."""
    return tiny_mvit(img=56)


@pytest.mark.parametrize("mode", ["side", "inline"])
def test_a_padded_pooling_is_read_on_the_grid_the_model_computes(padded_mvit, mode):
    model = padded_mvit
    assert tuple(model.stages[2].feat_size) == (3, 3)  # timm's floor division; the tokens are 4x4
    m = load(model)
    x = images(2, 56)
    plain, out, feeds, cap = captured_forward(model, m, x, mode)
    assert torch.equal(out, plain)
    windows = m.family.windows(m.model, m.spec.image_size)
    assert windows[-1].grid == (4, 4) and feeds[-1][1] == (7, 7)
    for block, (feed, grid), got, g in zip(blocks(model), feeds, cap.maps, windows):
        want = reference_probs(block.attn, feed, grid, "conv")
        assert got.shape == (2, block.attn.num_heads, g.window_tokens, g.key_tokens) == want.shape
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_a_padded_pooling_whose_relative_table_is_too_short_is_refused_for_that_reason():
    model = tiny_mvit(img=56, depths=(1, 1, 2))
    with pytest.raises(IndexError):  # the model's own forward fails at this size (its table indexed past the end)
        model(images(1, 56))
    with pytest.raises(vl.UnsupportedModelError, match="the model's own forward fails: stage 2 block 1 attends 4x4 "
                                                       "queries over 4x4 keys .* has 5 rows"):
        load(model)
