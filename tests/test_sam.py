"""SAM / ViTDet image encoder (issue 32): windowed blocks (padded, no shift) and global blocks on one grid, the
decomposed relative-position bias written out here in float64, the windows against a hand-written partition,
distance and rollout against the dense float64 checks every windowed model passes (tests/test_swin.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl

from test_swin import assert_distance_is_a_dense_float64_computation, assert_rollout_is_a_brute_force_dense_composition
from test_swin import hand_windows


def tiny_sam(fused: bool = False, rope: bool = False, img: int = 56) -> torch.nn.Module:
    """A 4-block SAM encoder on a 7x7 grid of 8 px patches (``img`` 56; 40: a 5x5 grid): windows of 3 (padded to
    9x9; 6x6), blocks 1 and 3 global, with large random q/k weights and relative-position tables so the attention is
    far from uniform."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("samvit_base_patch16", pretrained=False, img_size=img, patch_size=8, embed_dim=32,
                              depth=4, num_heads=2, window_size=3, global_attn_indexes=(1, 3), neck_chans=16,
                              use_rel_pos=not rope, use_rope=rope, num_classes=5).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.normal_(0.0, 0.5, generator=g)
            if block.attn.use_rel_pos:
                block.attn.rel_pos_h.normal_(0.0, 0.5, generator=g)
                block.attn.rel_pos_w.normal_(0.0, 0.5, generator=g)
            block.attn.fused_attn = fused
    return model


def images(n: int = 3, img: int = 56) -> torch.Tensor:
    return torch.randn(n, 3, img, img, generator=torch.Generator().manual_seed(1))


def reference_probs(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SAM's attention written out in float64 from what the block hands its attention ([B_, h, w, C] windows):
    softmax(q k^T / sqrt(d) + q . R_h[dy] + q . R_w[dx]) (Li et al. 2022's decomposed bias, from unscaled q), or
    with RoPE softmax(rot(q) rot(k)^T / sqrt(d)) (pairs (x0, x1) rotated by the block's angles), [B_, heads, N, N]."""
    b_, h, w, c = x.shape
    qkv = torch.nn.functional.linear(x.double().reshape(b_, h * w, c), attn.qkv.weight.double(),
                                     attn.qkv.bias.double())
    q, k, _v = qkv.reshape(b_, h * w, 3, attn.num_heads, -1).permute(2, 0, 3, 1, 4)
    if attn.rope is not None:
        sin, cos = attn.rope.get_embed().double().chunk(2, -1)  # [N, d] each, every angle twice (x0, x1 pairs)

        def rotated(t: torch.Tensor) -> torch.Tensor:
            pairs = torch.stack([-t[..., 1::2], t[..., ::2]], -1).reshape(t.shape)  # (x0, x1) -> (-x1, x0)
            return t * cos + pairs * sin

        q, k = rotated(q), rotated(k)
    scores = (q * attn.scale) @ k.transpose(-2, -1)
    if attn.use_rel_pos:
        rows, cols = torch.arange(h), torch.arange(w)
        rh = attn.rel_pos_h.double()[rows[:, None] - rows[None, :] + h - 1]  # [h, h, d]
        rw = attn.rel_pos_w.double()[cols[:, None] - cols[None, :] + w - 1]  # [w, w, d]
        qg = q.reshape(b_, attn.num_heads, h, w, -1)
        bias = torch.einsum("bnyxd,ykd->bnyxk", qg, rh)[..., :, None] + torch.einsum("bnyxd,xkd->bnyxk", qg, rw)[
            ..., None, :]
        scores = scores + bias.reshape(b_, attn.num_heads, h * w, h * w)
    return scores.softmax(-1)


def test_the_windows_are_the_padded_partition_and_global_blocks_one_window():
    m = vl.LoadedModel.from_module(tiny_sam(), name="tiny-sam")
    assert m.spec.kind == "hierarchical" and m.family.name == "timm-sam"
    windows = m.family.windows(m.model, m.spec.image_size)
    assert [g.kind for g in windows] == ["window", "global", "window", "global"]
    for g in windows:
        assert g.grid == (7, 7) and g.stride_px == (8, 8) and g.allowed[g.index >= 0].any()
    np.testing.assert_array_equal(windows[0].index, hand_windows((7, 7), 3, 0))  # 9 windows, padding marked
    np.testing.assert_array_equal(windows[1].index, np.arange(49)[None])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_capture_is_the_blocks_own_attention_and_leaves_the_outputs(fused, mode):
    model = tiny_sam(fused=fused)
    m = vl.LoadedModel.from_module(model, name="tiny-sam")
    x = images()
    feeds: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda _m, args: feeds.append(args[0])) for b in model.blocks]
    with torch.no_grad():
        plain = model(x)
        feeds.clear()
        with vl.capture_attention(m, mode=mode) as cap:
            out = model(x)
    for h in hooks:
        h.remove()
    if mode == "side":
        assert torch.equal(out, plain)
    else:
        torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    assert len(cap.maps) == len(feeds) == 4
    for block, feed, got in zip(model.blocks, feeds, cap.maps):
        want = reference_probs(block.attn, feed)
        assert got.shape == want.shape  # [B * windows, heads, N, N]
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_distance_and_rollout_are_the_dense_float64_computations():
    m = vl.LoadedModel.from_module(tiny_sam(), name="tiny-sam")
    x = images(2)
    d = assert_distance_is_a_dense_float64_computation(m, x)
    assert d.kinds == ("window", "global", "window", "global")
    assert_rollout_is_a_brute_force_dense_composition(m, x)


def test_a_rope_sam_is_read_at_its_own_probabilities():
    model = tiny_sam(rope=True)
    m = vl.LoadedModel.from_module(model, name="tiny-sam-rope")
    x = images(1)
    with torch.no_grad():
        plain = model(x)
        with vl.capture_attention(m) as cap:
            assert torch.equal(model(x), plain)
    for p in cap.maps:
        torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)), rtol=0, atol=1e-5)
    assert vl.attention_distance(m, x).n_images == 1


