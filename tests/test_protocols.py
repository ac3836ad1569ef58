"""The perturbation metrics' named protocols and orderings (``vitlens.attribution.protocols``), each against an
explicit reference written here: Chefer et al. 2021's perturbation script, Petsiuk et al. 2018's CausalMetric
(RISE) and ROAD as Rong et al. 2022, step by step, on the hand-built one-patch model, plus known answers.

Ties: bilinear upsampling (align_corners=False) clamps at the border, so the pixels within half a patch of the
image's edge tie in groups inside one border patch; the one-patch model reads only the key patch (2, 1), which
touches no border, so which tied pixel a reference's sort picks first changes no score."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlens as vl
from test_attribution import KEY_PATCH, key_patch_images, one_patch_model
from vitlens.attribution.faithfulness import compare_methods, deletion_insertion
from vitlens.attribution.imputation import noisy_linear_impute
from vitlens.attribution.methods import AttributionResult
from vitlens.attribution.perturbation import perturbation_test, removal_masks, road
from vitlens.attribution.protocols import PROTOCOLS, PUBLISHED, protocol


def sigmoid(v):
    return 1 / (1 + np.exp(-np.asarray(v, dtype=np.float64)))


@pytest.fixture(scope="module")
def one_patch():
    return one_patch_model()


def maps_result(maps: np.ndarray) -> AttributionResult:
    return AttributionResult(method="hand", maps=maps, targets=np.zeros(len(maps), dtype=np.int64), grid=(4, 4),
                             image_size=(32, 32), seconds_per_image=0.0, model_name="one-patch")


def random_maps(n: int, seed: int = 3) -> AttributionResult:
    return maps_result(np.random.default_rng(seed).normal(size=(n, 4, 4)))


def key_first(n: int, key_value: float = 1.0) -> AttributionResult:
    maps = np.tile(np.arange(16, dtype=np.float64).reshape(4, 4) / 100, (n, 1, 1))
    maps[:, KEY_PATCH[0], KEY_PATCH[1]] = key_value
    return maps_result(maps)


def probability(m, x: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return m.logits(x).softmax(-1)[:, 0].double().numpy()


def test_the_registry_names_every_metrics_default_and_published_protocol():
    assert {(k, "vitlens") for k in PUBLISHED} | {(k, v) for k, v in PUBLISHED.items()} == set(PROTOCOLS)
    assert protocol("perturbation", "chefer2021").granularity == "pixel"
    with pytest.raises(vl.InvalidParameterError, match="chefer2021"):
        protocol("perturbation", "chefer")


def test_absolute_ordering_ranks_by_magnitude():
    maps = np.array([[[-0.9, 0.1], [0.5, -0.3]]])  # signed, most first: 2, 1, 3, 0; by |R|: 0, 2, 3, 1
    signed = removal_masks(maps, [0.25, 0.5], True, (2, 2), (4, 4)).numpy()[0]
    absolute = removal_masks(maps, [0.25, 0.5], True, (2, 2), (4, 4), ordering="absolute").numpy()[0]
    assert signed[0, 2:, :2].all() and signed[0].sum() == 4
    assert signed[1, 2:, :2].all() and signed[1, :2, 2:].all() and signed[1].sum() == 8
    assert absolute[0, :2, :2].all() and absolute[0].sum() == 4
    assert absolute[1, :2, :2].all() and absolute[1, 2:, :2].all() and absolute[1].sum() == 8
    least = removal_masks(maps, [0.25], False, (2, 2), (4, 4), ordering="absolute").numpy()[0]
    assert least[0, :2, 2:].all() and least[0].sum() == 4  # |0.1| is the least relevant
    with pytest.raises(vl.InvalidParameterError, match="ordering"):
        removal_masks(maps, [0.25], True, (2, 2), (4, 4), ordering="magnitude")


def test_a_strongly_negative_key_patch_goes_first_only_by_magnitude(one_patch):
    """Key patch at -1 (the others 0 .. 0.15): by signed R it is the least relevant, last in positive order and never
    removed (at most 14 of 16 tokens go), so the curve stays sigmoid(4); by |R| it goes first: sigmoid(-4)."""
    x, a = key_patch_images(2), key_first(2, key_value=-1.0)
    signed = perturbation_test(one_patch, x, a)
    absolute = perturbation_test(one_patch, x, a, ordering="absolute")
    np.testing.assert_allclose(signed.positive, sigmoid(4), rtol=1e-5)
    np.testing.assert_allclose(absolute.positive[:, 1:], sigmoid(-4), rtol=1e-4)
    assert (signed.ordering, absolute.ordering) == ("signed", "absolute")
    assert "ordered by |R|" in absolute.summary() and "protocol vitlens" in absolute.summary()


def chefer_script(m, x: torch.Tensor, maps: np.ndarray, negative: bool) -> np.ndarray:
    """Chefer et al.'s perturbation loop written out: unnormalise, upsample the map x stride bilinearly, top-k pixels
    (k = int(HW x step)) of vis (negated for negative) set to 0 in every channel, normalise, score."""
    mean = torch.tensor(m.data_config["mean"])[None, :, None, None]
    std = torch.tensor(m.data_config["std"])[None, :, None, None]
    data = x * std + mean
    vis = F.interpolate(torch.as_tensor(maps)[:, None], scale_factor=8, mode="bilinear")[:, 0].reshape(len(x), -1)
    vis = -vis if negative else vis
    base = vis.shape[1]
    out = []
    for step in [i / 10 for i in range(10)]:
        d = data.clone().reshape(len(x), 3, -1)
        k = int(base * step)
        if k:
            _, idx = torch.topk(vis, k, dim=-1)
            d = d.scatter_(-1, idx[:, None].repeat(1, 3, 1), 0)
        out.append(probability(m, (d.reshape(x.shape) - mean) / std))
    return np.stack(out, 1)


def test_chefer2021_equals_their_script_and_removes_the_key_patch_at_ten_percent(one_patch):
    x, a = key_patch_images(3), random_maps(3)
    r = perturbation_test(one_patch, x, a, protocol="chefer2021")
    assert (r.protocol, r.granularity, r.fill, r.ordering) == ("chefer2021", "pixel", "black", "signed")
    # both paths compute the same float32 forward on inputs equal to a few ulps (unnormalise/normalise round trip)
    np.testing.assert_allclose(r.positive, chefer_script(one_patch, x, a.maps, False), atol=1e-6)
    np.testing.assert_allclose(r.negative, chefer_script(one_patch, x, a.maps, True), atol=1e-6)
    assert not np.allclose(r.positive, perturbation_test(one_patch, x, a).positive)  # pixels are not tokens
    # known answer: with the key patch highest, the bilinear map ranks a few pixels of the ring around it above its
    # corners (0.5 of the key patch's value outside beside (5/8)^2 inside), but the top 102 (10% of 1024) hold it all
    known = perturbation_test(one_patch, x, key_first(3), protocol="chefer2021")
    np.testing.assert_allclose(known.positive[:, 1:], sigmoid(-4), rtol=1e-4)


def rise_causal_metric(m, x: torch.Tensor, maps: np.ndarray, mode: str) -> np.ndarray:
    """RISE's CausalMetric.single_run written out for one image batch: step = W pixels, n = ceil(HW / step) steps,
    salient order np.flip(np.argsort(upsampled map)); deletion from the image to zeros, insertion from the blur
    (gkern(11, 5): gaussian_filter of a delta, conv2d with padding 5) to the image."""
    from scipy.ndimage import gaussian_filter

    b, c, h, w = x.shape
    hw, step = h * w, w
    n_steps = (hw + step - 1) // step
    delta = np.zeros((11, 11))
    delta[5, 5] = 1
    kern = np.zeros((3, 3, 11, 11))
    for i in range(3):
        kern[i, i] = gaussian_filter(delta, 5)
    blur = F.conv2d(x, torch.as_tensor(kern, dtype=x.dtype), padding=5)
    up = F.interpolate(torch.as_tensor(maps)[:, None], size=(h, w), mode="bilinear")[:, 0].numpy()
    order = np.flip(np.argsort(up.reshape(b, hw), axis=1), axis=-1)
    start, finish = (x.clone(), torch.zeros_like(x)) if mode == "del" else (blur.clone(), x.clone())
    scores = np.zeros((b, n_steps + 1))
    for i in range(n_steps + 1):
        scores[:, i] = probability(m, start)
        if i < n_steps:
            coords = torch.as_tensor(order[:, step * i:step * (i + 1)].copy())
            s, f = start.reshape(b, c, hw), finish.reshape(b, c, hw)
            for j in range(b):
                s[j, :, coords[j]] = f[j, :, coords[j]]
    return scores


def rise_auc(arr: np.ndarray) -> np.ndarray:
    return (arr.sum(1) - arr[:, 0] / 2 - arr[:, -1] / 2) / (arr.shape[1] - 1)


def test_petsiuk2018_equals_rise_causal_metric_and_deletion_has_its_known_curve(one_patch):
    x, a = key_patch_images(2), random_maps(2, seed=5)
    r = deletion_insertion(one_patch, x, a, protocol="petsiuk2018")
    assert (r.protocol, r.ordering) == ("petsiuk2018", "signed") and r.deletion.shape == (2, 33)
    np.testing.assert_allclose(r.deletion, rise_causal_metric(one_patch, x, a.maps, "del"), atol=1e-6)
    np.testing.assert_allclose(r.insertion, rise_causal_metric(one_patch, x, a.maps, "ins"), atol=1e-6)
    np.testing.assert_allclose(r.deletion_auc, rise_auc(r.deletion), rtol=1e-12)
    np.testing.assert_allclose(r.insertion_auc, rise_auc(r.insertion), rtol=1e-12)
    # known answer: key patch highest: the first step's 32 pixels lie inside it (its centre; the pixels outside
    # reach at most about half its value), so half its red (1) goes to 0: logit 4, then 2; all pixels at 0: logit 0
    known = deletion_insertion(one_patch, x, key_first(2), protocol="petsiuk2018")
    np.testing.assert_allclose(known.deletion[:, :2], np.tile(sigmoid([4, 2]), (2, 1)), rtol=1e-4)
    np.testing.assert_allclose(known.deletion[:, -1], 0.5, rtol=1e-5)
    assert "protocol petsiuk2018" in known.summary()


def test_rong2022_equals_pixel_masks_imputed_step_by_step(one_patch):
    """ROAD on pixels: MoRF then LeRF, each percentage's pixels (floor(HW x p) of the upsampled map's order) filled by
    noisy linear imputation with one generator drawn in that order."""
    x, a = key_patch_images(2), random_maps(2, seed=7)
    pct = [0.2, 0.5, 0.8]
    r = road(one_patch, x, a, percentages=pct, protocol="rong2022", seed=4)
    assert (r.protocol, r.granularity, r.ordering) == ("rong2022", "pixel", "signed")
    up = F.interpolate(torch.as_tensor(a.maps)[:, None], size=(32, 32), mode="bilinear")[:, 0].numpy().reshape(2, -1)
    rng = np.random.default_rng(4)
    xs = x.double().numpy()
    for most_first, got in ((True, r.morf), (False, r.lerf)):
        want = []
        for p in pct:
            k = int(1024 * p)
            order = np.argsort(-up if most_first else up, axis=1, kind="stable")
            removed = np.zeros((2, 1024), dtype=bool)
            np.put_along_axis(removed, order[:, :k], True, axis=1)
            filled = noisy_linear_impute(xs, removed.reshape(2, 32, 32), 0.01, rng)
            want.append(probability(one_patch, torch.as_tensor(filled, dtype=torch.float32)))
        np.testing.assert_allclose(got, np.stack(want, 1), atol=1e-6)


def test_compare_methods_says_which_protocol_made_each_column(one_patch):
    x = key_patch_images(2)
    t = compare_methods(one_patch, x, methods=["saliency"], metrics=("deletion_insertion", "perturbation"),
                        protocol="published")
    assert t.protocols == {"deletion_insertion": "petsiuk2018, signed", "perturbation": "chefer2021, signed"}
    assert t.faithfulness[0].protocol == "petsiuk2018" and t.perturbations[0].granularity == "pixel"
    assert "chefer2021, signed" in t.summary()
    d = compare_methods(one_patch, x, methods=["saliency"], metrics=("perturbation",), ordering="absolute")
    assert d.protocols == {"perturbation": "vitlens, absolute"} and d.perturbations[0].ordering == "absolute"
    with pytest.raises(vl.InvalidParameterError, match="published"):
        compare_methods(one_patch, x, methods=["saliency"], protocol="paper")
