"""Prefix tokens anywhere (issue 48): YOLOS's detection tokens after the patches, read through its declared token
layout (vitlens/core/tokens.py) and permuted into the views' order, exact against its own eager attention."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.core.tokens import standard_layout

from test_generic_capture import numpy_distance, numpy_rollout
from test_generic_layouts import eager_reference, images

TOL = 1e-5


@pytest.fixture(scope="module")
def yolos():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.YolosConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                   image_size=[32, 32], patch_size=8, num_detection_tokens=4,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.YolosModel(cfg).eval()


def test_yolos_detection_tokens_are_prefix_tokens_exact_against_eager(yolos):
    x = images()
    want, want_hidden = eager_reference(yolos, x)
    order = [0, 17, 18, 19, 20] + list(range(1, 17))  # the model's class, cells, detection -> class, detection, cells
    m = vl.LoadedModel.from_module(yolos, name="yolos", device="cpu")
    assert (m.spec.grid, m.spec.num_prefix_tokens) == ((4, 4), 5)
    assert m.spec.prefix_labels == ("class", "detection 1", "detection 2", "detection 3", "detection 4")
    assert "detection at 17" in m.spec.describe()["token order"]
    with torch.no_grad():
        plain = yolos(pixel_values=x).last_hidden_state
    for mode in ("side", "inline"):
        with torch.no_grad(), vl.capture_attention(m, mode=mode) as cap:
            hidden = yolos(pixel_values=x).last_hidden_state
        if mode == "side":
            assert torch.equal(hidden, plain)
        assert (hidden - want_hidden).abs().max().item() < TOL
        assert len(cap.maps) == 2
        for got, ref in zip(cap.maps, want):
            assert got.shape == (2, 2, 21, 21)
            assert (got - ref[..., order, :][..., order]).abs().max().item() < TOL


def test_yolos_distance_and_rollout_equal_numpy_on_its_eager_maps_reordered(yolos):
    # the known answer: the references of the views' order, run on the eager maps with the detection tokens moved
    # before the cells by hand
    x = images(2, seed=4)
    want, _ = eager_reference(yolos, x)
    order = [0, 17, 18, 19, 20] + list(range(1, 17))
    ref = [a[..., order, :][..., order].numpy() for a in want]
    m = vl.LoadedModel.from_module(yolos, device="cpu")
    result = vl.analyze(m, x, views=("distance", "rollout"))
    np.testing.assert_allclose(result.rollout.maps, numpy_rollout(ref, 5, (4, 4)), rtol=1e-4, atol=1e-6)
    for layer in range(2):
        np.testing.assert_allclose(result.distance.mean_px[layer], numpy_distance(ref[layer], (4, 4), (8, 8), 5),
                                   rtol=1e-4)


class PlainAttention(torch.nn.Module):
    """q, k, v projections and one SDPA call, no position terms: permuting the tokens permutes the maps exactly."""

    def __init__(self, dim: int = 32, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, **_: object) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


@pytest.fixture(scope="module")
def class_first_and_last():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    first = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                              global_pool="avg")
    for block in first.blocks:
        block.attn = PlainAttention()
    last = copy.deepcopy(first.eval())
    own = last._pos_embed
    last._pos_embed = lambda x: (lambda y: torch.cat([y[:, 1:], y[:, :1]], 1))(own(x))  # the class token last
    return first.eval(), last.eval()


def test_class_token_last_is_refused_unless_stated(class_first_and_last):
    _, last = class_first_and_last
    with pytest.raises(vl.UnsupportedModelError, match="wrong grid cells"):
        vl.load_model(copy.deepcopy(last), device="cpu")


def test_a_stated_layout_with_the_class_token_last_equals_the_class_first_model(class_first_and_last):
    first, last = class_first_and_last
    a = vl.load_model(first, device="cpu")
    b = vl.load_model(last, device="cpu", token_layout=standard_layout((4, 4), ("class",), prefix_last=True))
    assert b.spec.num_prefix_tokens == 1 and b.spec.prefix_labels == ("class",)
    assert "class at 16" in b.spec.describe()["token order"] and "token order" not in a.spec.describe()
    x = images(2, seed=3)
    with torch.no_grad():
        plain = last(x)
    with torch.no_grad(), vl.capture_attention(a) as ca:
        first(x)
    with torch.no_grad(), vl.capture_attention(b) as cb:
        out = last(x)
    assert torch.equal(out, plain)
    assert len(cb.maps) == len(ca.maps) == 2 and cb.maps[0].shape == (2, 2, 17, 17)
    for got, want in zip(cb.maps, ca.maps):
        assert (got - want).abs().max().item() < TOL
    ra, rb = (vl.analyze(m, x, views=("distance", "rollout")) for m in (a, b))
    np.testing.assert_allclose(rb.rollout.maps, ra.rollout.maps, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(rb.distance.mean_px, ra.distance.mean_px, rtol=1e-4)


def test_a_stated_layout_that_does_not_fit_the_token_count_is_refused(class_first_and_last):
    _, last = class_first_and_last
    with pytest.raises(vl.InvalidParameterError, match="has 18 tokens .* runs over 17; state a layout of 17"):
        vl.load_model(copy.deepcopy(last), device="cpu", token_layout=standard_layout((4, 4), ("class", "register")))
    with pytest.raises(vl.InvalidParameterError, match="module built in code"):
        vl.load_model("ref-vit", token_layout=standard_layout((4, 4)))
