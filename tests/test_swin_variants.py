"""The Swin variants (issue 32): timm ``swinv2_*`` and ``swinv2_cr_*``, Hugging Face ``Swin*`` and ``Swinv2*``,
checked as tests/test_swin.py checks timm's Swin v1 (its helpers imported): capture against each block's own
attention written out here in float64 from its own q, k, position bias and mask (side and inline, the outputs
bit for bit under side capture), the windows against a hand-written shift + padding + partition, attention
distance against dense float64 matrices, known answers (uniform attention fills its window), rollout against
a brute-force dense composition; Hugging Face Swin's maps the same under sdpa and eager; inline maps in the
graph; the model untouched by reading its windows; ``hf:`` loading and one-line refusals. The models are tiny
and random (no network): 3 stages on a 14x14 grid of 4x4 windows, so padding and shifted windows cut by the
border are exercised."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitlens as vl
from vitlens.views.distance import FLOAT32_RTOL
from vitlens.views.windowed import WindowedDistanceResult
from test_swin import (assert_distance_is_a_dense_float64_computation,
                       assert_rollout_is_a_brute_force_dense_composition, hand_windows, images)

HF_SIZE = dict(image_size=56, patch_size=4, embed_dim=16, depths=[2, 2, 2], num_heads=[2, 2, 4], window_size=4,
               num_labels=5)


def _timm(name: str, seed: int) -> nn.Module:
    """A 3-stage timm Swin V2 on a 14x14 grid with 4x4 windows (stage 0 pads to 16x16 and its shifted windows are
    cut by the border, stage 1 pads 7x7 to 8x8, stage 2 is one 4x4 window), as test_swin's v1."""
    import timm

    torch.manual_seed(seed)
    return timm.create_model(name, pretrained=False, img_size=56, window_size=4, embed_dim=16, depths=(2, 2, 2),
                             num_heads=(2, 2, 4), num_classes=5).eval()


def _peaky_cosine(attn: nn.Module, g: torch.Generator, mlp: list[nn.Linear]) -> None:
    """Random q/k weights, a logit scale per head between 10 and 30 (under the clamp at 100) and a random
    position-bias MLP, so the cosine attention is far from uniform and the bias differs by offset (weights of
    std 0.3: with std 1 the float32 MLP of 512 hidden units alone moves the model's probabilities ~1e-5 from
    float64)."""
    attn.qkv.weight.normal_(0.0, 0.6, generator=g)
    attn.logit_scale.copy_(torch.empty_like(attn.logit_scale).uniform_(math.log(10), math.log(30), generator=g))
    for linear in mlp:
        linear.weight.normal_(0.0, 0.3, generator=g)
        if linear.bias is not None:
            linear.bias.normal_(0.0, 1.0, generator=g)


