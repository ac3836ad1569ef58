"""The sparse autoencoder trained as the images stream (issue 66, item 1): TopK keeps k features, the decoder's rows
stay at unit norm, AuxK gives dead features a gradient, the same seed gives the same weights, the float16 cache
replaces later epochs' forwards within its budget, and every bad argument is refused before any forward."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.errors import InvalidParameterError
from vitlens.sae import SAEConfig, SparseAutoencoder
from vitlens.sae.trainer import SAETrainer

SITE = "blocks.3.hook_resid_post"


@pytest.fixture(scope="module")
def scenes(ref_vit):
    from vitlens.reference.shapes import generate

    return ref_vit.preprocess(list(generate(48, seed=1000).images))


@pytest.fixture()
def forwards(ref_vit, monkeypatch):
    """How many forwards the model ran (the SAE's stream calls ``LoadedModel.forward`` once a batch)."""
    calls = []
    plain = type(ref_vit).forward

    def counted(self, x):
        calls.append(int(x.shape[0]))
        return plain(self, x)
    monkeypatch.setattr(type(ref_vit), "forward", counted)
    return calls


def test_topk_code_keeps_each_tokens_k_largest_positive_pre_activations():
    sae = SparseAutoencoder(SAEConfig(d_in=6, n_features=10, k=3))
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    pre = sae.pre_acts(x)
    z = sae.encode(x)
    for row_pre, row_z in zip(pre, z):
        top = set(row_pre.topk(3).indices.tolist())
        assert set(row_z.nonzero().flatten().tolist()) <= top
        assert torch.allclose(row_z[list(top)], torch.relu(row_pre[list(top)]))
    recon, code = sae(x)
    assert torch.equal(code, z) and torch.allclose(recon, z @ sae.W_dec + sae.b_dec)
    assert torch.allclose(sae.W_dec.norm(dim=1), torch.ones(10))


def test_training_lowers_the_fraction_unexplained_with_k_features_a_token_and_unit_decoder_rows(ref_vit, scenes):
    from vitlens.sae.train import train_sae

    r = train_sae(ref_vit, scenes, site=SITE, n_features=128, k=6, epochs=2, batch_size=8, lr=2e-3, seed=1)
    assert len(r.fvu) == 12 and r.tokens[-1] == 2 * 48 * 64  # one step a forward, 64 patch tokens an image
    assert r.fvu[-1] < 0.75 * r.fvu[0]
    assert np.all(r.l0 <= 6) and r.l0[-1] > 5  # TopK: at most k, and the k kept are positive
    assert torch.allclose(r.sae.W_dec.norm(dim=1), torch.ones(128), atol=1e-5)
    assert r.sae.config.site == SITE and r.sae.config.model_name == "ref-vit"
    assert "128 features" in repr(r) and len(r.to_pandas()) == 12


def test_the_same_seed_gives_identical_weights_and_another_seed_other_weights(ref_vit, scenes):
    from vitlens.sae.train import train_sae

    runs = [train_sae(ref_vit, scenes[:16], site=SITE, n_features=64, k=4, batch_size=8, seed=s) for s in (7, 7, 8)]
    for name in ("W_enc", "b_enc", "W_dec", "b_dec"):
        assert np.array_equal(getattr(runs[0], name), getattr(runs[1], name))
    assert not np.array_equal(runs[0].W_dec, runs[2].W_dec)
    assert np.array_equal(runs[0].fvu, runs[1].fvu)


def test_auxk_gives_dead_features_a_gradient_and_without_it_they_stay_as_they_were():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    moved = {}
    for coef in (1 / 32, 0.0):
        t = SAETrainer(SAEConfig(d_in=8, n_features=16, k=2), lr=1e-2, dead_after=256, aux_coef=coef)
        with torch.no_grad():  # features 0..3 never among the top 2, though their pre-activations are at times > 0
            t.sae.b_enc[:4] = -2.0
            t.sae.b_enc[4:] = 5.0
        t.step(x)  # 256 tokens without a firing: features 0..3 (at least) are dead after this step
        assert t.history.last("dead_fraction") >= 4 / 16
        before = t.sae.W_enc[:, :4].detach().clone()
        t.step(x)
        moved[coef] = (t.sae.W_enc[:, :4] - before).abs().max().item()
        assert (t.history.last("aux_loss") > 0) == (coef > 0)
    assert moved[1 / 32] > 0 and moved[0.0] == 0.0


def test_relu_sae_trains_with_an_l1_penalty_that_lowers_l0(ref_vit, scenes):
    from vitlens.sae.train import train_sae

    l0 = {}
    for l1 in (0.0, 3.0):
        r = train_sae(ref_vit, scenes, site=SITE, n_features=64, kind="relu", l1=l1, epochs=2, batch_size=8, lr=3e-3)
        assert r.sae.config.kind == "relu" and r.sae.config.k is None
        l0[l1] = r.l0[-1]
    assert l0[3.0] < 0.8 * l0[0.0]


def test_the_cache_replaces_later_epochs_forwards_within_its_budget(ref_vit, scenes, forwards):
    from vitlens.sae.train import train_sae

    kw = dict(site=SITE, n_features=64, k=4, epochs=3, batch_size=8, seed=2)
    plain = train_sae(ref_vit, scenes, **kw)
    assert len(forwards) == 18 and plain.cached_batches == 0  # 6 batches x 3 epochs
    forwards.clear()
    full = train_sae(ref_vit, scenes, cache_bytes=10 ** 7, **kw)
    assert len(forwards) == 6 and full.cached_batches == 12  # the first epoch's forwards only
    # float16 activations in the later epochs: close to the float32 run, not equal
    assert np.allclose(full.fvu, plain.fvu, atol=2e-2) and not np.array_equal(full.W_dec, plain.W_dec)
    forwards.clear()
    batch_bytes = 8 * 64 * 128 * 2  # one batch's patch tokens in float16
    part = train_sae(ref_vit, scenes, cache_bytes=2 * batch_bytes + 1, **kw)
    assert part.cached_batches == 4 and len(forwards) == 6 + 2 * 4  # two batches cached, four forwarded again
    assert sum(forwards) == 48 + 2 * 32  # the forwarded ones are the images after the cached ones
    assert np.array_equal(part.fvu[:6], plain.fvu[:6])


def test_progress_reports_images_with_the_loss_l0_and_fvu(ref_vit, scenes):
    from vitlens.sae.train import train_sae

    seen = []
    train_sae(ref_vit, scenes[:16], site=SITE, n_features=32, k=2, epochs=2, batch_size=8,
              progress=lambda done, total: seen.append((done, total)))
    assert seen == [(8, 32), (16, 32), (24, 32), (32, 32)]


@pytest.mark.parametrize("kwargs, words", [
    ({"site": "blocks.9.hook_resid_post"}, ["no site 'blocks.9.hook_resid_post'", "blocks.5.hook_resid_post"]),
    ({"k": 65}, ["k (active features per token)", "from 1 to n_features (64)", "65"]),
    ({"kind": "jumprelu"}, ["kind must be one of topk, relu", "jumprelu"]),
    ({"tokens": "cls"}, ["tokens must be one of patches, prefix, all"]),
    ({"epochs": 0}, ["epochs must be an integer > 0"]),
    ({"lr": float("nan")}, ["lr must be a finite number > 0"]),
    ({"cache_bytes": -1}, ["cache_bytes", ">= 0"]),
    ({"n_features": 0}, ["n_features must be an integer > 0"]),
    ({"kind": "relu", "l1": -1.0}, ["l1 must be a finite number >= 0"]),
    ({"dead_after": 0}, ["dead_after must be an integer > 0"]),
    ({"aux_coef": float("inf")}, ["aux_coef must be a finite number >= 0"]),
])
def test_bad_arguments_are_refused_by_name_before_any_forward(ref_vit, scenes, forwards, kwargs, words):
    from vitlens.sae.train import train_sae

    args = {"site": SITE, "n_features": 64, "k": 4, **kwargs}
    with pytest.raises(InvalidParameterError) as e:
        train_sae(ref_vit, scenes[:8], **args)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert forwards == []


def test_an_iterator_read_once_is_refused_for_several_epochs_before_any_forward(ref_vit, scenes, forwards):
    from vitlens.sae.train import train_sae

    with pytest.raises(InvalidParameterError, match="iterator is read once"):
        train_sae(ref_vit, iter([scenes[:8]]), site=SITE, n_features=16, k=2, epochs=2)
    assert forwards == []


def test_a_training_result_saves_and_loads_with_its_sae(ref_vit, scenes, tmp_path):
    from vitlens.sae.train import train_sae

    r = train_sae(ref_vit, scenes[:8], site=SITE, n_features=16, k=2, batch_size=4)
    back = vl.load_result(r.save(tmp_path / "sae.npz"))
    assert back.equals(r)
    assert torch.equal(back.sae.W_enc, r.sae.W_enc) and back.sae.config == r.sae.config
