"""Prefix tokens anywhere (issue 48): YOLOS's detection tokens after the patches, read through its declared token
layout (vitlens/core/tokens.py) and permuted into the views' order, exact against its own eager attention."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl

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
