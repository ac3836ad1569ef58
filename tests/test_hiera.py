"""Hiera (issue 32): timm ``hiera_*`` and Hugging Face ``HieraModel`` / ``HieraForImageClassification``, read exactly.

Checked here, on tiny random models (no network; a 64x96 input, 16x24 patch tokens of 8x8-token mask units, so
the grids are not square and there are 2x3 mask units): the capture against each block's mask-unit attention
written out in float64 from its own weights (side and inline, fused and non-fused; the outputs bit for bit under
side capture); the token order and windows against a hand-derived unroll (Hiera's paper: the stride offsets of
each pooling moved outward); the pooled residual's stated transport against a hand-written 2x2 mean; attention
distance in pixels against dense float64 token-to-token matrices (queries and keys on their own grids); the
rollout against a brute-force composition of dense matrices with the stated transports; ``vl.analyze`` and the
HTML report.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import vitlens as vl
from vitlens.views.distance import FLOAT32_RTOL
from vitlens.views.rollout import RolloutResult
from vitlens.views.windowed import WindowedDistanceResult

IMG = (64, 96)
HF_SIZE = dict(embed_dim=8, image_size=list(IMG), depths=[2, 2, 1, 1], num_heads=[1, 2, 4, 8], mlp_ratio=2.0,
               num_labels=5)


def _peaky(linears: list[nn.Linear], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in linears:
            lin.weight.normal_(0.0, 0.6, generator=g)
            lin.bias.normal_(0.0, 0.3, generator=g)


def tiny_timm(fused: bool = False, seed: int = 0, **kw) -> nn.Module:
    """4 stages of (2, 2, 1, 1) blocks: mask units in stages 0-1 (and, lagging by one block, stage 2's pooling
    block), global attention after; the queries pooled 2x2 at the first block of stages 1, 2 and 3."""
    import timm

    torch.manual_seed(seed)
    model = timm.create_model("hiera_tiny_224", pretrained=False, img_size=IMG, embed_dim=8, num_heads=1,
                              stages=(2, 2, 1, 1), mlp_ratio=2.0, num_classes=5, **kw).eval()
    _peaky([b.attn.qkv for b in model.blocks], seed)
    for b in model.blocks:
        b.attn.fused_attn = fused
    return model


def tiny_hf(classifier: bool = True, seed: int = 0) -> nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.HieraConfig(**HF_SIZE)
    model = (transformers.HieraForImageClassification if classifier else transformers.HieraModel)(cfg).eval()
    base = getattr(model, "hiera", model)
    _peaky([layer.attn.qkv for stage in base.encoder.stages for layer in stage.layers], seed)
    return model


def build(which: str, fused: bool = False) -> nn.Module:
    """timm's default Hiera, timm's abs-win variant (its residual pooled as [max, mean] without a projection,
    layer scale, a window position table), or transformers' classifier."""
    if which == "hf":
        return tiny_hf()
    extra = dict(abs_win_pos_embed=True, global_pos_size=(4, 6), use_expand_proj=False, init_values=0.5) \
        if which == "timm-abswin" else {}
    return tiny_timm(fused=fused, **extra)


def blocks(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "hiera", model)
    if hasattr(base, "encoder"):
        return [layer for stage in base.encoder.stages for layer in stage.layers]
    return list(model.blocks)


def norm_of(block: nn.Module) -> nn.Module:
    return getattr(block, "norm1", None) or block.layernorm_before


def load(model: nn.Module) -> vl.LoadedModel:
    return vl.LoadedModel.from_module(model, name="tiny-hiera", device="cpu")


