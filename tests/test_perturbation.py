"""Chefer et al.'s positive/negative perturbation and ROAD: hand-built known answers (the one-patch model,
linear and constant images for the imputer) and agreement with quantus 0.6.0 on the same inputs."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import vitlens as vl
from test_attribution import KEY_PATCH, key_patch_images, one_patch_model
from vitlens.attribution.imputation import noisy_linear_impute
from vitlens.attribution.methods import AttributionResult
from vitlens.attribution.perturbation import perturbation_test, removal_counts, removal_masks, road


def sigmoid(v: float) -> float:
    return 1 / (1 + np.exp(-v))


@pytest.fixture(scope="module")
def one_patch():
    return one_patch_model()


def key_first_maps(n: int) -> AttributionResult:
    """Hand-built maps on the one-patch model's 4x4 grid: the key patch highest, the rest distinct and lower."""
    maps = np.tile(np.arange(16, dtype=np.float64).reshape(4, 4) / 100, (n, 1, 1))
    maps[:, KEY_PATCH[0], KEY_PATCH[1]] = 1.0
    return AttributionResult(method="hand", maps=maps, targets=np.zeros(n, dtype=np.int64), grid=(4, 4),
                             image_size=(32, 32), seconds_per_image=0.0, model_name="one-patch")


def test_removal_masks_remove_the_highest_tokens_first_and_floor_the_counts():
    maps = np.array([[[0.1, 0.9], [0.5, 0.3]]])  # token order, most relevant first: 1, 2, 3, 0
    pos = removal_masks(maps, [0.0, 0.25, 0.5, 0.74], True, (2, 2), (4, 4)).numpy()
    assert removal_counts(4, [0.0, 0.25, 0.5, 0.74]).tolist() == [0, 1, 2, 2]
    assert pos.shape == (1, 4, 4, 4) and not pos[0, 0].any()
    assert pos[0, 1, :2, 2:].all() and pos[0, 1].sum() == 4  # token 1 (row 0, col 1) is one 2x2 block
    assert pos[0, 2, :2, 2:].all() and pos[0, 2, 2:, :2].all() and pos[0, 2].sum() == 8
    neg = removal_masks(maps, [0.25], False, (2, 2), (4, 4)).numpy()
    assert neg[0, 0, :2, :2].all() and neg[0, 0].sum() == 4  # least relevant first: token 0
    pix = removal_masks(maps, [0.1, 0.5], True, (2, 2), (4, 4), granularity="pixel").numpy()
    assert pix[0, 0].sum() == 1 and pix[0, 1].sum() == 8
    assert removal_counts(10, [0.7]).tolist() == [7]  # not 6 from 0.7 * 10 = 6.9999...
    with pytest.raises(vl.InvalidParameterError, match="granularity"):
        removal_masks(maps, [0.5], True, (2, 2), (4, 4), granularity="patch")


def test_positive_and_negative_perturbation_of_the_one_patch_model_have_known_curves(one_patch):
    """Removing the key patch (first in positive order) to black makes its red mean -1, so the class-0 logit goes
    from 4 to -4 at 10% and stays there; in negative order the key patch is last and at most 14 of 16 tokens go,
    so the probability stays sigmoid(4). AUC: trapezoid over 0, 0.1, .., 0.9."""
    x = key_patch_images(3)
    a = key_first_maps(3)
    r = perturbation_test(one_patch, x, a, batch_size=2)
    assert r.score == "probability" and r.fractions.tolist() == pytest.approx([i / 10 for i in range(10)])
    np.testing.assert_allclose(r.positive[:, 0], sigmoid(4), rtol=1e-5)
    np.testing.assert_allclose(r.positive[:, 1:], sigmoid(-4), rtol=1e-4)
    np.testing.assert_allclose(r.negative, sigmoid(4), rtol=1e-5)
    np.testing.assert_allclose(r.positive_auc, (sigmoid(4) + sigmoid(-4)) / 2 * 0.1 + sigmoid(-4) * 0.8, rtol=1e-4)
    np.testing.assert_allclose(r.negative_auc, 0.9 * sigmoid(4), rtol=1e-5)
    acc = perturbation_test(one_patch, x, a, labels=np.zeros(3, dtype=int))
    assert acc.score == "top-1 accuracy"
    np.testing.assert_allclose(acc.positive, np.repeat([[1.0] + [0.0] * 9], 3, 0))
    np.testing.assert_allclose(acc.positive_auc, 0.05)  # the first trapezoid only
    np.testing.assert_allclose(acc.negative_auc, 0.9)
    rows = r.to_rows()
    assert len(rows) == 20 and {row["order"] for row in rows} == {"positive", "negative"}
    assert "positive perturbation AUC" in r.summary()


