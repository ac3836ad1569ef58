"""timm MaxViT / MaxxViT (``maxvit_*``, ``maxxvit_*``, ``maxxvitv2_*``): block attention within local windows and grid
attention over a dilated grid. Capture against each layer's attention written out in float64 from its weights
(side and inline; channels-last and NCHW attention; head-first and not), the outputs bit for bit under side
capture, the windows and grids against hand-written partitions, the distance in pixels (the grid layers' keys spread
over the image) against dense float64 matrices, the rollout against a brute-force composition, MaxViT-PM's parallel
blocks refused in one line. Tiny random models: 64 px, stages on 16x16 and 8x8 tokens, 4x4 windows and grids."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlens as vl
from view_references import forward_with_feeds
from test_swin import (assert_distance_is_a_dense_float64_computation,
                       assert_rollout_is_a_brute_force_dense_composition, hand_windows)

timm = pytest.importorskip("timm")

#: (timm config, overrides of its transformer config): channels-last relative-position MLP; TF's (not head first);
#: MaxxViT v2 (ConvNeXt blocks, grid attention only); NCHW attention
CONFIGS = {"rmlp": ("maxvit_rmlp_pico_rw", {}), "tf": ("maxvit_tiny_tf", {}), "v2": ("maxxvitv2_nano_rw", {}),
           "nchw": ("maxvit_pico_rw", {"use_nchw_attn": True})}


def tiny_maxvit(which: str, seed: int = 0) -> torch.nn.Module:
    """A tiny random MaxxVit of a timm config at 64 px (4x4 windows and grids), large random qkv weights and
    relative-position biases (far from uniform)."""
    from timm.models.maxxvit import MaxxVit, model_cfgs

    base, over = CONFIGS[which]
    cfg = model_cfgs[base]
    stem = (8, 16) if isinstance(cfg.stem_width, tuple) else 16
    cfg = dataclasses.replace(cfg, embed_dim=(16, 32), depths=(1, 1), stem_width=stem, transformer_cfg=dataclasses.replace(
        cfg.transformer_cfg, dim_head=8, partition_ratio=16, **over))
    torch.manual_seed(seed)
    model = MaxxVit(cfg, img_size=64, num_classes=5).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for attn in attentions(model):
            attn.qkv.weight.normal_(0.0, 0.6, generator=g)
            for p in attn.rel_pos.parameters():
                p.normal_(0.0, 1.0, generator=g)
    return model


def layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [p for stage in model.stages for b in stage.blocks for p in (b.attn_block, b.attn_grid) if p is not None]


def attentions(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [p.attn for p in layers(model)]


def images(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 64, 64, generator=torch.Generator().manual_seed(seed))


def reference_probs(attn: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + B) in float64 from the module's weights: its qkv (a linear map, or a 1x1
    convolution on NCHW windows), split per head (head first: [heads, (q, k, v), d]; else [(q, k, v), heads, d]),
    B its ``rel_pos.get_bias()``."""
    x = x.double()
    w, b = attn.qkv.weight.double(), attn.qkv.bias.double()
    if x.dim() == 4 and type(attn).__name__ == "Attention2d":
        x, w = x.flatten(2).transpose(1, 2), w[:, :, 0, 0]
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    qkv = F.linear(x, w, b)
    n, h, d = qkv.shape[1], attn.num_heads, attn.dim_head
    if attn.head_first:
        qkv = qkv.view(-1, n, h, 3, d).permute(3, 0, 2, 1, 4)
    else:
        qkv = qkv.view(-1, n, 3, h, d).permute(2, 0, 3, 1, 4)
    q, k = qkv[0], qkv[1]
    return (q @ k.transpose(-2, -1) * d ** -0.5 + attn.rel_pos.get_bias().double()).softmax(-1)


def hand_grid(grid: tuple[int, int], g: int) -> np.ndarray:
    """Grid attention's partition, written out: window (i, j) holds the tokens (a H/g + i, b W/g + j), a, b < g,
    windows row-major over (i, j), positions row-major over (a, b): [windows, g * g]."""
    h, w = grid
    sh, sw = h // g, w // g
    return np.stack([np.array([(a * sh + i) * w + (b * sw + j) for a in range(g) for b in range(g)])
                     for i in range(sh) for j in range(sw)])