def images(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, *IMG, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ the token order
def hand_order(grid: tuple[int, int], levels: int) -> np.ndarray:
    """[tokens] the grid token at each sequence position, written out from Hiera's paper: with ``levels`` 2x2
    strides left to unroll, token (r, c) has offsets (a_i, b_i) = bit i of r and c (i = 0 the finest), the rest
    (R, C) = (r, c) >> levels on the remaining grid, and goes to position sum_i (2 a_i + b_i) N / 4^(i+1) + R W' + C."""
    h, w = grid
    n, wr = h * w, w >> levels
    out = np.empty(n, dtype=np.int64)
    for r in range(h):
        for c in range(w):
            t = sum(((r >> i & 1) * 2 + (c >> i & 1)) * (n // 4 ** (i + 1)) for i in range(levels))
            out[t + (r >> levels) * wr + (c >> levels)] = r * w + c
    return out


def hand_windows(grid: tuple[int, int], levels: int, windows: int) -> np.ndarray:
    """[windows, N / windows]: a mask-unit attention's window of sequence position t is t mod windows, its place
    in the window t // windows (the model views the tokens as [per window, windows])."""
    order = hand_order(grid, levels)
    return order.reshape(-1, windows).T


def hand_pool(fine: tuple[int, int]) -> np.ndarray:
    """[coarse tokens, fine tokens]: each coarse token the mean of its 2x2 block of fine tokens."""
    h, w = fine
    out = np.zeros((h * w // 4, h * w))
    for r in range(h):
        for c in range(w):
            out[(r // 2) * (w // 2) + c // 2, r * w + c] = 0.25
    return out


EXPECTED = [  # (stage, query grid, key grid, stride, kind, unrolls left for the queries, windows)
    (0, (16, 24), (16, 24), (4, 4), "window", 3, 6), (0, (16, 24), (16, 24), (4, 4), "window", 3, 6),
    (1, (8, 12), (16, 24), (8, 8), "query-pooled window", 2, 6), (1, (8, 12), (8, 12), (8, 8), "window", 2, 6),
    (2, (4, 6), (8, 12), (16, 16), "query-pooled window", 1, 6), (3, (2, 3), (4, 6), (32, 32), "query-pooled global", 0, 1)]


@pytest.mark.parametrize("which", ["timm", "timm-abswin", "hf"])
def test_the_token_order_and_windows_are_the_hand_derived_unroll(which):
    m = load(build(which))
    assert m.family.name == f"{which[:4].rstrip('-')}-hiera" and m.spec.kind == "hierarchical"
    assert m.spec.grid == (16, 24) and m.spec.stride_px == (4, 4) and m.spec.image_size == IMG
    windows = m.family.windows(m.model, m.spec.image_size)
    assert [(g.stage, g.grid, g.keys_grid, g.stride_px, g.kind) for g in windows] == [e[:5] for e in EXPECTED]
    for g, (_s, grid, key_grid, _st, kind, levels, nw) in zip(windows, EXPECTED):
        np.testing.assert_array_equal(g.index, hand_windows(grid, levels, nw))
        pooled = kind.startswith("query-pooled")
        np.testing.assert_array_equal(g.keys, hand_windows(key_grid, levels + pooled, nw))
        assert g.allowed.all() and g.in_grid == key_grid
        assert sorted(g.index.ravel().tolist()) == list(range(grid[0] * grid[1]))  # every query token once
        if pooled:
            np.testing.assert_array_equal(g.query_from.dense(), hand_pool(key_grid))
            # a pooled query's window holds the keys it pools: the 2x2 block of every query is in its window
            pool = hand_pool(key_grid)
            for w in range(g.num_windows):
                for q in g.index[w]:
                    assert set(np.flatnonzero(pool[q])) <= set(g.keys[w].tolist())
        else:
            assert g.query_from is None and g.key_index is None
        # centres: a stage-s token at (r + 0.5) x its stride (the mean of the 2x2 block it pools)
        ys, xs = np.meshgrid((np.arange(grid[0]) + 0.5) * g.stride_px[0], (np.arange(grid[1]) + 0.5) * g.stride_px[1],
                             indexing="ij")
        np.testing.assert_allclose(g.query_centres, np.stack([ys.ravel(), xs.ravel()], 1))
    # stage 0's first window is the top-left 8x8 mask unit
    assert sorted(windows[0].index[0].tolist()) == [r * 24 + c for r in range(8) for c in range(8)]


def test_reading_the_windows_leaves_the_model_as_it_is():
    model = tiny_timm(fused=True)
    x = images(1)
    with torch.no_grad():
        before = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    m = load(model)
    m.family.windows(m.model, m.spec.image_size)
    assert all(b.attn.fused_attn for b in model.blocks)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(x), before)


# ------------------------------------------------------------------------------------------------------ capture
def reference_probs(block: nn.Module, feed: torch.Tensor) -> torch.Tensor:
    """The block's mask-unit attention written out here in float64 from its weights: q, k = the block's normalised
    input times its qkv weights; window w holds the sequence positions t = p * windows + w; a pooling block's query
    p' of window w is the max over s of the queries at p = s * (N_w / stride) + p' (Hiera's max pool on its
    unrolled order); softmax(q k^T / sqrt(d)). Returns [B * windows, heads, Nq, Nk]."""
    attn = block.attn
    heads = int(getattr(attn, "heads", None) or attn.num_heads)
    stride = int(getattr(attn, "q_stride", None) or attn.query_stride)
    x = feed.double()
    b, n, _ = x.shape
    nw = n // (stride * attn.window_size) if attn.use_mask_unit_attn else 1
    qkv = torch.nn.functional.linear(x, attn.qkv.weight.double(), attn.qkv.bias.double())
    q, k, _v = qkv.reshape(b, n, 3, heads, -1).unbind(2)  # [B, N, heads, d]
    d = q.shape[-1]
    out = []
    for w in range(nw):
        pos = np.arange(w, n, nw)  # this window's sequence positions, in order
        kw = k[:, pos]  # [B, Nk, heads, d]
        qw = q[:, pos].reshape(b, stride, -1, heads, d).amax(1)  # [B, Nq, heads, d]
        scores = torch.einsum("bqhd,bkhd->bhqk", qw, kw) * d ** -0.5
        out.append(scores.softmax(-1))
    return torch.stack(out, 1).reshape(b * nw, heads, *out[0].shape[-2:])


def recording_feeds(model: nn.Module) -> tuple[list[torch.Tensor], list]:
    feeds: list[torch.Tensor] = []
    hooks = [norm_of(b).register_forward_hook(lambda _m, _i, out: feeds.append(out)) for b in blocks(model)]
    return feeds, hooks


@pytest.mark.parametrize("which, fused", [("timm", False), ("timm", True), ("timm-abswin", True), ("hf", False)])
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_capture_is_the_blocks_own_attention_and_leaves_the_outputs(which, fused, mode):
    model = build(which, fused)
    m = load(model)
    x = images()
    with torch.no_grad():
        plain = m.logits(x)
        feeds, hooks = recording_feeds(model)
        with vl.capture_attention(m, mode=mode) as cap:
            out = m.logits(x)
        for h in hooks:
            h.remove()
    if mode == "side" or not fused:
        assert torch.equal(out, plain)  # bit for bit
    else:  # inline runs the non-fused path: the fused one to float rounding
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    assert len(cap.maps) == len(blocks(model)) == len(feeds)
    windows = m.family.windows(m.model, m.spec.image_size)
    for block, feed, got, g in zip(blocks(model), feeds, cap.maps, windows):
        assert got.shape == (x.shape[0] * g.num_windows, got.shape[1], g.window_tokens, g.key_tokens)
        torch.testing.assert_close(got.double(), reference_probs(block, feed), rtol=0, atol=1e-5)
    if which != "hf":
        assert all(b.attn.fused_attn == fused for b in model.blocks)  # the session's switch undone


def test_inline_capture_with_detach_false_keeps_the_maps_in_the_graph():
    for model in (tiny_timm(fused=True), tiny_hf()):
        m = load(model)
        x = images(1).requires_grad_(True)
        with vl.capture_attention(m, mode="inline", detach=False) as cap:
            m.forward(x)
        assert all(p.requires_grad for p in cap.maps)
        cap.maps[-1][..., 0].sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0


def test_hf_asks_for_the_probabilities_and_returns_what_the_caller_asked_for():
    model = tiny_hf(classifier=False)
    m = load(model)
    x = images(1)
    with torch.no_grad():
        plain = model(pixel_values=x, output_attentions=True)
        with vl.capture_attention(m) as cap:
            quiet = model(pixel_values=x)
        with vl.capture_attention(m):
            loud = model(pixel_values=x, output_attentions=True)
    assert quiet.attentions is None and torch.equal(quiet.last_hidden_state, plain.last_hidden_state)
    assert all(torch.equal(a, b) for a, b in zip(loud.attentions, plain.attentions))
    assert len(cap.maps) == len(blocks(model))
    # the model's own output_attentions (the last layer's of each stage) are the maps captured there
    last = [sum(model.config.depths[: s + 1]) - 1 for s in range(len(model.config.depths))]
    for s, layer in enumerate(last):
        nw = plain.attentions[s].shape[2]
        torch.testing.assert_close(cap.maps[layer], plain.attentions[s].transpose(1, 2).reshape(
            nw, -1, *plain.attentions[s].shape[-2:]), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- distance and rollout
def dense(probs: torch.Tensor, g) -> np.ndarray:
    """[B, query tokens, key tokens] float64: each window's block placed on its query and key grids."""
    p = probs.double().reshape(-1, g.num_windows, g.window_tokens, g.key_tokens).numpy()
    kh, kw = g.keys_grid
    out = np.zeros((p.shape[0], g.grid[0] * g.grid[1], kh * kw))
    for w in range(g.num_windows):
        rq, rk = g.index[w] >= 0, g.keys[w] >= 0  # padding queries and keys dropped
        out[:, g.index[w][rq][:, None], g.keys[w][rk][None, :]] += p[:, w][:, rq][:, :, rk]
    return out


def centres(grid: tuple[int, int], stride: tuple[int, int]) -> np.ndarray:
    return np.array([((r + 0.5) * stride[0], (c + 0.5) * stride[1]) for r in range(grid[0]) for c in range(grid[1])])


def assert_distance_is_a_dense_float64_computation(m: vl.LoadedModel, x: torch.Tensor,
                                                  kinds: tuple[str, ...] = tuple(e[4] for e in EXPECTED)
                                                  ) -> WindowedDistanceResult:
    """``vl.attention_distance`` against float64 over dense query-by-key matrices: queries at their stage's
    centres, keys at the centres of their own grid (a pooling block's input grid), in pixels; the window-uniform
    distance against the mean over each query of the mean distance to its window's keys."""
    n = x.shape[0]
    got = vl.attention_distance(m, x)
    windows = m.family.windows(m.model, m.spec.image_size)
    with vl.capture_attention(m) as cap, torch.no_grad():
        m.logits(x)
    for layer, (g, probs) in enumerate(zip(windows, cap.maps)):
        key_stride = tuple(s * g.grid[0] // g.keys_grid[0] for s in g.stride_px) if g.key_index is not None \
            else g.stride_px
        qc, kc = centres(g.grid, g.stride_px), centres(g.keys_grid, key_stride)
        d = np.linalg.norm(qc[:, None] - kc[None], axis=-1)
        heads = probs.shape[1]
        per_image = np.zeros((n, heads))
        for head in range(heads):
            a = dense(probs[:, head], g)
            per_image[:, head] = ((a * d).sum(-1) / a.sum(-1)).mean(-1)
        np.testing.assert_allclose(got.mean_px[layer, :heads], per_image.mean(0), rtol=FLOAT32_RTOL, atol=1e-12)
        np.testing.assert_allclose(got.std_px[layer, :heads], per_image.std(0), rtol=1e-8, 
                                   atol=max(1e-10, FLOAT32_RTOL * per_image.max()))
        assert np.isnan(got.mean_px[layer, heads:]).all()
        allowed = dense(torch.ones(g.num_windows, 1, g.window_tokens, g.key_tokens)[:, 0], g)[0] > 0
        want_uniform = ((d * allowed).sum(-1) / allowed.sum(-1)).mean()
        assert got.window_uniform_px[layer] == pytest.approx(want_uniform, rel=1e-12)
    assert got.kinds == kinds
    return got


def assert_rollout_is_a_brute_force_dense_composition(m: vl.LoadedModel, x: torch.Tensor) -> RolloutResult:
    """``vl.attention_rollout`` against explicit float64 matrices: per block (A + P) / rowsum, A the head-fused
    (mean) maps on [query tokens, input tokens], P the identity, or for a pooling block the stated transport of
    its pooled residual (each pooled token the mean of its 2x2 block, written here); composed from the mean over
    the last stage's tokens back to the stage-0 grid."""
    n = x.shape[0]
    got = vl.attention_rollout(m, x)
    windows = m.family.windows(m.model, m.spec.image_size)
    with vl.capture_attention(m) as cap, torch.no_grad():
        m.logits(x)
    last = windows[-1].num_tokens
    v = np.full((n, 1, last), 1.0 / last)
    for g, probs in reversed(list(zip(windows, cap.maps))):
        a = dense(probs.mean(dim=1), g)
        p = hand_pool(g.keys_grid) if g.key_index is not None else np.eye(g.num_tokens)
        r = a + p
        v = v @ (r / r.sum(-1, keepdims=True))
    want = v[:, 0].reshape(n, *windows[0].in_grid)
    want = want / want.reshape(n, -1).max(-1)[:, None, None]
    np.testing.assert_allclose(got.maps, want, rtol=1e-10, atol=1e-12)
    assert got.grid == (16, 24) and got.image_size == IMG
    return got


@pytest.mark.parametrize("which", ["timm", "hf"])
def test_distance_and_rollout_equal_the_dense_float64_computations(which):
    m = load(tiny_timm() if which == "timm" else tiny_hf())
    got = assert_distance_is_a_dense_float64_computation(m, images(3))
    assert np.nanmax(got.of_window) - np.nanmin(got.of_window) > 0.05  # peaky weights: heads differ
    assert_rollout_is_a_brute_force_dense_composition(m, images(2))


def test_known_answer_uniform_attention_fills_its_window():
    model = tiny_timm()
    with torch.no_grad():
        for b in model.blocks:
            b.attn.qkv.weight.zero_(), b.attn.qkv.bias.zero_()
    got = vl.attention_distance(load(model), images(2))
    np.testing.assert_allclose(np.nan_to_num(got.of_window, nan=1.0), 1.0, rtol=0, atol=FLOAT32_RTOL)
    # a pooling block's keys are the input tokens: its uniform distance is over the finer grid
    assert got.window_uniform_px[2] != got.window_uniform_px[3]


def test_one_querys_window_is_the_keys_it_attends_on_their_grid():
    m = load(tiny_timm())
    from vitlens.views.windowed_rollout import query_window_attention, window_maps

    maps = window_maps(m, images(1))
    windows = m.family.windows(m.model, m.spec.image_size)

    got = query_window_attention(maps[2], windows[2], 3, 5)  # a pooled query on the 8x12 grid
    assert got.shape == (2, 16, 24)
    np.testing.assert_allclose(got.sum((1, 2)), 1.0, rtol=1e-6)
    support = np.argwhere(got[0] > 0)
    # its window: the 8x8 mask unit holding its 2x2 block (rows 6-7, cols 10-11 of the 16x24 grid)
    assert support[:, 0].min() == 0 and support[:, 0].max() == 7 and support[:, 1].min() == 8 \
        and support[:, 1].max() == 15


# ------------------------------------------------------------------------------------------------ the whole views
@pytest.mark.parametrize("which", ["timm", "hf"])
def test_analyze_and_the_report_run_and_the_position_view_reads_the_table(which, tmp_path):
    from vitlens.report.html import model_figures, model_section, page_html

    m = load(tiny_timm() if which == "timm" else tiny_hf())
    x = images(2)
    a = vl.analyze(m, x)
    assert isinstance(a.distance, WindowedDistanceResult) and a.rollout.maps.shape == (2, 16, 24)
    assert a.filters is not None and a.position is not None
    figs = model_figures(a, [np.asarray(i) for i in m.display(x)])
    assert {"filters", "position", "distance", "rollout"} <= set(figs)
    page = page_html("tiny Hiera", model_section(a, figs, {}))
    (tmp_path / "report.html").write_text(page)
    assert "query-pooled window" in page and "tiny-hiera" in page


def test_abs_win_position_is_what_the_model_adds_at_each_token():
    model = tiny_timm(abs_win_pos_embed=True, global_pos_size=(4, 6))
    m = load(model)
    table, grid = m.family.position_table(model, m.spec)
    assert grid == (16, 24) and table.shape == (1, 16 * 24, 8)
    x = torch.zeros(1, 16 * 24, 8)
    torch.testing.assert_close(table, model._pos_embed(x))


def test_hf_loads_by_hf_name_and_refuses_what_it_does_not_read(tmp_path):
    import transformers

    tiny_hf().save_pretrained(tmp_path / "hiera")
    m = vl.load_model(f"hf:{tmp_path / 'hiera'}", device="cpu")
    assert m.family.name == "hf-hiera" and m.spec.num_classes == 5
    assert m.data_config["mean"] == (0.485, 0.456, 0.406)
    with pytest.raises(vl.UnsupportedModelError, match="HieraForPreTraining"):
        vl.LoadedModel.from_module(transformers.HieraForPreTraining(transformers.HieraConfig(
            **HF_SIZE, decoder_hidden_size=8, decoder_depth=1, decoder_num_heads=1)))


def test_a_vit_view_is_refused_for_hiera_in_one_line():
    m = load(tiny_timm())
    with pytest.raises(vl.UnsupportedModelError, match="attention_maps.*hierarchical"):
        vl.attention_maps(m, images(1))


# ------------------------------------------------------------------------------------- SAM 2's Hiera (HieraDet)
DET_KINDS = ("window", "query-pooled window", "window", "query-pooled window", "global", "query-pooled window")


def tiny_hieradet(fused: bool = False, seed: int = 0) -> nn.Module:
    """timm's HieraDet on the 16x24 grid: 4x4 windows in stage 0, 2x2 in stage 1, a global block in stage 2, and a
    last pooling block whose 4x4 windows pad its 4x6 input to 4x8 (padding keys, and pooled queries that are
    padding)."""
    import timm

    torch.manual_seed(seed)
    model = timm.create_model("sam2_hiera_tiny", pretrained=False, embed_dim=8, num_heads=1, stages=(1, 2, 2, 1),
                              window_spec=(4, 2, 4, 2), global_att_blocks=(4,), global_pos_size=(4, 4),
                              num_classes=5, pretrained_cfg_overlay=dict(input_size=(3, *IMG))).eval()
    _peaky([b.attn.qkv for b in model.blocks], seed)
    for b in model.blocks:
        b.attn.fused_attn = fused
    return model


def padded_windows(grid: tuple[int, int], window: int) -> np.ndarray:
    """SAM's partition written out: the grid padded to whole windows (bottom, right), windows row-major, positions
    row-major inside; window 0 means one window over the whole grid. [windows, N], -1 = padding."""
    h, w = grid
    if window == 0:
        return np.arange(h * w)[None]
    hp, wp = -(-h // window) * window, -(-w // window) * window
    padded = np.full((hp, wp), -1)
    padded[:h, :w] = np.arange(h * w).reshape(h, w)
    return np.stack([padded[r:r + window, c:c + window].ravel() for r in range(0, hp, window)
                     for c in range(0, wp, window)])


def test_hieradet_windows_are_the_padded_partition_with_queries_pooled_inside_each_window():
    m = load(tiny_hieradet())
    assert m.family.name == "timm-hieradet" and m.spec.grid == (16, 24) and m.spec.image_size == IMG
    windows = m.family.windows(m.model, m.spec.image_size)
    assert tuple(g.kind for g in windows) == DET_KINDS
    assert [g.grid for g in windows] == [(16, 24), (8, 12), (8, 12), (4, 6), (4, 6), (2, 3)]
    for g, block in zip(windows, m.model.blocks):
        ws = block.window_size[0]
        pooled = block.q_stride is not None
        np.testing.assert_array_equal(g.keys, padded_windows(g.keys_grid, ws))
        np.testing.assert_array_equal(g.index, padded_windows(g.grid, ws // 2 if pooled else ws))
        np.testing.assert_array_equal(g.allowed, np.broadcast_to((g.keys >= 0)[:, None, :], g.allowed.shape))
        if pooled:
            np.testing.assert_array_equal(g.query_from.dense(), hand_pool(g.keys_grid))
    assert (windows[-1].index < 0).sum() == 2 and (windows[-1].keys < 0).sum() == 8  # the padded last block


def hieradet_reference(block: nn.Module, feed: torch.Tensor) -> torch.Tensor:
    """A HieraDet block's attention written out in float64: its normalised input padded to whole windows with
    zeros, cut into windows (row-major), q, k from its qkv weights, q max-pooled over 2x2 inside each window where
    the block pools, softmax(q k^T / sqrt(d)) over the window's keys, padding included as the model attends it."""
    attn = block.attn
    x = feed.double()
    b, h, w, c = x.shape
    ws = block.window_size[0] or None
    if ws:
        x = torch.nn.functional.pad(x, (0, 0, 0, (-w) % ws, 0, (-h) % ws))
        hp, wp = x.shape[1:3]
        x = x.reshape(b, hp // ws, ws, wp // ws, ws, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, ws, ws, c)
    heads = attn.num_heads
    qkv = torch.nn.functional.linear(x, attn.qkv.weight.double(), attn.qkv.bias.double())
    q, k, _v = qkv.reshape(*x.shape[:3], 3, heads, -1).unbind(3)  # [B*, H, W, heads, d]
    if block.q_stride is not None:
        n, hh, ww = q.shape[:3]
        q = q.reshape(n, hh // 2, 2, ww // 2, 2, heads, -1).amax((2, 4))
    d = q.shape[-1]
    q, k = q.flatten(1, 2), k.flatten(1, 2)
    return (torch.einsum("nqhd,nkhd->nhqk", q, k) * d ** -0.5).softmax(-1)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_hieradet_capture_is_the_blocks_own_attention_and_leaves_the_outputs(fused, mode):
    model = tiny_hieradet(fused=fused)
    m = load(model)
    x = images()
    with torch.no_grad():
        plain = m.logits(x)
        feeds, hooks = recording_feeds(model)
        with vl.capture_attention(m, mode=mode) as cap:
            out = m.logits(x)
        for h in hooks:
            h.remove()
    if mode == "side" or not fused:
        assert torch.equal(out, plain)
    else:
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    assert len(cap.maps) == len(model.blocks) == len(feeds)
    for block, feed, got in zip(model.blocks, feeds, cap.maps):
        torch.testing.assert_close(got.double(), hieradet_reference(block, feed), rtol=0, atol=1e-5)
    assert all(b.attn.fused_attn == fused for b in model.blocks)


def test_hieradet_distance_rollout_and_analyze():
    m = load(tiny_hieradet())
    assert_distance_is_a_dense_float64_computation(m, images(3), DET_KINDS)
    assert_rollout_is_a_brute_force_dense_composition(m, images(2))
    a = vl.analyze(m, images(2))
    assert isinstance(a.distance, WindowedDistanceResult) and a.rollout.maps.shape == (2, 16, 24)
    table, grid = m.family.position_table(m.model, m.spec)
    torch.testing.assert_close(table.reshape(1, *grid, -1), m.model._pos_embed(torch.zeros(1, *grid, 8)))
