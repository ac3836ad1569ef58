"""Hugging Face SegFormer (the Mix Transformer: efficient attention over keys reduced by a strided convolution,
overlapping patch embeddings, PVT v2's framework): the capture against each block's attention written out here in
float64 from its weights and against the model's own eager probabilities, the outputs bit-identical under side
capture (sdpa's call read) and inline capture the model's own eager tensor, the grids, centres and transports against hand-written poolings, the distance in pixels against
a dense float64 computation, the rollout against a brute-force composition of dense matrices, and the
semantic-segmentation model read through its ``segformer``."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlens as vl
from vitlens.views.distance import FLOAT32_RTOL
from test_pvt import brute_force_rollout, pool_matrix

transformers = pytest.importorskip("transformers")

#: 64 px, stages of 16x16, 8x8, 4x4, 2x2 tokens (strides 4, 8, 16, 32), depths 1, 2, 1, 1, keys reduced by 4, 2, 1, 1
TINY = dict(image_size=64, hidden_sizes=[8, 16, 16, 16], depths=[1, 2, 1, 1], num_attention_heads=[1, 2, 2, 2],
            mlp_ratios=[2, 2, 2, 2], sr_ratios=[4, 2, 1, 1], num_labels=5)


def tiny_segformer(cls: str = "SegformerForImageClassification", attn_implementation: str = "sdpa",
                   seed: int = 0) -> torch.nn.Module:
    """A tiny random SegFormer with large random query and key weights (attention far from uniform)."""
    torch.manual_seed(seed)
    config = transformers.SegformerConfig(**TINY)
    config._attn_implementation = attn_implementation
    model = getattr(transformers, cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attn in attentions(model):
            for lin in (attn.q_proj, attn.k_proj):
                lin.weight.normal_(0.0, 0.6, generator=g)
    return model


def attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [mod for mod in model.modules() if type(mod).__name__ == "SegformerAttention"]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_segformer()


def images(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def reference_probs(attn: torch.nn.Module, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """The block's efficient attention written out in float64 from its weights: q from the tokens, k from the tokens
    reduced (a strided convolution then LayerNorm), softmax(q k^T / sqrt(d)), [B, heads, Nq, Nk]."""
    x = x.double()
    b, n, c = x.shape
    heads = attn.num_attention_heads
    q = F.linear(x, attn.q_proj.weight.double(), attn.q_proj.bias.double())
    kv = x
    if attn.sequence_reduction_ratio > 1:
        red = attn.sequence_reduction
        conv = red.sequence_reduction
        grid = F.conv2d(x.transpose(1, 2).reshape(b, c, h, w), conv.weight.double(), conv.bias.double(),
                        stride=conv.stride)
        kv = F.layer_norm(grid.flatten(2).transpose(1, 2), (c,), red.layer_norm.weight.double(),
                          red.layer_norm.bias.double(), red.layer_norm.eps)
    k = F.linear(kv, attn.k_proj.weight.double(), attn.k_proj.bias.double())
    q, k = (t.reshape(b, -1, heads, c // heads).transpose(1, 2) for t in (q, k))
    return (q @ k.transpose(-2, -1) / (c // heads) ** 0.5).softmax(-1)


GRIDS = [(16, 16), (8, 8), (4, 4), (2, 2)]
STRIDES = [4, 8, 16, 32]
#: each block's stage, its keys' reduction (kernel, stride, padding) or None, whether it starts its stage
BLOCKS = [(0, (4, 4, 0), True), (1, (2, 2, 0), True), (1, (2, 2, 0), False), (2, None, True), (3, None, True)]


def hand_geometry() -> list[dict]:
    """Each block's grids, centres and transports, written out (stage embeddings: 3x3 stride 2 padding 1)."""
    out = []
    for stage, key_pool, first in BLOCKS:
        grid, s = GRIDS[stage], STRIDES[stage]
        ys, xs = np.meshgrid((np.arange(grid[0]) + 0.5) * s, (np.arange(grid[1]) + 0.5) * s, indexing="ij")
        centres = np.stack([ys.ravel(), xs.ravel()], 1)
        kp = np.eye(grid[0] * grid[1]) if key_pool is None else pool_matrix(grid, *key_pool)
        emb = pool_matrix(GRIDS[stage - 1], 3, 2, 1) if first and stage else None
        out.append(dict(stage=stage, grid=grid, q_centres=centres, k_centres=kp @ centres, kp=kp, emb=emb, prefix=0,
                        pooled=bool(key_pool)))
    return out