def tiny_timm_swinv2(seed: int = 0) -> nn.Module:
    model = _timm("swinv2_tiny_window8_256", seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in model.layers:
            for block in stage.blocks:
                _peaky_cosine(block.attn, g, [block.attn.cpb_mlp[0], block.attn.cpb_mlp[2]])
                block.attn.q_bias.normal_(0.0, 0.5, generator=g)
                block.attn.v_bias.normal_(0.0, 0.5, generator=g)
    return model


def tiny_timm_swinv2_cr(seed: int = 0) -> nn.Module:
    model = _timm("swinv2_cr_tiny_224", seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for stage in model.stages:
            for block in stage.blocks:
                _peaky_cosine(block.attn, g, [block.attn.meta_mlp.fc1, block.attn.meta_mlp.fc2])
                block.attn.qkv.bias.normal_(0.0, 0.5, generator=g)
    return model


def _hf_layers(model: nn.Module) -> list[nn.Module]:
    base = getattr(model, "swin", None) or getattr(model, "swinv2", None) or model
    return [layer for stage in base.encoder.layers for layer in stage.blocks]


def tiny_hf_swin(classifier: bool = True, seed: int = 0, attn_implementation: str | None = None) -> nn.Module:
    """A 3-stage transformers Swin of the same sizes (its default attention implementation: sdpa)."""
    from transformers import SwinConfig, SwinForImageClassification, SwinModel

    torch.manual_seed(seed)
    config = SwinConfig(**HF_SIZE)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    model = (SwinForImageClassification if classifier else SwinModel)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in _hf_layers(model):
            layer.attention.q_proj.weight.normal_(0.0, 0.6, generator=g)
            layer.attention.k_proj.weight.normal_(0.0, 0.6, generator=g)
            layer.attention.relative_position_bias.relative_position_bias_table.normal_(0.0, 1.0, generator=g)
    return model


def tiny_hf_swinv2(classifier: bool = True, seed: int = 0) -> nn.Module:
    """A 3-stage transformers Swin V2 of the same sizes: its stage 2 builds 3x3 windows from the floor of
    14 / 4 at construction while its forward gets the 4x4 grid (so it pads to 6x6): the model's own code."""
    from transformers import Swinv2Config, Swinv2ForImageClassification, Swinv2Model

    torch.manual_seed(seed)
    model = (Swinv2ForImageClassification if classifier else Swinv2Model)(Swinv2Config(**HF_SIZE)).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in _hf_layers(model):
            attn = layer.attention.self
            attn.query.weight.normal_(0.0, 0.6, generator=g)
            attn.key.weight.normal_(0.0, 0.6, generator=g)
            attn.logit_scale.copy_(torch.empty_like(attn.logit_scale).uniform_(math.log(10), math.log(30), generator=g))
            for linear in (attn.continuous_position_bias_mlp[0], attn.continuous_position_bias_mlp[2]):
                linear.weight.normal_(0.0, 0.3, generator=g)
    return model


# -- each block's attention written out here, float64, from the block's own parameters (the papers' formulas) --

def _softmax_with_mask(scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """softmax over the keys of scores [B * windows, heads, N, N] + the shifted windows' mask [windows, N, N]."""
    if mask is not None:
        b_, heads, n, _ = scores.shape
        nw = mask.shape[0]
        scores = (scores.view(-1, nw, heads, n, n) + mask.double()[None, :, None]).view(b_, heads, n, n)
    return scores.softmax(-1)


def _cosine(q: torch.Tensor, k: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Swin V2's scaled cosine attention: cos(q, k) * exp(min(logit_scale, log 100)), per head."""
    scale = torch.clamp(logit_scale.double().reshape(1, -1, 1, 1), max=math.log(100.0)).exp()
    return (F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)) * scale


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b_, n, c = x.shape
    return x.reshape(b_, n, heads, c // heads).transpose(1, 2)


def reference_timm_swinv2(block: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """timm ``swinv2_*``: softmax(cos(q, k) * scale + 16 sigmoid(MLP(log-spaced offsets)) + mask)."""
    attn = block.attn
    w = attn.qkv.weight.double()
    c = w.shape[1]
    q = _heads(F.linear(x.double(), w[:c], attn.q_bias.double()), attn.num_heads)
    k = _heads(F.linear(x.double(), w[c:2 * c]), attn.num_heads)  # no key bias (timm keeps a zero buffer)
    table = attn.relative_coords_table.double().reshape(-1, 2)
    mlp = attn.cpb_mlp
    bias = F.linear(F.relu(F.linear(table, mlp[0].weight.double(), mlp[0].bias.double())), mlp[2].weight.double())
    n = q.shape[-2]
    bias = bias[attn.relative_position_index.reshape(-1)].reshape(n, n, -1).permute(2, 0, 1)
    return _softmax_with_mask(_cosine(q, k, attn.logit_scale) + 16 * torch.sigmoid(bias)[None], mask)


def reference_timm_swinv2_cr(block: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """timm ``swinv2_cr_*``: softmax(cos(q, k) * scale + MLP(sign(d) log(1 + |d|)) + mask)."""
    attn = block.attn
    w, b = attn.qkv.weight.double(), attn.qkv.bias.double()
    c = w.shape[1]
    q = _heads(F.linear(x.double(), w[:c], b[:c]), attn.num_heads)
    k = _heads(F.linear(x.double(), w[c:2 * c], b[c:2 * c]), attn.num_heads)
    n = q.shape[-2]
    wy, wx = attn.window_size
    ys, xs = torch.meshgrid(torch.arange(wy, dtype=torch.float64), torch.arange(wx, dtype=torch.float64),
                            indexing="ij")
    pos = torch.stack([ys.reshape(-1), xs.reshape(-1)], -1)
    offsets = (pos[:, None, :] - pos[None, :, :]).reshape(-1, 2)
    coords = torch.sign(offsets) * torch.log1p(offsets.abs())  # the log-spaced offsets, written out here
    mlp = attn.meta_mlp
    bias = F.linear(F.relu(F.linear(coords, mlp.fc1.weight.double(), mlp.fc1.bias.double())), mlp.fc2.weight.double(),
                    mlp.fc2.bias.double())
    bias = bias.reshape(n, n, -1).permute(2, 0, 1)
    return _softmax_with_mask(_cosine(q, k, attn.logit_scale) + bias[None], mask)


def reference_hf_swin(layer: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """transformers Swin: softmax(q k^T / sqrt(d) + B (its table at its index) + mask)."""
    attn = layer.attention
    heads = attn.num_attention_heads
    q = _heads(F.linear(x.double(), attn.q_proj.weight.double(), attn.q_proj.bias.double()), heads)
    k = _heads(F.linear(x.double(), attn.k_proj.weight.double(), attn.k_proj.bias.double()), heads)
    rpb = attn.relative_position_bias
    n = q.shape[-2]
    bias = rpb.relative_position_bias_table.double()[rpb.relative_position_index.reshape(-1)]
    bias = bias.reshape(n, n, -1).permute(2, 0, 1)
    return _softmax_with_mask(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias[None], mask)


def reference_hf_swinv2(layer: nn.Module, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """transformers Swin V2: softmax(cos(q, k) * scale + 16 sigmoid(MLP(log-spaced offsets)) + mask), the mask
    added once as the paper says (the model adds it twice: -200 instead of -100, exp(-100) ~ 4e-44 apart)."""
    attn = layer.attention.self
    heads = attn.num_attention_heads
    q = _heads(F.linear(x.double(), attn.query.weight.double(), attn.query.bias.double()), heads)
    k = _heads(F.linear(x.double(), attn.key.weight.double()), heads)
    mlp = attn.continuous_position_bias_mlp
    table = attn.relative_coords_table.double().reshape(-1, 2)
    bias = F.linear(F.relu(F.linear(table, mlp[0].weight.double(), mlp[0].bias.double())), mlp[2].weight.double())
    n = q.shape[-2]
    bias = bias[attn.relative_position_index.reshape(-1)].reshape(n, n, -1).permute(2, 0, 1)
    return _softmax_with_mask(_cosine(q, k, attn.logit_scale) + 16 * torch.sigmoid(bias)[None], mask)


class Variant:
    """One model of the issue: how to build it, its blocks, the module its block hands (windows, mask), the
    reference, the order of shift and padding, each block's (window, shift) and kind."""

    def __init__(self, family: str, build: Callable[[], nn.Module], blocks: Callable[[nn.Module], list],
                 attention: str, reference: Callable, pad_first: bool, window_shift: list, kinds: list) -> None:
        self.family, self.build, self.blocks, self.attention = family, build, blocks, attention
        self.reference, self.pad_first, self.window_shift, self.kinds = reference, pad_first, window_shift, kinds


def _timm_blocks(stages: str) -> Callable[[nn.Module], list]:
    return lambda model: [b for stage in getattr(model, stages) for b in stage.blocks]


KINDS = ["window", "shifted window", "window", "shifted window", "global", "global"]
VARIANTS = {
    "timm-swinv2": Variant("timm-swinv2", tiny_timm_swinv2, _timm_blocks("layers"), "attn", reference_timm_swinv2,
                           False, [(4, 0), (4, 2), (4, 0), (4, 2), (4, 0), (4, 0)], KINDS),
    "timm-swinv2-cr": Variant("timm-swinv2-cr", tiny_timm_swinv2_cr, _timm_blocks("stages"), "attn",
                              reference_timm_swinv2_cr, False, [(4, 0), (4, 2), (4, 0), (4, 2), (4, 0), (4, 0)], KINDS),
    # transformers pads before the cyclic shift; Swin's last stage clamps its shift to 0 at the forward
    "hf-swin": Variant("hf-swin", tiny_hf_swin, _hf_layers, "attention", reference_hf_swin, True,
                       [(4, 0), (4, 2), (4, 0), (4, 2), (4, 0), (4, 0)], KINDS),
    "hf-swin-model": Variant("hf-swin", lambda: tiny_hf_swin(classifier=False), _hf_layers, "attention",
                             reference_hf_swin, True, [(4, 0), (4, 2), (4, 0), (4, 2), (4, 0), (4, 0)], KINDS),
    "hf-swinv2": Variant("hf-swin", tiny_hf_swinv2, _hf_layers, "attention", reference_hf_swinv2, True,
                         [(4, 0), (4, 2), (4, 0), (4, 2), (3, 0), (3, 0)], KINDS[:4] + ["window", "window"]),
    "hf-swinv2-model": Variant("hf-swin", lambda: tiny_hf_swinv2(classifier=False), _hf_layers, "attention",
                               reference_hf_swinv2, True, [(4, 0), (4, 2), (4, 0), (4, 2), (3, 0), (3, 0)],
                               KINDS[:4] + ["window", "window"]),
}


def load(model: nn.Module, name: str = "tiny") -> vl.LoadedModel:
    return vl.LoadedModel.from_module(model, name=name, device="cpu")


def recording_attention_inputs(v: Variant, model: nn.Module) -> tuple[list, list]:
    """Hooks that record what every block hands its attention in a forward: the windows and the mask."""
    feeds: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def pre_hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("mask", kwargs.get("attention_mask", args[1] if len(args) > 1 else None))
        feeds.append((args[0].detach(), None if mask is None else mask.detach()))

    hooks = [getattr(b, v.attention).register_forward_pre_hook(pre_hook, with_kwargs=True) for b in v.blocks(model)]
    return feeds, hooks


def capture_against_reference(v: Variant, model: nn.Module, mode: str, x: torch.Tensor) -> tuple[float, float]:
    """(max |capture - float64 reference| over every block, max |output - plain output|) of one capture."""
    m = load(model)
    assert m.family.name == v.family
    with torch.no_grad():
        plain = m.logits(x)
        feeds, hooks = recording_attention_inputs(v, model)  # the inputs of this very forward
        with vl.capture_attention(m, mode=mode) as cap:
            out = m.logits(x)
        for h in hooks:
            h.remove()
    blocks = v.blocks(model)
    assert len(cap.maps) == len(blocks) == len(feeds)
    worst = 0.0
    for block, (xw, mask), got in zip(blocks, feeds, cap.maps):
        want = v.reference(block, xw, mask)
        assert got.shape == want.shape
        worst = max(worst, float((got.double() - want).abs().max()))
    return worst, float((out - plain).abs().max())


@pytest.mark.parametrize("variant, mode", [(v, mode) for v in ("timm-swinv2", "timm-swinv2-cr", "hf-swin", "hf-swinv2")
                                            for mode in ("side", "inline")]
                         + [("hf-swin-model", "side"), ("hf-swinv2-model", "side")])
def test_capture_is_the_blocks_own_attention_and_side_capture_leaves_the_outputs(variant, mode):
    v = VARIANTS[variant]
    model = v.build()
    x = images()
    worst, moved = capture_against_reference(v, model, mode, x)
    # float32 probabilities of at most 16 keys against float64: a few float32 ulps of values <= 1
    assert worst < 1e-5, worst
    if mode == "side" or v.family != "hf-swin" or "v2" in variant:
        assert moved == 0.0  # bit for bit: side capture, or an inline capture at the model's own (only) path
    else:  # hf Swin inline runs transformers' eager attention in place of the default sdpa: float rounding
        assert moved < 1e-5, moved


@pytest.mark.parametrize("variant", ["timm-swinv2-cr", "hf-swin", "hf-swinv2"])
def test_inline_capture_with_detach_false_keeps_the_maps_in_the_graph(variant):
    """What gradient methods read: the probabilities the output is computed from, differentiable in the input."""
    m = load(VARIANTS[variant].build())
    x = images(1).requires_grad_(True)
    with vl.capture_attention(m, mode="inline", detach=False) as cap:
        m.forward(x)
    assert all(p.requires_grad for p in cap.maps)
    cap.maps[-1][..., 0].sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_hf_swin_maps_are_the_same_under_sdpa_and_eager():
    x = images()
    maps, outs = {}, {}
    for implementation in ("sdpa", "eager"):
        model = tiny_hf_swin(attn_implementation=implementation)
        assert model.config._attn_implementation == implementation
        m = load(model)
        with torch.no_grad():
            plain = m.logits(x)
            with vl.capture_attention(m) as cap:
                outs[implementation] = m.logits(x)
        assert torch.equal(outs[implementation], plain)  # side capture: the implementation's own outputs
        maps[implementation] = cap.maps
    for a, b in zip(maps["sdpa"], maps["eager"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    torch.testing.assert_close(outs["sdpa"], outs["eager"], rtol=0, atol=1e-5)
    # under eager the captured maps are the very probabilities the eager function returns
    model = tiny_hf_swin(attn_implementation="eager")
    returned = []
    hooks = [layer.attention.register_forward_hook(lambda _m, _a, out: returned.append(out[1]))
             for layer in _hf_layers(model)]
    with vl.capture_attention(load(model)) as cap, torch.no_grad():
        model(pixel_values=x)
    for h in hooks:
        h.remove()
    assert all(torch.equal(a, b) for a, b in zip(cap.maps, returned)) and len(returned) == 6


def hand_windows_pad_first(grid: tuple[int, int], window: int, shift: int) -> np.ndarray:
    """The partition of the official Swin code and transformers: pad the grid to whole windows, then the cyclic
    shift of -shift rows and columns of the padded grid, windows row-major, positions row-major: [windows, N]."""
    h, w = grid
    hp, wp = -(-h // window) * window, -(-w // window) * window
    padded = np.full((hp, wp), -1)
    padded[:h, :w] = np.arange(h * w).reshape(h, w)
    if shift:
        padded = np.roll(padded, (-shift, -shift), axis=(0, 1))
    return np.stack([padded[r:r + window, c:c + window].ravel()
                     for r in range(0, hp, window) for c in range(0, wp, window)])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_windows_are_a_hand_written_shift_padding_and_partition(variant):
    v = VARIANTS[variant]
    model = v.build()
    m = load(model)
    windows = m.family.windows(m.model, m.spec.image_size)
    assert [(g.stage, g.grid, g.stride_px) for g in windows] == [
        (0, (14, 14), (4, 4)), (0, (14, 14), (4, 4)), (1, (7, 7), (8, 8)), (1, (7, 7), (8, 8)),
        (2, (4, 4), (16, 16)), (2, (4, 4), (16, 16))]
    assert [g.kind for g in windows] == v.kinds
    # the stage grids are the ones the blocks get in a forward
    seen = []
    hooks = [getattr(b, v.attention).register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[0]))
             for b in v.blocks(model)]
    with torch.no_grad():
        m.logits(images(1))
    for h in hooks:
        h.remove()
    assert seen == [g.num_windows for g in windows]
    partition = hand_windows_pad_first if v.pad_first else hand_windows
    far_apart = []
    for g, (window, shift) in zip(windows, v.window_shift):
        np.testing.assert_array_equal(g.index, partition(g.grid, window, shift))
        real = g.index >= 0
        assert sorted(g.index[real].tolist()) == list(range(g.grid[0] * g.grid[1]))  # every token once
        np.testing.assert_array_equal(g.allowed, hand_allowed(g.grid, window, shift) & real[:, None, :])
        # which real tokens a window lets attend each other although they are a window or more apart on the grid
        rows, cols = np.divmod(np.where(real, g.index, 0), g.grid[1])
        near = (np.abs(rows[:, :, None] - rows[:, None, :]) < window) & (np.abs(cols[:, :, None] - cols[:, None, :])
                                                                          < window)
        far_apart.append(int((g.allowed & real[:, :, None] & ~near).sum()))
    if v.pad_first:  # padding first (the official code, transformers): the mask keeps every far pair apart
        assert far_apart == [0] * 6
    else:  # timm shifts, then pads: on the 7x7 grid the regions of the mask, counted on the padded 8x8, put the
        # last row (column) in one region with the first, which the shift brought beside it: those attend
        assert [n > 0 for n in far_apart] == [False, False, False, True, False, False]


def hand_allowed(grid: tuple[int, int], window: int, shift: int) -> np.ndarray:
    """The shifted windows' mask of the Swin code, written out: on the shifted, padded grid the last ``window``
    rows split at ``shift`` from the end into three regions (and the columns alike); a query attends the
    positions of its window in its own region. [windows, N, N] over the positions, padding included."""
    h, w = grid
    hp, wp = -(-h // window) * window, -(-w // window) * window

    def region(i: np.ndarray, size: int) -> np.ndarray:
        return (i >= size - window).astype(int) + (i >= size - shift).astype(int) if shift else np.zeros_like(i)

    r, c = np.meshgrid(region(np.arange(hp), hp), region(np.arange(wp), wp), indexing="ij")
    label = r * 3 + c
    windows = np.stack([label[y:y + window, x:x + window].ravel()
                        for y in range(0, hp, window) for x in range(0, wp, window)])
    return windows[:, :, None] == windows[:, None, :]


def test_reading_hf_swin_windows_leaves_the_model_as_it_is():
    """Swin's layers clamp their shift at the forward (a 4x4 stage with 4x4 windows does not shift): the
    stand-in's run clamps it on the stand-in, the model's own forward on the model."""
    model = tiny_hf_swin()
    layer = _hf_layers(model)[5]
    assert layer.shift_size == 2
    m = load(model)
    before = m.family.windows(m.model, m.spec.image_size)
    assert layer.shift_size == 2
    with torch.no_grad():
        m.logits(images(1))
    assert layer.shift_size == 0  # the model's own doing
    after = m.family.windows(m.model, m.spec.image_size)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a.index, b.index)
        np.testing.assert_array_equal(a.allowed, b.allowed)


@pytest.mark.parametrize("variant", ["timm-swinv2", "timm-swinv2-cr", "hf-swin", "hf-swinv2-model"])
def test_distance_and_rollout_equal_the_dense_float64_computations(variant):
    m = load(VARIANTS[variant].build())
    got = assert_distance_is_a_dense_float64_computation(m, images(3))
    assert np.nanmax(got.of_window) - np.nanmin(got.of_window) > 0.1  # peaky weights: heads differ
    assert set(got.kinds) == set(VARIANTS[variant].kinds)
    assert_rollout_is_a_brute_force_dense_composition(m, images(2))
    if variant == "hf-swinv2-model":  # a padding query left only padding keys puts exactly 0 on the real ones (the
        # model adds its -100 mask twice: exp(-200) is 0 in float32); the distance does not count it (no NaN)
        g = m.family.windows(m.model, m.spec.image_size)[1]
        with vl.capture_attention(m) as cap, torch.no_grad():
            m.logits(images(3))
        p = cap.maps[1].reshape(3, g.num_windows, -1, g.window_tokens, g.window_tokens)
        on_real = (p * torch.from_numpy(g.index >= 0)[None, :, None, None, :]).sum(-1)  # [B, windows, heads, N]
        assert (on_real.permute(0, 2, 1, 3)[:, :, torch.from_numpy(g.index < 0)] == 0).any()
        assert np.isfinite(got.mean_px[:, :2]).all()


def _uniform(variant: str) -> nn.Module:
    """q = k = 0 (cosine attention: F.normalize(0) = 0) and a position bias the same at every offset: scores
    that differ only by the mask."""
    v = VARIANTS[variant]
    model = v.build()
    with torch.no_grad():
        for block in v.blocks(model):
            if variant.startswith("timm"):
                attn = block.attn
                attn.qkv.weight.zero_()
                for bias in (getattr(attn, "q_bias", None), getattr(attn.qkv, "bias", None)):
                    if bias is not None:
                        bias.zero_()
                last = attn.cpb_mlp[2] if variant == "timm-swinv2" else attn.meta_mlp.fc2
                last.weight.zero_()
            elif variant.startswith("hf-swinv2"):
                attn = block.attention.self
                attn.query.weight.zero_(), attn.query.bias.zero_(), attn.key.weight.zero_()
                attn.continuous_position_bias_mlp[2].weight.zero_()
            else:
                attn = block.attention
                attn.q_proj.weight.zero_(), attn.q_proj.bias.zero_(), attn.k_proj.weight.zero_()
                attn.k_proj.bias.zero_(), attn.relative_position_bias.relative_position_bias_table.zero_()
    return model


@pytest.mark.parametrize("variant", ["timm-swinv2", "timm-swinv2-cr", "hf-swin", "hf-swinv2"])
def test_known_answer_uniform_attention_fills_its_window(variant):
    got = vl.attention_distance(load(_uniform(variant)), images(2))
    np.testing.assert_allclose(np.nan_to_num(got.of_window, nan=1.0), 1.0, rtol=0, atol=FLOAT32_RTOL)


def test_known_answer_hf_swin_attention_on_itself_is_at_zero():
    model = _uniform("hf-swin")
    with torch.no_grad():
        for layer in _hf_layers(model):
            rpb = layer.attention.relative_position_bias
            ws = rpb.window_size
            rpb.relative_position_bias_table[(ws[0] - 1) * (2 * ws[1] - 1) + ws[1] - 1] = 60.0  # offset (0, 0)
    got = vl.attention_distance(load(model), images(2))
    np.testing.assert_allclose(np.nan_to_num(got.of_window, nan=0.0), 0.0, rtol=0, atol=1e-9)


@pytest.mark.parametrize("variant", ["timm-swinv2", "timm-swinv2-cr", "hf-swin", "hf-swinv2"])
def test_analyze_gives_the_windowed_views_and_the_weight_views_say_why_not(variant):
    m = load(VARIANTS[variant].build())
    a = vl.analyze(m, images(2))
    assert isinstance(a.distance, WindowedDistanceResult) and a.rollout.maps.shape == (2, 14, 14)
    assert a.filters is not None and a.rollout.predictions.shape == (2,)
    assert a.position is None and "relative-position bias" in a.position_note


def test_hf_swin_loads_by_hf_name_and_refuses_what_it_does_not_read(tmp_path):
    from transformers import AttentionInterface, SwinConfig, SwinForMaskedImageModeling
    from transformers.models.swin.modeling_swin import eager_attention_forward

    tiny_hf_swin().save_pretrained(tmp_path / "swin")
    m = vl.load_model(f"hf:{tmp_path / 'swin'}", device="cpu")
    assert m.family.name == "hf-swin" and m.spec.kind == "hierarchical" and m.spec.num_classes == 5
    assert m.data_config["mean"] == (0.485, 0.456, 0.406)
    with pytest.raises(vl.UnsupportedModelError, match="SwinForMaskedImageModeling"):
        vl.LoadedModel.from_module(SwinForMaskedImageModeling(SwinConfig(**HF_SIZE)))
    # an implementation that makes no SDPA call and returns no probabilities: side capture says so in one line
    AttentionInterface.register("test_opaque", lambda *a, **k: (eager_attention_forward(*a, **k)[0], None))
    model = tiny_hf_swin(attn_implementation="test_opaque")
    m = load(model)
    with pytest.raises(vl.UnsupportedModelError, match="mode='inline'"):
        with vl.capture_attention(m), torch.no_grad():
            m.logits(images(1))
    with vl.capture_attention(m, mode="inline") as cap, torch.no_grad():  # transformers' eager attention
        m.logits(images(1))
    assert len(cap.maps) == 6 and model.config._attn_implementation == "test_opaque"


def _zero_qk(model: torch.nn.Module) -> None:
    """q = k = 0 in every block: each window's logits are the position bias alone."""
    with torch.no_grad():
        for mod in model.modules():
            for name in ("qkv", "q_bias", "v_bias"):
                part = getattr(mod, name, None)
                if isinstance(part, torch.nn.Linear):
                    part.weight.zero_()
                    if part.bias is not None:
                        part.bias.zero_()
                elif isinstance(part, torch.nn.Parameter):
                    part.zero_()


@pytest.mark.parametrize("arch", ["swin_tiny_patch4_window7_224", "swinv2_tiny_window8_256", "swinv2_cr_tiny_224"])
def test_the_position_view_is_the_bias_the_window_attention_adds(arch):
    """Swin's relative-position view by offset against the attention itself: with q = k = 0 a window's
    log-probabilities are its bias up to a constant per query, so the view's bias by (dy, dx) equals the
    captured log-probability differences (v1 table, v2 16 sigmoid(MLP), v2 CR MLP)."""
    import timm

    from vitlens.views.relpos import relative_position_bias
    from vitlens.views.windowed import model_windows
    from vitlens.views.windowed_rollout import window_maps

    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, embed_dim=16, depths=(1, 1), num_heads=(2, 2), num_classes=3,
                              img_size=32, window_size=4).eval()
    _zero_qk(model)
    m = vl.LoadedModel.from_module(model, name=arch)
    view = relative_position_bias(m)
    assert view.bias.shape[:2] == (2, 2) and view.grid == (4, 4)
    g = model_windows(m)[0]
    assert g.kind == "window" and (g.index[0] >= 0).all()
    probs = window_maps(m, torch.randn(1, 3, 32, 32))[0][0].double()  # block 1, first window: [heads, 16, 16]
    logp = probs.log()
    seen = (logp - logp.mean(-1, keepdim=True)).numpy()
    rows, cols = np.divmod(np.arange(16), 4)
    by_view = np.stack([[[view.at(0, h, rows[k] - rows[q], cols[k] - cols[q]) for k in range(16)]
                         for q in range(16)] for h in range(2)])
    np.testing.assert_allclose(seen, by_view - by_view.mean(-1, keepdims=True), atol=2e-5)


@pytest.mark.parametrize("build", [tiny_hf_swin, tiny_hf_swinv2])
def test_the_hugging_face_position_view_is_the_bias_each_window_attention_adds(build):
    """As for timm: with q = k = 0, each layer's first window's log-probabilities are its bias up to a constant
    per query; every layer is checked, on its own window (Swin V2's last stage has smaller windows: the view
    holds them inside the largest, NaN outside)."""
    from vitlens.views.relpos import relative_position_bias
    from vitlens.views.windowed import model_windows
    from vitlens.views.windowed_rollout import window_maps

    model = build()
    with torch.no_grad():
        for layer in _hf_layers(model):
            for mod in layer.attention.modules():
                for name in ("q_proj", "k_proj", "query", "key"):
                    part = getattr(mod, name, None)
                    if isinstance(part, nn.Linear):
                        part.weight.zero_()
                        if part.bias is not None:
                            part.bias.zero_()
    m = vl.LoadedModel.from_module(model, name="hf")
    view = relative_position_bias(m)
    # where each block's bias was read, counted from 1 as the app's Block slider (issue 45, item 12)
    assert view.sources[0].startswith("stage 1, block 1 (") and "stage 0" not in " ".join(view.sources)
    maps = window_maps(m, torch.randn(1, 3, *m.spec.image_size))
    checked = 0
    for layer, g in enumerate(model_windows(m)):
        real = g.index[0] >= 0
        if not real.all() or g.kind != "window":
            continue
        logp = maps[layer][0].double().log()  # [heads, N, N]
        seen = (logp - logp.mean(-1, keepdim=True)).numpy()
        w = int(round(np.sqrt(g.window_tokens)))
        rows, cols = np.divmod(np.arange(g.window_tokens), w)
        by_view = np.stack([[[view.at(layer, h, rows[k] - rows[q], cols[k] - cols[q]) for k in range(g.window_tokens)]
                             for q in range(g.window_tokens)] for h in range(seen.shape[0])])
        np.testing.assert_allclose(seen, by_view - by_view.mean(-1, keepdims=True), atol=2e-5)
        checked += 1
    assert checked >= 2


def test_the_position_views_sources_count_blocks_from_1_and_name_the_module():
    """Issue 45, item 12: the caption read "stage 0 block 0" beside the app's slider at "Block 1"."""
    import timm

    from vitlens.views.relpos import relative_position_bias

    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, embed_dim=16, depths=(1, 1),
                              num_heads=(2, 2), num_classes=3, img_size=32, window_size=4).eval()
    view = relative_position_bias(vl.LoadedModel.from_module(model, name="swin"))
    assert view.sources[0].startswith("stage 1, block 1 (layers.0.blocks.0): ")
    assert view.sources[1].startswith("stage 2, block 2 (layers.1.blocks.0): ")
