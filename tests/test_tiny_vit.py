"""timm TinyViT (``tiny_vit_*``, MobileSAM's encoder): window attention with a learned bias by offset after a
convolutional stage. Capture against each block's attention written out in float64 from its weights (side and
inline), the outputs bit for bit under side capture, the windows against a hand-written pad-and-partition, the
distance against dense float64 matrices, the rollout against a brute-force composition with the mergings' stated
transport (3x3 stride-2 footprint) written out here. A tiny random model: 64 px, attention stages on 8x8 (4x4
windows), 4x4 (one window: "global") and 2x2 tokens (padded into one 4x4 window)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlens as vl
from view_references import forward_with_feeds
from test_pvt import pool_matrix
from test_swin import assert_distance_is_a_dense_float64_computation, dense, hand_windows

timm = pytest.importorskip("timm")


def tiny_vit(seed: int = 0) -> torch.nn.Module:
    """A tiny random TinyViT read at 64 px, with large random qkv weights and biases by offset (far from uniform)."""
    torch.manual_seed(seed)
    model = timm.create_model("tiny_vit_5m_224", pretrained=False, embed_dims=(8, 16, 16, 16), depths=(1, 1, 2, 1),
                              num_heads=(1, 2, 2, 2), window_sizes=(4, 4, 4, 4), num_classes=5,
                              pretrained_cfg_overlay=dict(input_size=(3, 64, 64))).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attn in attentions(model):
            attn.qkv.weight.normal_(0.0, 0.6, generator=g)
            attn.attention_biases.normal_(0.0, 1.0, generator=g)
            attn.attention_bias_cache = {}
    return model


def attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [b.attn for stage in list(model.stages)[1:] for b in stage.blocks]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_vit()


def images(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def reference_probs(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T * scale + B) in float64 from the module's weights: its LayerNorm, its qkv split per head into
    (key_dim, key_dim, val_dim), B its ``attention_biases`` at its ``attention_bias_idxs``."""
    x = F.layer_norm(x.double(), x.shape[-1:], attn.norm.weight.double(), attn.norm.bias.double(), attn.norm.eps)
    b, n, _ = x.shape
    qkv = F.linear(x, attn.qkv.weight.double(), attn.qkv.bias.double()).view(b, n, attn.num_heads, -1)
    q, k, _v = qkv.split([attn.key_dim, attn.key_dim, attn.val_dim], dim=3)
    q, k = q.permute(0, 2, 1, 3), k.permute(0, 2, 1, 3)
    bias = attn.attention_biases.double()[:, attn.attention_bias_idxs]
    return (q @ k.transpose(-2, -1) * attn.scale + bias).softmax(-1)


def test_the_windows_are_a_hand_written_padding_and_partition(model):
    m = vl.LoadedModel.from_module(model, name="tiny-vit")
    assert (m.family.name, m.spec.kind, m.spec.grid, m.spec.stride_px) == ("timm-tinyvit", "hierarchical", (8, 8),
                                                                           (8, 8))
    windows = m.family.windows(m.model, m.spec.image_size)
    assert [(g.stage, g.grid, g.stride_px, g.kind) for g in windows] == [
        (0, (8, 8), (8, 8), "window"), (1, (4, 4), (16, 16), "global"), (1, (4, 4), (16, 16), "global"),
        (2, (2, 2), (32, 32), "window")]
    for g in windows:
        np.testing.assert_array_equal(g.index, hand_windows(g.grid, 4, 0))
        # no mask: every query may attend every real key of its window (padding keys are no tokens)
        np.testing.assert_array_equal(g.allowed, np.broadcast_to((g.index >= 0)[:, None, :], g.allowed.shape))
    assert [g.stage_from is not None for g in windows] == [False, True, False, True]
    np.testing.assert_allclose(windows[1].stage_from.dense(), pool_matrix((8, 8), 3, 2, 1), rtol=0, atol=1e-15)
    np.testing.assert_allclose(windows[3].stage_from.dense(), pool_matrix((4, 4), 3, 2, 1), rtol=0, atol=1e-15)