def test_perturbation_fills_and_a_saved_result_loads_back(one_patch, tmp_path):
    x = key_patch_images(2)
    a = key_first_maps(2)
    mean_fill = perturbation_test(one_patch, x, a, fill="mean")
    # the key patch becomes its image's mean red: the logit is 4 x that mean
    mean_red = x[:, 0].mean(dim=(1, 2)).double().numpy()
    np.testing.assert_allclose(mean_fill.positive[:, 1], sigmoid(4 * mean_red), rtol=1e-4)
    assert vl.load_result(mean_fill.save(tmp_path / "p.json")).equals(mean_fill)
    with pytest.raises(vl.InvalidParameterError, match="fill"):
        perturbation_test(one_patch, x, a, fill="white")
    with pytest.raises(vl.InvalidParameterError, match="fractions"):
        perturbation_test(one_patch, x, a, fractions=[0.5, 0.2])
    with pytest.raises(vl.InvalidParameterError, match="labels"):
        perturbation_test(one_patch, x, a, labels=[0, 0, 0])


def test_imputation_reproduces_a_linear_image_inside_and_fills_a_constant_with_the_stated_noise():
    rows, cols = np.mgrid[0:12, 0:12].astype(np.float64)
    linear = np.stack([2 * rows - 3 * cols + 1, 0.5 * rows + cols, -rows])[None]  # [1, 3, 12, 12]
    removed = np.zeros((1, 12, 12), dtype=bool)
    removed[0, 2:8, 3:10] = True  # interior: every neighbour exists, the weights are symmetric
    np.testing.assert_allclose(noisy_linear_impute(linear, removed, noise_std=0.0), linear, atol=1e-10)
    const = np.full((2, 3, 40, 40), 0.7)
    gone = np.zeros((2, 40, 40), dtype=bool)
    gone[:, 5:35, 0:30] = True  # touches the border too: the constant is still the only solution
    np.testing.assert_allclose(noisy_linear_impute(const, gone, noise_std=0.0), const, atol=1e-12)
    noisy = noisy_linear_impute(const, gone, noise_std=0.05, rng=1)
    filled = noisy.transpose(1, 0, 2, 3)[:, gone]  # [3, 1800]
    assert filled.mean() == pytest.approx(0.7, abs=3 * 0.05 / np.sqrt(filled.size))
    assert filled.std() == pytest.approx(0.05, rel=0.03)
    np.testing.assert_array_equal(noisy.transpose(1, 0, 2, 3)[:, ~gone], 0.7)  # kept pixels untouched
    with pytest.raises(vl.InvalidParameterError, match="every pixel"):
        noisy_linear_impute(const, np.ones((2, 40, 40), dtype=bool))


def test_imputation_equals_quantus_noisy_linear_imputation():
    """quantus 0.6.0's ``noisy_linear_imputation`` is the ROAD authors' code one image at a time; ours builds one
    block-diagonal system for the batch. With the noise off both are the same solve: agreement to 1e-12."""
    quantus = pytest.importorskip("quantus")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 3, 20, 20))
    removed = rng.random((3, 20, 20)) < 0.6
    ours = noisy_linear_impute(x, removed, noise_std=0.0)
    for i in range(3):
        theirs = quantus.functions.perturb_func.noisy_linear_imputation(x[i], np.flatnonzero(removed[i]), noise=0.0)
        np.testing.assert_allclose(ours[i], theirs, atol=1e-12)


def test_road_of_the_one_patch_model_drops_at_the_key_patch_only(one_patch):
    """MoRF imputes the bright key patch from its random neighbours, so its red mean falls from 1 to about the
    neighbours' mean (~0) and the probability falls from sigmoid(4); LeRF never removes it (at most 14 of 16
    tokens), and the key patch alone sets the logit, so LeRF stays exactly sigmoid(4) whatever is imputed."""
    x = key_patch_images(3)
    r = road(one_patch, x, key_first_maps(3), noise_std=0.01, seed=3)
    np.testing.assert_allclose(r.lerf, sigmoid(4), rtol=1e-5)
    assert np.all(r.morf < sigmoid(2)) and r.score == "probability"
    again = road(one_patch, x, key_first_maps(3), noise_std=0.01, seed=3)
    np.testing.assert_array_equal(again.morf, r.morf)  # seeded
    morf, lerf = r.means()
    assert morf < lerf and "ROAD" in r.summary() and len(r.to_rows()) == 18


