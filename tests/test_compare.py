"""Deeper comparisons with known answers: minibatch CKA (identity, invariances, the unbiased
estimator's zero for independent features, a plain numpy implementation), head importance on a
hand-built model where one head carries the answer, and attention parked on prefix tokens."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import vitlens as vl
from vitlens.views.attention_maps import AttentionMapsResult
from vitlens.compare.cka import MinibatchCKA
from vitlens.views.prefix import PrefixAttentionAccumulator, parked_heads


def numpy_hsic(k: np.ndarray, l: np.ndarray, unbiased: bool) -> float:
    """HSIC written out from the formulas (Song et al. 2012 unbiased; Gretton et al. 2005 biased)."""
    n = k.shape[0]
    if not unbiased:
        h = np.eye(n) - np.ones((n, n)) / n
        return float(np.trace(k @ h @ l @ h) / (n - 1) ** 2)
    kt, lt = k.copy(), l.copy()
    np.fill_diagonal(kt, 0)
    np.fill_diagonal(lt, 0)
    ones = np.ones(n)
    return float((np.trace(kt @ lt) + kt.sum() * lt.sum() / ((n - 1) * (n - 2))
                  - 2 / (n - 2) * ones @ kt @ lt @ ones) / (n * (n - 3)))


def numpy_cka(xs: list[np.ndarray], ys: list[np.ndarray], unbiased: bool) -> float:
    """Minibatch CKA of one layer pair: HSIC sums over batches, divided at the end."""
    xy = sum(numpy_hsic(x @ x.T, y @ y.T, unbiased) for x, y in zip(xs, ys))
    xx = sum(numpy_hsic(x @ x.T, x @ x.T, unbiased) for x in xs)
    yy = sum(numpy_hsic(y @ y.T, y @ y.T, unbiased) for y in ys)
    return xy / np.sqrt(xx * yy)


def batches(x: np.ndarray, size: int) -> list[torch.Tensor]:
    return [torch.from_numpy(x[i: i + size]) for i in range(0, len(x), size)]


def run(xs: list[torch.Tensor], ys: list[torch.Tensor], estimator: str = "unbiased") -> float:
    acc = MinibatchCKA(1, 1, estimator)
    for x, y in zip(xs, ys):
        acc.update([x], [y])
    return float(acc.value()[0, 0])


@pytest.fixture()
def feats() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(48, 20))


@pytest.mark.parametrize("estimator", ["unbiased", "biased"])
def test_cka_of_a_representation_with_itself_is_one(feats, estimator):
    assert run(batches(feats, 12), batches(feats, 12), estimator) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("estimator", ["unbiased", "biased"])
def test_cka_ignores_rotation_and_isotropic_scaling(feats, estimator):
    q, _ = np.linalg.qr(np.random.default_rng(1).normal(size=(20, 20)))
    other = np.random.default_rng(2).normal(size=(48, 30))
    base = run(batches(feats, 12), batches(other, 12), estimator)
    moved = run(batches(3.7 * feats @ q, 12), batches(other * 0.01, 12), estimator)
    assert moved == pytest.approx(base, abs=1e-10)


def test_unbiased_cka_of_independent_features_is_near_zero_where_biased_is_not():
    rng = np.random.default_rng(3)
    x, y = rng.normal(size=(64, 256)), rng.normal(size=(64, 256))
    unbiased = run(batches(x, 16), batches(y, 16), "unbiased")
    biased = run(batches(x, 16), batches(y, 16), "biased")
    assert abs(unbiased) < 0.05 and biased > 0.5  # the biased estimator is inflated at n = 16


@pytest.mark.parametrize("estimator", ["unbiased", "biased"])
def test_cka_equals_a_plain_numpy_implementation(estimator):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(40, 12))
    y = np.tanh(x @ rng.normal(size=(12, 9))) + 0.3 * rng.normal(size=(40, 9))
    want = numpy_cka([b.numpy() for b in batches(x, 10)], [b.numpy() for b in batches(y, 10)], estimator == "unbiased")
    assert run(batches(x, 10), batches(y, 10), estimator) == pytest.approx(want, rel=1e-10)
    per_batch = np.mean([run([a], [b], estimator) for a, b in zip(batches(x, 10), batches(y, 10))])
    assert per_batch != pytest.approx(want, rel=1e-3)  # averaging per-batch CKA would be a different number


def test_a_model_compared_with_itself_has_ones_on_the_diagonal_and_a_small_last_batch_joins_the_one_before():
    m = vl.load_model("ref-vit", device="cpu")
    from vitlens.reference.shapes import HELD_OUT_SEED, generate

    images = list(generate(18, seed=HELD_OUT_SEED).images)
    r = vl.cka(m, m, images, batch_size=8)
    assert r.matrix.shape == (6, 6) and r.n_images == 18 and r.n_batches == 2  # 8, then 8 + 2
    np.testing.assert_allclose(np.diagonal(r.matrix), 1.0, atol=1e-9)
    assert r.layers_a == [f"blocks.{i}" for i in range(6)]
    assert np.all(r.ci_low <= r.matrix + 1e-9) and np.all(r.matrix <= r.ci_high + 1e-9)
    with pytest.raises(vl.InvalidParameterError, match="at least 4 images"):
        vl.cka(m, m, images[:3])


def test_cka_compares_a_vit_with_a_cnn_by_module_name():
    import timm

    cnn = timm.create_model("resnet18", pretrained=False, num_classes=6)
    m = vl.load_model("ref-vit", device="cpu")
    x = torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    r = vl.cka(m, cnn, x, layers_b=["layer1", "layer4"], batch_size=8)
    assert r.matrix.shape == (6, 2) and np.isfinite(r.matrix).all()
    patches = vl.cka(m, cnn, x, layers_b=["layer2"], token_policy="patches", batch_size=8)
    assert patches.grid == (8, 8) and patches.matrix.shape == (6, 1)
    with pytest.raises(vl.InvalidParameterError, match="no class token"):
        vl.cka(m, cnn, x, layers_b=["layer1"], token_policy="cls")
    with pytest.raises(vl.InvalidParameterError, match="Name the layers"):
        vl.cka(m, cnn, x)


def two_head_model() -> vl.LoadedModel:
    """One block, two heads of width 4 (D = 8), no norms, no MLP: head 0 copies the mean of the
    patch tokens' dim 0 (the patches' mean red) into the class token's dim 4; head 1 has zero
    values, so it adds nothing. Class 0's logit reads dim 4; class 1's is 0."""
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=2, num_classes=2,
                              norm_layer=nn.Identity, mlp_ratio=1.0)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.patch_embed.proj.weight[0, 0] = 1.0 / 64  # dim 0: mean red of the patch
        attn = model.blocks[0].attn
        attn.qkv.weight[16, 0] = 1.0  # head 0's value 0 = dim 0; head 1's values stay zero
        attn.proj.weight[4, 0] = 1.0  # head 0's value 0 -> dim 4
        model.head.weight[0, 4] = 4.0
    return vl.LoadedModel.from_module(model, name="two-head", device="cpu",
                                      data_config={"mean": (0.0,) * 3, "std": (1.0,) * 3})


@pytest.mark.parametrize("ablation", ["mean", "zero"])
def test_only_the_head_that_carries_the_answer_is_important(ablation):
    m = two_head_model()
    x = torch.rand(12, 3, 16, 16, generator=torch.Generator().manual_seed(6)) * 2 - 1
    logits = m.logits(x)
    labels = logits.argmax(-1).numpy()
    assert set(labels) == {0, 1}  # the answer depends on the image
    r = vl.head_importance(m, x, labels=labels, ablation=ablation, batch_size=8)
    assert r.logit_drop.shape == (1, 2) and r.base_accuracy == 1.0
    assert r.logit_drop[0, 1] == pytest.approx(0.0, abs=1e-6) and r.accuracy_drop[0, 1] == 0.0
    assert abs(r.logit_drop[0, 0]) > 1e-3 and r.accuracy_drop[0, 0] > 0
    # the drop has a closed form: every token attends uniformly, so head 0 adds the image's mean red
    # (over all tokens) to the class token; zero-ablation removes it, mean-ablation puts the set's mean
    red = x[:, 0].mean(dim=(1, 2)).double().numpy() * 4 / 5  # 4 patches + the class token (0)
    pred_logit = np.where(labels == 0, 4 * red, 0.0)
    ablated = np.where(labels == 0, 4 * (0.0 if ablation == "zero" else red.mean()), 0.0)
    assert r.logit_drop[0, 0] == pytest.approx(float((pred_logit - ablated).mean()), rel=1e-4)
    assert r.forwards == 12 * 3


def test_prefix_mass_of_hand_built_attention_is_the_parked_share():
    # 1 layer, 2 heads, 2 prefix tokens + 4 patches; head 0 parks 0.7 on prefix token 1, head 1 spreads evenly
    t = 6
    attn = torch.zeros(3, 2, t, t)
    attn[:, 0, :, 1] = 0.7
    attn[:, 0, :, 2:] = 0.3 / 4
    attn[:, 1] = 1.0 / t
    acc = PrefixAttentionAccumulator(1, 2, 2)
    acc.on_attention(0, attn)
    mass = acc.mass()
    np.testing.assert_allclose(mass[0, 0], [0.0, 0.7], atol=1e-7)
    np.testing.assert_allclose(mass[0, 1], [1 / 6, 1 / 6], atol=1e-7)
    assert parked_heads(mass, ["class", "register 1"]) == [{"layer": 1, "head": 1, "token": "register 1",
                                                              "share": pytest.approx(0.7)}]


def test_uniform_attention_puts_one_share_per_token_on_each_prefix_token():
    import copy

    from conftest import get_model

    base = get_model("vit_small_patch14_reg4_dinov2", img_size=56)  # class + 4 registers, 4x4 patches
    m = copy.copy(base)
    m.model = copy.deepcopy(base.model)
    with torch.no_grad():
        for block in m.model.blocks:
            dim = block.attn.head_dim * block.attn.num_heads
            block.attn.qkv.weight[: 2 * dim] = 0
            block.attn.qkv.bias[: 2 * dim] = 0
    r = vl.prefix_diagnostics(m, torch.randn(2, 3, 56, 56))
    assert r.labels == ["class", "register 1", "register 2", "register 3", "register 4"]
    np.testing.assert_allclose(r.mass, 1 / 21, rtol=1e-5)  # 5 prefix + 16 patch tokens
    assert r.parked() == [] and r.prefix_norm.shape == (12, 5) and r.outlier_share.shape == (12,)


def test_attention_maps_flag_parked_heads_of_one_image():
    maps = np.zeros((2, 2, 5, 5), dtype=np.float32)  # 2 layers, 2 heads, class token + 4 patches
    maps[..., 1:] = 0.25
    maps[1, 0, :, 0], maps[1, 0, :, 1:] = 0.8, 0.05  # layer 2, head 1 parks on the class token
    res = AttentionMapsResult(maps=maps, grid=(2, 2), num_prefix_tokens=1, image_size=(16, 16))
    assert res.parked_heads(["class"]) == [{"layer": 2, "head": 1, "token": "class", "share": pytest.approx(0.8)}]


# --- CKA ranges in words

def test_cka_ranges_read_as_ranges_and_negatives_are_explained():
    from vitlens.compare.cka import CKAResult
    from vitlens.words import value_range

    assert value_range(-0.73, -0.02) == "\u22120.73 to \u22120.02" and value_range(0.5, 0.504) == "0.50"
    m = np.array([[-0.73, 0.1], [0.2, -0.02]])
    res = CKAResult(matrix=m, ci_low=m, ci_high=m, layers_a=["a", "b"], layers_b=["a", "b"], estimator="unbiased",
                    token_policy="mean", n_images=8, batch_size=4, n_batches=2, model_a="A", model_b="B")
    text = res.summary()
    assert "diagonal \u22120.73 to \u22120.02" in text and "--" not in text
    assert "unbiased HSIC estimator" in text and "4 images per minibatch" in text
    positive = CKAResult(matrix=np.abs(m), ci_low=m, ci_high=m, layers_a=["a", "b"], layers_b=["a", "b"],
                         estimator="unbiased", token_policy="mean", n_images=8, batch_size=4, n_batches=2)
    assert "estimator" not in positive.summary()  # nothing below 0, nothing to explain