@pytest.mark.parametrize("mode", ["side", "inline"])
def test_capture_is_each_blocks_own_attention_and_side_capture_leaves_the_outputs(model, mode):
    m = vl.LoadedModel.from_module(model, name="tiny-vit")
    x = images()
    plain, out, maps, feeds = forward_with_feeds(m, attentions(model), x, mode)
    assert torch.equal(out, plain) if mode == "side" else torch.allclose(out, plain, rtol=0, atol=1e-5)
    assert all(a.fused_attn for a in attentions(model)) and len(maps) == len(feeds) == 4
    for attn, feed, got in zip(attentions(model), feeds, maps):
        want = reference_probs(attn, feed)
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert max(float(p.max()) for p in maps) > 0.5  # far from uniform


def test_the_non_fused_path_is_read_at_its_own_softmax():
    model = tiny_vit()
    for a in attentions(model):
        a.fused_attn = False
    m = vl.LoadedModel.from_module(model, name="tiny-vit")
    x = images(1)
    with torch.no_grad():
        plain = model(x)
        with vl.capture_attention(m) as cap:
            out = model(x)
        fused = tiny_vit()
        with vl.capture_attention(vl.LoadedModel.from_module(fused, name="f")) as cap_fused:
            fused(x)
    assert torch.equal(out, plain)
    for a, b in zip(cap.maps, cap_fused.maps):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_distance_and_rollout_equal_dense_float64_computations(model):
    m = vl.LoadedModel.from_module(model, name="tiny-vit")
    x = images(1)
    dist = assert_distance_is_a_dense_float64_computation(m, x)
    assert dist.kinds == ("window", "global", "global", "window")
    got = vl.attention_rollout(m, x)
    windows = m.family.windows(m.model, m.spec.image_size)
    with vl.capture_attention(m) as cap, torch.no_grad():
        m.logits(x)
    product, previous = None, None
    for g, probs in zip(windows, cap.maps):  # (A + I) / rowsum per block, the merging's footprint between stages
        t = g.num_tokens
        a = dense(probs.mean(dim=1), g.index, t) + np.eye(t)
        a = a / a.sum(-1, keepdims=True)
        if previous is not None and previous != g.grid:  # a merging: 3x3 stride 2 padding 1, written out
            product = pool_matrix(previous, 3, 2, 1) @ product
        product = a if product is None else a @ product
        previous = g.grid
    row = np.full((1, 1, 4), 0.25) @ product  # the mean over the last stage's tokens
    want = row[:, 0].reshape(1, 8, 8)
    np.testing.assert_allclose(got.maps, want / want.reshape(1, -1).max(-1)[:, None, None], rtol=1e-10, atol=1e-12)
    assert got.grid == (8, 8) and got.source_token.startswith("mean over the last stage's tokens")


def test_the_position_view_is_the_bias_by_offset(model):
    m = vl.LoadedModel.from_module(model, name="tiny-vit")
    bias = m.family.relative_bias(m.model, m.spec)
    assert len(bias.biases) == 4 and bias.biases[0].shape == (2, 16, 16)
    a = attentions(model)[0]
    assert torch.equal(bias.biases[0], a.attention_biases[:, a.attention_bias_idxs].float())


@pytest.mark.parametrize("name", ["efficientvit_b0", "efficientvit_m0", "fastvit_t8"])
def test_efficient_families_without_a_read_token_attention_are_refused_in_one_true_line(name):
    small = {"fastvit_t8": dict(layers=(1, 1, 1, 1), embed_dims=(8, 16, 32, 64))}.get(name, {})
    model = timm.create_model(name, pretrained=False, **small)
    with pytest.raises(vl.UnsupportedModelError) as err:
        vl.LoadedModel.from_module(model, name=name)
    words = {"efficientvit_b0": "ReLU linear attention", "efficientvit_m0": "cascaded group attention",
             "fastvit_t8": "RepMixer"}[name]
    assert words in str(err.value) and "\n" not in str(err.value)
