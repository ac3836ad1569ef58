"""The feature views of a sparse autoencoder (issue 66, item 3): ``vl.sae_features``'s statistics against a direct
encoding of the recorded site, the writer heads against the attention branch they add up to, the logit effect against
the head's derivative, and ``vl.sae_intervene``'s edit against a forward edited by hand (the embedded ref-vit, an SAE
with random weights)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.components.layout import read_sites
from vitlens.engine.sites import record
from vitlens.errors import InvalidParameterError
from vitlens.figures import figure_for
from vitlens.figures.sae import sae_feature_figure, sae_top_images_figure, sae_writers_figure
from vitlens.reference.shapes import generate
from vitlens.results import Result
from vitlens.sae.activations import site_point
from vitlens.sae.features import SAEFeaturesResult
from vitlens.sae.model import SAEConfig, SparseAutoencoder

SITE = "blocks.2.hook_resid_post"


def _sae(m, tokens: str = "all", n_features: int = 48, k: int = 4, seed: int = 0) -> SparseAutoencoder:
    sae = SparseAutoencoder(SAEConfig(d_in=m.spec.embed_dim, n_features=n_features, k=k, site=SITE, tokens=tokens,
                                      model_name=m.spec.name, seed=seed))
    return sae


@pytest.fixture(scope="module")
def scenes():
    return generate(10, seed=0)


@pytest.fixture(scope="module")
def shown(ref_vit, scenes):
    sae = _sae(ref_vit)
    return sae, vl.sae_features(ref_vit, sae, list(scenes.images), labels=scenes.labels, top=3, batch_size=4)


def _codes(m, sae, images) -> tuple[torch.Tensor, torch.Tensor]:
    """(z [N, T, F] of every token, the site [N, T, D]) from one recorded forward: the independent reading."""
    x = m.preprocess(images)
    seen, _ = record(m.model, site_point(m, SITE), lambda: m.model(x))
    acts = seen[SITE].float()
    with torch.no_grad():
        z = sae.encode(acts.reshape(-1, acts.shape[-1])).reshape(*acts.shape[:2], -1).double()
    return z, acts


def test_feature_statistics_equal_a_direct_encoding_of_the_recorded_site(ref_vit, scenes, shown):
    sae, r = shown
    z, _ = _codes(ref_vit, sae, list(scenes.images))
    n, t, f = z.shape
    p = ref_vit.spec.num_prefix_tokens
    np.testing.assert_allclose(r.frequency, (z > 0).double().mean((0, 1)).numpy(), atol=1e-12)
    assert r.n_tokens == n * t and r.n_images == n
    gh, gw = ref_vit.spec.grid
    np.testing.assert_allclose(r.grid_mean, z[:, p:].mean(0).T.reshape(f, gh, gw).numpy(), atol=1e-5)
    for c in range(len(r.class_names)):
        pick = torch.as_tensor(scenes.labels == c)
        want = z[pick].mean((0, 1)).numpy() if pick.any() else np.zeros(f)
        np.testing.assert_allclose(r.class_mean[:, c], want, atol=1e-5)
    best = z.amax(1)  # [N, F]
    for row, feature in enumerate(r.features[:10]):
        order = torch.argsort(best[:, feature], descending=True, stable=True)[:3].numpy()
        np.testing.assert_allclose(r.top_values[row], best[order, feature].numpy(), atol=1e-5)
        assert np.array_equal(r.top_images[row] >= 0, r.top_values[row] > 0)  # -1 past the images it fires on
        if r.top_images[row, 0] >= 0:
            np.testing.assert_allclose(r.top_maps[row, 0],
                                       z[r.top_images[row, 0], p:, feature].reshape(gh, gw).numpy(), atol=1e-5)
    assert r.hist_counts.sum() == int((z > 0).sum())


def test_the_writer_heads_add_up_to_the_attention_branch_along_each_encoder_direction(ref_vit, scenes, shown):
    sae, r = shown
    x = ref_vit.preprocess(list(scenes.images))
    names = [f"blocks.{i}.hook_attn_out" for i in range(3)]
    seen = read_sites(ref_vit, x, names)
    w_enc = sae.W_enc.detach().double()[:, r.features]
    assert sorted(set(r.writer_heads[:, 0])) == [0, 1, 2]  # the heads of the blocks up to the site's own
    for i in range(3):
        branch = seen[names[i]].double()  # ls1's output: the heads' writes plus the projection's bias
        bias = ref_vit.model.blocks[i].attn.proj.bias.detach().double()
        want = ((branch - bias) @ w_enc).mean((0, 1)).numpy()
        cols = r.writer_heads[:, 0] == i
        np.testing.assert_allclose(r.writers_all[:, cols].sum(1), want, atol=1e-6)
    assert np.isfinite(r.head_distance_px).all() and r.head_distance_px.shape == (6, 8)


def test_the_logit_effect_is_the_heads_derivative_along_a_direction_the_norm_holds(ref_vit, scenes):
    """Along a direction orthogonal to the centred class token and to the ones vector, the final LayerNorm's scale
    does not move to first order, so the held-scale effect equals the true derivative of the logits."""
    m = ref_vit
    sae = _sae(m)
    image = list(scenes.images[:1])
    x = m.preprocess(image)
    seen = read_sites(m, x, ["ln_final.hook_in"])
    cls = seen["ln_final.hook_in"][0, 0].double()
    centred = cls - cls.mean()
    g = torch.Generator().manual_seed(3)
    d = torch.randn(cls.shape[0], generator=g, dtype=torch.float64)
    for v in (torch.ones_like(d) / d.shape[0] ** 0.5, centred / centred.norm()):
        d = d - (d @ v) * v
    with torch.no_grad():
        sae.W_dec[5] = (d / d.norm()).float()
    r = vl.sae_features(m, sae, image, top=1, features=[5])
    model = m.model.double()
    try:
        def logits(t: torch.Tensor) -> torch.Tensor:
            return model.head(model.norm(t))
        _, jvp = torch.func.jvp(logits, (cls,), (sae.W_dec[5].detach().double(),))
    finally:
        m.model.float()
    np.testing.assert_allclose(r.logit_effect[5], jvp.numpy(), rtol=1e-4, atol=1e-6)
    assert r.logit_names == list(m.label_names())


def _by_hand(m, sae, x: torch.Tensor, feature: int) -> torch.Tensor:
    """ref-vit's logits with the feature's decoder contribution taken out of every token after block 2, the model
    run block by block (no vitlens code on the path)."""
    model = m.model
    with torch.no_grad():
        h = model.norm_pre(model.patch_drop(model._pos_embed(model.patch_embed(x))))
        for i, block in enumerate(model.blocks):
            h = block(h)
            if i == 2:
                flat = h.reshape(-1, h.shape[-1])
                z = sae.encode(flat)[:, feature]
                h = (flat - z[:, None] * sae.W_dec[feature]).reshape(h.shape)
        return model.forward_head(model.norm(h))


def test_ablating_a_feature_equals_the_forward_edited_by_hand(ref_vit, scenes):
    m = ref_vit
    sae = _sae(m)
    images = list(scenes.images[:4])
    z, _ = _codes(m, sae, images)
    feature = int(z.amax((0, 1)).argmax())
    r = vl.sae_intervene(m, sae, images, feature, batch_size=2)
    want = _by_hand(m, sae, m.preprocess(images), feature)
    np.testing.assert_allclose(r.logits_after, want.double().numpy(), atol=1e-4)
    np.testing.assert_allclose(r.logits_before, m.model(m.preprocess(images)).detach().double().numpy(), atol=1e-5)
    np.testing.assert_allclose(r.activation, z[..., feature].amax(1).numpy(), atol=1e-6)
    assert np.abs(r.logits_after - r.logits_before).max() > 1e-3
    assert r.rollout_after.shape == r.rollout_before.shape == (4, *m.spec.grid)
    assert not np.allclose(r.rollout_after, r.rollout_before)  # the blocks after the site attend otherwise


def test_a_feature_that_never_fires_leaves_logits_and_rollout_as_they_were(ref_vit, scenes):
    m = ref_vit
    sae = _sae(m, k=1)
    images = list(scenes.images[:3])
    z, _ = _codes(m, sae, images)
    silent = np.flatnonzero((z > 0).sum((0, 1)).numpy() == 0)
    assert len(silent), "a TopK SAE with k=1 over 48 features leaves some off"
    r = vl.sae_intervene(m, sae, images, int(silent[0]))
    np.testing.assert_array_equal(r.logits_after, r.logits_before)
    np.testing.assert_array_equal(r.rollout_after, r.rollout_before)


def test_clamping_sets_the_features_activation_on_the_tokens_it_reads(ref_vit, scenes):
    """After a clamp to v, the site's tokens are x + (v - z_f) W_dec[f]: their reading along the feature's decoder
    direction moved by exactly (v - z_f) (the decoder row is a unit vector)."""
    from vitlens.sae.interventions import feature_edit

    m = ref_vit
    sae = _sae(m, tokens="patches")
    _, acts = _codes(m, sae, list(scenes.images[:2]))
    edit = feature_edit(sae, 7, "clamp", 2.5)
    out = edit(acts, m.spec.num_prefix_tokens)
    p = m.spec.num_prefix_tokens
    with torch.no_grad():
        z = sae.encode(acts[:, p:].reshape(-1, acts.shape[-1]))[:, 7]
    moved = ((out - acts)[:, p:].reshape(-1, acts.shape[-1]) @ sae.W_dec[7].detach())
    np.testing.assert_allclose(moved.numpy(), (2.5 - z).numpy(), atol=1e-5)
    assert torch.equal(out[:, :p], acts[:, :p])  # the class token is not among the tokens it reads


@pytest.mark.parametrize("call, named", [
    (lambda m, s, im: vl.sae_features(m, s, im, top=0), "top"),
    (lambda m, s, im: vl.sae_features(m, s, im, features=[48]), "features"),
    (lambda m, s, im: vl.sae_features(m, s, im, labels=[0]), "labels"),
    (lambda m, s, im: vl.sae_intervene(m, s, im, 3, mode="erase"), "mode"),
    (lambda m, s, im: vl.sae_intervene(m, s, im, 3, mode="clamp"), "value"),
    (lambda m, s, im: vl.sae_intervene(m, s, im, 99), "feature"),
])
def test_bad_arguments_are_refused_by_name_before_any_forward(ref_vit, scenes, call, named):
    with pytest.raises(InvalidParameterError, match=named):
        call(ref_vit, _sae(ref_vit), list(scenes.images[:2]))


def test_an_sae_of_another_width_or_site_is_refused(ref_vit, scenes):
    wide = SparseAutoencoder(SAEConfig(d_in=64, n_features=8, k=2, site=SITE))
    with pytest.raises(InvalidParameterError, match="64-wide"):
        vl.sae_features(ref_vit, wide, list(scenes.images[:2]))
    elsewhere = SparseAutoencoder(SAEConfig(d_in=128, n_features=8, k=2, site="blocks.9.hook_resid_post"))
    with pytest.raises(InvalidParameterError, match="no site"):
        vl.sae_features(ref_vit, elsewhere, list(scenes.images[:2]))


def test_the_result_saves_loads_orders_and_draws(ref_vit, scenes, shown, tmp_path):
    _, r = shown
    back = Result.load(r.save(tmp_path / "features.json"))
    assert isinstance(back, SAEFeaturesResult) and back.equals(r)
    by_freq = r.order("frequency")
    assert np.all(np.diff(r.frequency[by_freq]) <= 0)
    assert np.all(np.diff(r.logit_strength()[r.order("logit_effect")]) <= 0)
    feature = int(by_freq[0])
    images = ref_vit.display(list(scenes.images))
    assert len(sae_top_images_figure(r, feature, images).data) == 2 * 3  # an image and its map per top image
    assert len(sae_feature_figure(r, feature).data) == 4
    writers = sae_writers_figure(r, feature)
    assert sum(len(t.x) for t in writers.data) == len(r.writer_heads) == 3 * 8
    assert figure_for(r) is not None
    assert len(r.to_rows()) == 48 and "never active" in r.summary()
