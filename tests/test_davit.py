"""timm DaViT (``davit_*``, Florence-2's encoder): its spatial window attention read exactly (capture against each
block's attention written out in float64, side and inline, outputs bit for bit under side capture), the windows
against a hand-written pad-and-partition, distance and rollout against dense float64 computations; its channel
attention (a softmax over channels) never captured or drawn, and said so in the spec and the rollout's source.
A tiny random model: 56 px, stages on 14x14 (4x4 windows, padded), 7x7 and 4x4 tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlens as vl
from view_references import forward_with_feeds
from test_pvt import pool_matrix
from test_swin import (assert_distance_is_a_dense_float64_computation,
                       assert_rollout_is_a_brute_force_dense_composition, hand_windows)

timm = pytest.importorskip("timm")


def tiny_davit(seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = timm.create_model("davit_tiny", pretrained=False, embed_dims=(8, 16, 16), depths=(1, 1, 1),
                              num_heads=(1, 2, 2), window_size=4, num_classes=5,
                              pretrained_cfg_overlay=dict(input_size=(3, 56, 56)), **kw).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attn in attentions(model):
            attn.qkv.weight.normal_(0.0, 0.6, generator=g)
    return model


def attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "WindowAttention"]


def images(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_davit()


def reference_probs(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) in float64 from the module's qkv ([(q, k, v), heads, d] per token)."""
    b, n, c = x.shape
    qkv = F.linear(x.double(), attn.qkv.weight.double(), attn.qkv.bias.double())
    qkv = qkv.reshape(b, n, 3, attn.num_heads, c // attn.num_heads).permute(2, 0, 3, 1, 4)
    return (qkv[0] @ qkv[1].transpose(-2, -1) * (c // attn.num_heads) ** -0.5).softmax(-1)


@pytest.mark.parametrize("mode", ["side", "inline"])
def test_capture_is_each_spatial_blocks_own_attention_and_the_channel_blocks_are_not_drawn(model, mode):
    m = vl.LoadedModel.from_module(model, name="tiny-davit")
    x = images()
    plain, out, maps, feeds = forward_with_feeds(m, attentions(model), x, mode)
    assert torch.equal(out, plain) if mode == "side" else torch.allclose(out, plain, rtol=0, atol=1e-5)
    channel_blocks = [b for b in model.modules() if type(b).__name__ == "ChannelBlock"]
    assert len(channel_blocks) == 3 and len(maps) == len(feeds) == 3 == m.spec.num_layers  # spatial blocks only
    for attn, feed, got in zip(attentions(model), feeds, maps):
        torch.testing.assert_close(got.double(), reference_probs(attn, feed), rtol=0, atol=1e-5)
    assert max(float(p.max()) for p in maps) > 0.5
    assert "channel attention" in m.spec.describe()["not drawn"] and "not a token attention" in m.spec.not_drawn


def test_windows_distance_and_rollout_equal_dense_computations(model):
    m = vl.LoadedModel.from_module(model, name="tiny-davit")
    windows = m.family.windows(m.model, m.spec.image_size)
    assert [(g.stage, g.grid, g.stride_px, g.kind) for g in windows] == [
        (0, (14, 14), (4, 4), "window"), (1, (7, 7), (8, 8), "window"), (2, (4, 4), (16, 16), "global")]
    for g in windows:
        np.testing.assert_array_equal(g.index, hand_windows(g.grid, 4, 0))
    got = assert_distance_is_a_dense_float64_computation(m, images(1))
    assert got.kinds == ("window", "window", "global")
    roll = assert_rollout_is_a_brute_force_dense_composition(m, images(1))  # kernel-2 stage starts: 2x2 means
    assert roll.source_token.endswith("; channel attention not drawn")


def test_florence2s_kernel_3_stage_starts_are_their_footprints():
    m = vl.LoadedModel.from_module(tiny_davit(down_kernel_size=3, channel_attn_v2=True, named_blocks=True), name="fl")
    windows = m.family.windows(m.model, m.spec.image_size)
    np.testing.assert_allclose(windows[1].stage_from.dense(), pool_matrix((14, 14), 3, 2, 1), rtol=0, atol=1e-15)
    np.testing.assert_allclose(windows[2].stage_from.dense(), pool_matrix((7, 7), 3, 2, 1), rtol=0, atol=1e-15)
    x = images(1)
    with torch.no_grad():
        plain = m.model(x)
        with vl.capture_attention(m) as cap:
            assert torch.equal(m.model(x), plain)
    assert [tuple(p.shape) for p in cap.maps] == [(16, 1, 16, 16), (4, 2, 16, 16), (1, 2, 16, 16)]