def test_grids_centres_and_transports_are_the_hand_written_poolings(model):
    m = vl.LoadedModel.from_module(model, name="tiny-segformer")
    assert (m.family.name, m.spec.kind, m.spec.grid, m.spec.stride_px) == ("hf-segformer", "hierarchical", (16, 16),
                                                                           (4, 4))
    windows = m.family.windows(m.model, m.spec.image_size)
    for g, want in zip(windows, hand_geometry(), strict=True):
        assert (g.stage, g.grid, g.kind) == (want["stage"], want["grid"], "pooled" if want["pooled"] else "global")
        np.testing.assert_allclose(g.query_centres, want["q_centres"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(g.key_centres, want["k_centres"], rtol=0, atol=1e-12)
        kp = np.eye(g.num_tokens) if g.key_from is None else g.key_from.dense()
        np.testing.assert_allclose(kp, want["kp"], rtol=0, atol=1e-15)
        if want["emb"] is None:
            assert g.stage_from is None
        else:
            np.testing.assert_allclose(g.stage_from.dense(), want["emb"], rtol=0, atol=1e-15)


@pytest.mark.parametrize("impl,mode", [("sdpa", "side"), ("sdpa", "inline")])
def test_capture_is_the_blocks_own_attention_and_leaves_the_outputs(impl, mode):
    model = tiny_segformer(attn_implementation=impl)
    m = vl.LoadedModel.from_module(model, name="tiny-segformer")
    x = images()
    feeds: list = []

    def hook(_m, args, kwargs):
        values = list(args) + [kwargs[k] for k in ("hidden_states", "height", "width")[len(args):]]
        feeds.append(tuple(values[:3]))

    with torch.no_grad():
        plain = model(x).logits
        model.config._attn_implementation = "eager"
        own = model(x, output_attentions=True).attentions  # the model's own eager probabilities
        model.config._attn_implementation = impl
        hooks = [a.register_forward_pre_hook(hook, with_kwargs=True) for a in attentions(model)]
        with vl.capture_attention(m, mode=mode) as cap:
            out = model(x).logits
        for h in hooks:
            h.remove()
    assert model.config._attn_implementation == impl  # inline's eager switch undone
    assert torch.equal(out, plain) if mode == "side" else torch.allclose(out, plain, rtol=0, atol=1e-5)
    assert len(cap.maps) == len(feeds) == len(own) == 5
    for attn, (feed, h, w), got, theirs in zip(attentions(model), feeds, cap.maps, own):
        torch.testing.assert_close(got.double(), reference_probs(attn, feed, h, w), rtol=0, atol=1e-5)
        if impl == "eager" or mode == "inline":  # the model's own eager tensor
            assert torch.equal(got, theirs.float())
        else:  # sdpa's call read from its arguments: float32 rounding apart from eager's
            torch.testing.assert_close(got, theirs.float(), rtol=0, atol=1e-5)
    assert max(float(p.max()) for p in cap.maps) > 0.5  # far from uniform


def test_distance_and_rollout_equal_dense_float64_computations(model):
    m = vl.LoadedModel.from_module(model, name="tiny-segformer")
    x = images()
    dist, roll = vl.attention_distance(m, x), vl.attention_rollout(m, x)
    with vl.capture_attention(m) as cap, torch.no_grad():
        m.logits(x)
    hand = hand_geometry()
    for layer, (probs, g) in enumerate(zip(cap.maps, hand)):
        d = np.linalg.norm(g["q_centres"][:, None] - g["k_centres"][None], axis=-1)
        a = probs.double().numpy()
        per_image = ((a * d).sum(-1) / a.sum(-1)).mean(-1)
        np.testing.assert_allclose(dist.mean_px[layer, :a.shape[1]], per_image.mean(0), rtol=FLOAT32_RTOL, atol=1e-12)
        assert dist.window_uniform_px[layer] == pytest.approx(d.mean(), rel=1e-12)
    assert dist.kinds == ("pooled", "pooled", "pooled", "global", "global")
    want = np.stack([brute_force_rollout(cap.maps, hand, i).reshape(16, 16) for i in range(2)])
    np.testing.assert_allclose(roll.maps, want / want.max(axis=(1, 2), keepdims=True), rtol=1e-10, atol=1e-12)
    assert roll.source_token.startswith("mean over the last stage's tokens")


def test_the_segmentation_model_is_read_through_its_encoder_and_other_sizes_are_refused():
    seg = tiny_segformer("SegformerForSemanticSegmentation")
    m = vl.LoadedModel.from_module(seg, name="tiny-seg")
    assert m.model is seg.segformer and m.spec.read_module == "segformer (SegformerModel)"
    x = images(1)
    with torch.no_grad():
        assert torch.equal(m.logits(x), seg.segformer(x).last_hidden_state.flatten(2).mean(-1))
    with pytest.raises(vl.UnsupportedModelError, match="built for 64x64") as err:
        vl.LoadedModel.from_module(tiny_segformer(), data_config={"input_size": (3, 128, 128)})
    assert "\n" not in str(err.value)