class _Copies(vl.AttentionConsumer):
    """A streaming consumer that reads window maps and keeps a copy of each (a map it is handed is valid during the
    call only: the views' inline capture makes every block's map in one reused buffer)."""

    reads_windows = True

    def __init__(self) -> None:
        self.maps: list[torch.Tensor] = []
        self.addresses: list[int] = []

    def on_attention(self, layer: int, attn: torch.Tensor, rows: slice | None = None) -> None:
        assert rows is None  # whole window maps, as the windowed views read them
        self.maps.append(attn.clone())
        self.addresses.append(attn.data_ptr())


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("rope,img", [(False, 56), (False, 40), (True, 56), (True, 40)])
def test_the_views_inline_capture_makes_each_map_once_equal_to_float64_and_leaves_the_outputs(fused, rope, img):
    """The views' capture of SAM (inline, the maps in the session's reused workspace, the decomposed bias added from
    its two tables, or RoPE): every block's probabilities equal the float64 reference within 1e-5 (float32 maps of
    at most 49 keys: a few float32 ulps of values <= 1, across windows padded to whole windows: 56 px is a 7x7 grid
    in windows of 3, 40 px a 5x5 one), the output equals the model's own fused and non-fused forwards to float
    rounding, every map was made in the same reused memory, and after the session the model's forward is its own
    again, bit for bit."""
    from vitlens.engine.plan import capture_plan

    model = tiny_sam(fused=fused, rope=rope, img=img)
    m = vl.LoadedModel.from_module(model, name="tiny-sam")
    assert capture_plan(m, 2).mode == "inline" and capture_plan(m, 2).query_rows is None  # whole maps, inline
    x = images(2, img)
    feeds: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda _m, args: feeds.append(args[0])) for b in model.blocks]
    with torch.no_grad():
        plain = model(x)
        for block in model.blocks:
            block.attn.fused_attn = not fused
        other = model(x)  # the other path of timm's own (fused <-> non-fused)
        for block in model.blocks:
            block.attn.fused_attn = fused
        feeds.clear()
        copies = _Copies()
        with vl.capture_attention(m, store=False, consumers=[copies], mode="inline"):
            out = model(x)
            again = model(x)  # the session's second forward: its buffer already holds the largest block's map
        after = model(x)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(out, other, rtol=0, atol=1e-5)
    assert torch.equal(after, plain)
    assert len(copies.maps) == 8 and len(feeds) == 12  # the capture's two forwards, then the one after
    assert torch.equal(again, out) and all(torch.equal(a, b) for a, b in zip(copies.maps[:4], copies.maps[4:]))
    assert len(set(copies.addresses[4:])) == 1  # every block's map made in one buffer, reused (no fresh map a block)
    for block, feed, got in zip(model.blocks, feeds, copies.maps):
        want = reference_probs(block.attn, feed)
        assert got.shape == want.shape  # [B * windows, heads, N, N]
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_the_inline_maps_kept_by_the_capture_are_each_blocks_own():
    """With stored maps (``capture_attention(mode="inline")``) each block's map is a tensor of its own, not the
    reused workspace: every kept map still equals its block's float64 reference after the forward."""
    model = tiny_sam(rope=False, img=40)
    m = vl.LoadedModel.from_module(model, name="tiny-sam")
    x = images(1, 40)
    feeds: list[torch.Tensor] = []
    hooks = [b.attn.register_forward_pre_hook(lambda _m, args: feeds.append(args[0])) for b in model.blocks]
    with torch.no_grad(), vl.capture_attention(m, mode="inline") as cap:
        model(x)
    for h in hooks:
        h.remove()
    assert len({p.data_ptr() for p in cap.maps}) == 4
    for block, feed, got in zip(model.blocks, feeds, cap.maps):
        torch.testing.assert_close(got.double(), reference_probs(block.attn, feed), rtol=0, atol=1e-5)


def test_inline_capture_keeps_the_maps_in_the_graph_through_the_decomposed_bias():
    """``detach=False`` (what gradient attributions capture): the maps carry gradients, and the gradient of the
    output through vitlens's path equals the one through timm's own non-fused path (float rounding)."""
    model = tiny_sam(rope=False, img=40)
    m = vl.LoadedModel.from_module(model, name="tiny-sam")
    x = images(1, 40)
    with torch.enable_grad():
        xi = x.clone().requires_grad_(True)
        model(xi).sum().backward()
        want = xi.grad.clone()
        xi.grad = None
        with vl.capture_attention(m, mode="inline", detach=False) as cap:
            model(xi).sum().backward()
    assert all(p.requires_grad for p in cap.maps)
    torch.testing.assert_close(xi.grad, want, rtol=1e-4, atol=1e-5)