@pytest.fixture(scope="module")
def rmlp() -> torch.nn.Module:
    return tiny_maxvit("rmlp")


def test_the_windows_and_grids_are_hand_written_partitions(rmlp):
    m = vl.LoadedModel.from_module(rmlp, name="tiny-maxvit")
    assert (m.family.name, m.spec.kind, m.spec.grid, m.spec.stride_px) == ("timm-maxvit", "hierarchical", (16, 16),
                                                                           (4, 4))
    windows = m.family.windows(m.model, m.spec.image_size)
    assert [(g.stage, g.grid, g.stride_px, g.kind) for g in windows] == [
        (0, (16, 16), (4, 4), "window"), (0, (16, 16), (4, 4), "grid"), (1, (8, 8), (8, 8), "window"),
        (1, (8, 8), (8, 8), "grid")]
    for g in windows:
        want = hand_windows(g.grid, 4, 0) if g.kind == "window" else hand_grid(g.grid, 4)
        np.testing.assert_array_equal(g.index, want)
        assert g.allowed.all()
    # a grid window's tokens are H/4 tokens apart: 4 rows (16 px) at stage 0
    assert np.diff(windows[1].index[0][:4]).tolist() == [4, 4, 4]


@pytest.mark.parametrize("which, mode", [("rmlp", "side"), ("tf", "inline"), ("v2", "side"), ("nchw", "inline")])
def test_capture_is_each_layers_own_attention_and_side_capture_leaves_the_outputs(which, mode, rmlp):
    model = rmlp if which == "rmlp" else tiny_maxvit(which)
    m = vl.LoadedModel.from_module(model, name=which)
    x = images()
    plain, out, maps, feeds = forward_with_feeds(m, attentions(model), x, mode)
    assert torch.equal(out, plain) if mode == "side" else torch.allclose(out, plain, rtol=0, atol=1e-5)
    kinds = [g.kind for g in m.family.windows(m.model, m.spec.image_size)]
    assert kinds == (["grid", "grid"] if which == "v2" else ["window", "grid"] * 2)
    assert len(maps) == len(feeds) == len(kinds)
    for attn, feed, got in zip(attentions(model), feeds, maps):
        want = reference_probs(attn, feed)
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    assert max(float(p.max()) for p in maps) > 0.5


def test_distance_and_rollout_equal_dense_float64_computations(rmlp):
    m = vl.LoadedModel.from_module(rmlp, name="tiny-maxvit")
    got = assert_distance_is_a_dense_float64_computation(m, images(1))
    assert got.kinds == ("window", "grid", "window", "grid")
    # uniform over a grid window: its keys spread over the image, farther than a local window's
    assert got.window_uniform_px[1] > 3 * got.window_uniform_px[0]
    roll = assert_rollout_is_a_brute_force_dense_composition(m, images(1))
    assert roll.source_token.startswith("mean over the last stage's tokens")


def test_parallel_blocks_are_refused_in_one_line_and_the_bias_view_is_each_layers_own(rmlp):
    from timm.models.maxxvit import MaxxVit, model_cfgs

    cfg = dataclasses.replace(model_cfgs["maxvit_tiny_pm"], embed_dim=(16, 32), depths=(1, 1), stem_width=(8, 16),
                              transformer_cfg=dataclasses.replace(model_cfgs["maxvit_tiny_pm"].transformer_cfg,
                                                                  dim_head=8, partition_ratio=16))
    with pytest.raises(vl.UnsupportedModelError, match="ParallelMaxxVitBlock") as err:
        vl.LoadedModel.from_module(MaxxVit(cfg, img_size=64, num_classes=5), name="pm")
    assert "\n" not in str(err.value)
    m = vl.LoadedModel.from_module(rmlp, name="tiny-maxvit")
    bias = m.family.relative_bias(m.model, m.spec)
    assert len(bias.biases) == 4 and torch.equal(bias.biases[1], attentions(rmlp)[1].rel_pos.get_bias()[0].float())