def test_road_equals_quantus_road_on_the_same_inputs():
    """quantus.ROAD (MoRF, top-1 accuracy against y) against ours with the noise off, on a 1-channel ViT with
    1-pixel patches, so a token is a pixel and both rank the same units. quantus 0.6.0 cannot take 3-channel
    images: it broadcasts the attributions over channels and indexes pixels past H x W. LeRF is quantus on the
    reversed map (1 - map). Agreement: exact, at every percentage."""
    quantus = pytest.importorskip("quantus")
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    net = VisionTransformer(img_size=16, patch_size=1, in_chans=1, embed_dim=16, depth=1, num_heads=2, num_classes=4,
                            global_pool="avg", class_token=False)
    with torch.no_grad():  # larger weights, so the prediction moves as pixels are imputed
        net.patch_embed.proj.weight.mul_(10)
        net.head.weight.mul_(30)
    m = vl.LoadedModel.from_module(net, name="gray", device="cpu",
                                   data_config={"input_size": (1, 16, 16), "mean": (0.5,), "std": (0.5,)})
    x = torch.randn(32, 1, 16, 16, generator=torch.Generator().manual_seed(1))
    y = m.logits(x).argmax(-1).numpy()
    maps = np.random.default_rng(0).random((32, 16, 16))
    a = AttributionResult(method="hand", maps=maps, targets=y, grid=(16, 16), image_size=(16, 16), seconds_per_image=0.0)
    ours = road(m, x, a, labels=y, noise_std=0.0, batch_size=8)
    pct = [10, 20, 30, 40, 50, 60, 70, 80, 90]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metric = quantus.ROAD(percentages=pct, noise=0.0, abs=False, normalise=False, return_aggregate=False,
                              disable_warnings=True, display_progressbar=False)
        morf = metric(model=net, x_batch=x.numpy(), y_batch=y, a_batch=maps[:, None], device="cpu", softmax=False)
        lerf = metric(model=net, x_batch=x.numpy(), y_batch=y, a_batch=1 - maps[:, None], device="cpu", softmax=False)
    np.testing.assert_array_equal(ours.morf.mean(0), [morf[p] for p in pct])
    np.testing.assert_array_equal(ours.lerf.mean(0), [lerf[p] for p in pct])
    assert 0 < ours.morf.mean() < 1  # the curves move: the check is not all ones


def test_compare_methods_gains_the_perturbation_columns_and_road_on_request(one_patch):
    x = key_patch_images(2)
    labels = np.zeros(2, dtype=int)
    table = vl.compare_methods(one_patch, x, methods=["occlusion", "rollout"], metrics=["perturbation", "road"],
                               labels=labels)
    row = table.rows[0]
    assert list(row) == ["method", "chefer_positive_auc", "chefer_negative_auc", "road_morf", "road_lerf",
                         "map_seconds_per_image", "total_seconds_per_image"]
    direct = perturbation_test(one_patch, x, table.attributions[0], labels=labels)
    assert row["chefer_positive_auc"] == pytest.approx(0.05) == pytest.approx(direct.positive_auc.mean())
    assert row["chefer_negative_auc"] == pytest.approx(0.9)  # occlusion ranks the key patch first: it is never removed
    assert row["road_lerf"] == 1.0 and row["road_morf"] == table.roads[0].means()[0]
    assert len(table.perturbations) == 2 and not table.faithfulness
    default = vl.compare_methods(one_patch, x, methods=["occlusion"], steps=4)
    assert {"deletion_auc", "chefer_positive_auc"} <= set(default.rows[0]) and "road_morf" not in default.rows[0]
    with pytest.raises(vl.InvalidParameterError, match="metrics"):
        vl.compare_methods(one_patch, x, methods=["occlusion"], metrics=["roar"])


def test_perturbation_figure_draws_the_mean_curves(one_patch):
    from vitlens.figures import perturbation_figure

    x = key_patch_images(2)
    a = key_first_maps(2)
    pt, rd = perturbation_test(one_patch, x, a), road(one_patch, x, a)
    fig = perturbation_figure([pt], [rd])
    assert len(fig.data) == 4 and len(fig.layout.annotations) == 4
    np.testing.assert_allclose(fig.data[0].y, pt.positive.mean(0))
    np.testing.assert_allclose(fig.data[3].y, rd.lerf.mean(0))
    assert len(perturbation_figure([pt]).data) == 2
