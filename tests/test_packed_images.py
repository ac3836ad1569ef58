"""Pixtral's packed images (issue 48): two images of different sizes in one sequence with a block-diagonal mask give
each image's own distance and rollout (``vl.analyze_each``), equal to the same images run one by one through the
model's own eager attention; a batch of one size is read as a batch of each image's own maps."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl

from test_generic_capture import numpy_distance
from test_generic_layouts import eager_twin

TOL = 1e-5


@pytest.fixture(scope="module")
def pixtral():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.PixtralVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, image_size=32, patch_size=8, head_dim=16,
                                           attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.PixtralVisionModel(cfg).eval()
    return model, eager_twin(model)


def numpy_rollout(maps: list[np.ndarray], grid: tuple[int, int]) -> np.ndarray:
    """Rollout without a class token: heads averaged, (A + I) row-normalised, multiplied first block first; the mean
    row over the patch queries, max-normalised, on the grid."""
    t = maps[0].shape[-1]
    out = []
    for i in range(maps[0].shape[0]):
        r = np.eye(t)
        for a in maps:
            a2 = a[i].astype(np.float64).mean(axis=0) + np.eye(t)
            r = (a2 / a2.sum(axis=1, keepdims=True)) @ r
        v = r.mean(axis=0)
        out.append((v / v.max()).reshape(grid))
    return np.stack(out)


def _alone(eager: torch.nn.Module, img: torch.Tensor) -> list[np.ndarray]:
    """The image run alone through the model's own eager attention: each block's [1, heads, N, N] map."""
    with torch.no_grad():
        out = eager(pixel_values=img[None], output_attentions=True)
    return [a.numpy() for a in out.attentions]


def test_two_images_of_different_sizes_equal_each_run_alone(pixtral):
    model, eager = pixtral
    m = vl.load_model(model, device="cpu")
    assert (m.spec.family, m.spec.grid, m.spec.num_prefix_tokens) == ("generic", (4, 4), 0)
    g = torch.Generator().manual_seed(1)
    images = [torch.randn(3, 32, 24, generator=g), torch.randn(3, 16, 40, generator=g)]
    results = vl.analyze_each(m, images)
    assert [r.spec.grid for r in results] == [(4, 3), (2, 5)]
    assert [r.spec.image_size for r in results] == [(32, 24), (16, 40)]
    for img, r in zip(images, results):
        ref = _alone(eager, img)
        grid = r.spec.grid
        assert r.rollout.maps.shape == (1, *grid)
        np.testing.assert_allclose(r.rollout.maps, numpy_rollout(ref, grid), rtol=1e-4, atol=1e-6)
        for layer in range(2):
            np.testing.assert_allclose(r.distance.mean_px[layer], numpy_distance(ref[layer], grid, (8, 8), 0),
                                       rtol=1e-4)


def test_the_packed_capture_holds_each_images_block(pixtral):
    model, eager = pixtral
    m = vl.load_model(model, device="cpu")
    g = torch.Generator().manual_seed(2)
    images = [torch.randn(3, 16, 16, generator=g), torch.randn(3, 24, 16, generator=g)]
    with torch.no_grad(), vl.capture_attention(m) as cap:
        pack = m.family.packed_forward(m.model, images)
    assert [p.grid for p in pack] == [(2, 2), (3, 2)] and [p.tokens for p in pack] == [slice(0, 4), slice(4, 10)]
    assert len(cap.maps) == 2
    for layer, probs in enumerate(cap.maps):
        assert probs.shape == (1, 2, 10, 10)
        assert probs[:, :, :4, 4:].abs().max().item() == 0 and probs[:, :, 4:, :4].abs().max().item() == 0
        for img, rows in zip(images, (slice(0, 4), slice(4, 10))):
            ref = torch.from_numpy(_alone(eager, img)[layer])
            assert (probs[:, :, rows, rows] - ref).abs().max().item() < TOL
    # the model called by hand on a padded batch with its sizes: a pack the capture was not told of, refused
    x = torch.zeros(2, 3, 24, 16)
    x[0, :, :16], x[1] = images
    with pytest.raises(vl.UnsupportedModelError, match="packed attention"), torch.no_grad(), \
            vl.capture_attention(m):
        model(pixel_values=x, image_sizes=[(16, 16), (24, 16)])


def test_a_batch_of_one_size_is_read_image_by_image(pixtral):
    model, eager = pixtral
    m = vl.load_model(model, device="cpu")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = model(pixel_values=x).last_hidden_state
    with torch.no_grad(), vl.capture_attention(m) as cap:
        out = model(pixel_values=x).last_hidden_state
    assert torch.equal(out, plain)
    assert [tuple(a.shape) for a in cap.maps] == [(2, 2, 16, 16)] * 2
    refs = [_alone(eager, img) for img in x]
    for layer in range(2):
        want = torch.from_numpy(np.concatenate([r[layer] for r in refs]))
        assert (cap.maps[layer] - want).abs().max().item() < TOL
    result = vl.analyze(m, x, views=("rollout",))
    np.testing.assert_allclose(result.rollout.maps, np.concatenate([numpy_rollout(r, (4, 4)) for r in refs]),
                               rtol=1e-4, atol=1e-6)


def test_analyze_each_refuses_what_it_cannot_read(pixtral):
    m = vl.load_model(pixtral[0], device="cpu")
    with pytest.raises(vl.InvalidParameterError, match="multiples of the patch stride"):
        vl.analyze_each(m, [torch.zeros(3, 20, 16)])
    with pytest.raises(vl.InvalidParameterError, match="analyze_each computes"):
        vl.analyze_each(m, [torch.zeros(3, 16, 16)], views=("filters",))
    with pytest.raises(vl.InvalidParameterError, match="preprocessed tensors"):
        vl.analyze_each(m, [np.zeros((3, 16, 16))])


def test_a_model_that_does_not_pack_runs_the_images_one_by_one():
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=3,
                            dynamic_img_size=True).eval()
    m = vl.load_model(vit, device="cpu")
    g = torch.Generator().manual_seed(4)
    images = [torch.randn(3, 32, 32, generator=g), torch.randn(3, 16, 24, generator=g)]
    results = vl.analyze_each(m, images)
    assert [r.spec.grid for r in results] == [(4, 4), (2, 3)]
    for img, r in zip(images, results):
        alone = vl.analyze(m, img[None], views=("distance", "rollout"))
        np.testing.assert_array_equal(r.rollout.maps, alone.rollout.maps)
        np.testing.assert_array_equal(r.distance.mean_px, alone.distance.mean_px)


def test_siglip2_naflex_images_of_different_sizes_equal_each_run_alone():
    transformers = pytest.importorskip("transformers")
    from vitlens.families.common.hf_inputs import siglip2_inputs

    cfg = transformers.Siglip2VisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=64, patch_size=8, num_patches=16,
                                           attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Siglip2VisionModel(cfg).eval()
    eager = eager_twin(model)
    m = vl.load_model(model, device="cpu")
    assert m.spec.family == "hf-vit"
    g = torch.Generator().manual_seed(5)
    images = [torch.randn(3, 32, 24, generator=g), torch.randn(3, 16, 40, generator=g)]
    with torch.no_grad(), vl.capture_attention(m) as cap:
        where = m.family.packed_forward(m.model, images)
    assert [(w.row, w.tokens, w.grid) for w in where] == [(0, slice(0, 12), (4, 3)), (1, slice(0, 10), (2, 5))]
    assert cap.maps[0].shape == (2, 2, 12, 12) and cap.maps[0][1, :, :10, 10:].abs().max().item() == 0
    results = vl.analyze_each(m, images)
    for i, (img, r) in enumerate(zip(images, results)):
        with torch.no_grad():
            ref = [a.numpy() for a in eager(**siglip2_inputs(img[None], 8), output_attentions=True).attentions]
        n = ref[0].shape[-1]
        for layer in range(2):
            assert (cap.maps[layer][i:i + 1, :, :n, :n] - torch.from_numpy(ref[layer])).abs().max().item() < TOL
        assert r.spec.grid == where[i].grid
        np.testing.assert_allclose(r.rollout.maps, numpy_rollout(ref, r.spec.grid), rtol=1e-4, atol=1e-6)
        for layer in range(2):
            np.testing.assert_allclose(r.distance.mean_px[layer],
                                       numpy_distance(ref[layer], r.spec.grid, (8, 8), 0), rtol=1e-4)
