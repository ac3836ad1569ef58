"""An SAE measured on held-out images (issue 66, item 2), against hand-built SAEs whose answers are known: one that
reconstructs every token exactly (FVU 0, the output unchanged), one that writes every token as the mean (FVU 1, the
output that of the mean spliced in by a hook of the test's own); and reading a site leaves the forward untouched."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vitlens.errors import InvalidParameterError
from vitlens.sae import SAEConfig, SparseAutoencoder, iter_site_batches, select_tokens

SITE = "blocks.3.hook_resid_post"


@pytest.fixture(scope="module")
def held_out(ref_vit):
    from vitlens.reference.shapes import generate

    return ref_vit.preprocess(list(generate(12, seed=0).images))


def exact_sae(d: int) -> SparseAutoencoder:
    """A ReLU SAE whose 2d features are each coordinate's positive and negative part: x_hat = x exactly."""
    sae = SparseAutoencoder(SAEConfig(d_in=d, n_features=2 * d, kind="relu", k=None, site=SITE))
    eye = torch.eye(d)
    with torch.no_grad():
        sae.W_enc.copy_(torch.cat([eye, -eye], 1))
        sae.W_dec.copy_(torch.cat([eye, -eye], 0))
        sae.b_enc.zero_()
        sae.b_dec.zero_()
    return sae


def patch_tokens(m, x) -> torch.Tensor:
    return torch.cat([select_tokens(b.acts, b.prefix, "patches") for b in iter_site_batches(m, x, SITE, 5)])


def test_reading_a_site_leaves_the_output_bit_for_bit_as_it_was(ref_vit, held_out):
    logits = torch.cat([b.logits for b in iter_site_batches(ref_vit, held_out, SITE, 5)])
    assert torch.equal(logits, ref_vit.logits(held_out))


def test_an_sae_that_reconstructs_exactly_has_fvu_zero_and_leaves_the_output_as_it_was(ref_vit, held_out):
    from vitlens.sae.evaluate import evaluate_sae

    x = patch_tokens(ref_vit, held_out)
    r = evaluate_sae(ref_vit, exact_sae(x.shape[1]), held_out, batch_size=5)
    assert r.fvu < 1e-10 and r.kl < 1e-8 and r.top1_agreement == 1.0
    assert r.n_images == 12 and r.n_tokens == 12 * 64 and len(r.kl_per_image) == 12
    pos = (x > 0).double().mean(0).numpy()  # feature i fires where coordinate i is positive, i + d where negative
    assert np.allclose(r.frequency, np.concatenate([pos, (x < 0).double().mean(0).numpy()]))
    assert r.l0 == pytest.approx(float((x != 0).sum(1).double().mean()))
    freq = np.concatenate([pos, (x < 0).double().mean(0).numpy()])
    assert r.dead_fraction == pytest.approx((freq == 0).mean()) and r.always_on_fraction == (freq > 0.9).mean()


def test_an_sae_that_writes_the_mean_has_fvu_one_and_the_kl_of_the_mean_spliced_in(ref_vit, held_out):
    from vitlens.sae.evaluate import evaluate_sae

    x = patch_tokens(ref_vit, held_out)
    sae = SparseAutoencoder(SAEConfig(d_in=x.shape[1], n_features=4, k=1, site=SITE))
    with torch.no_grad():
        sae.W_dec.zero_()
        sae.b_dec.copy_(x.mean(0))
    r = evaluate_sae(ref_vit, sae, held_out, batch_size=5)
    assert r.fvu == pytest.approx(1.0, abs=1e-9)

    def mean_in(_module, _args, out):  # the test's own splice: every patch token the held-out mean
        out = out.clone()
        out[:, 1:] = x.mean(0)
        return out
    with torch.no_grad():
        handle = ref_vit.model.blocks[3].register_forward_hook(mean_in)
        try:
            q = ref_vit.model(held_out).double().log_softmax(-1)
        finally:
            handle.remove()
        p = ref_vit.model(held_out).double().log_softmax(-1)
    kl = (p.exp() * (p - q)).sum(-1).numpy()
    assert np.allclose(r.kl_per_image, kl, atol=1e-6) and r.kl > 0.01
    assert r.top1_agreement == pytest.approx((p.argmax(-1) == q.argmax(-1)).double().mean().item())
    assert "FVU 1" in repr(r) and {row["measure"] for row in r.to_rows()} >= {"fvu", "kl", "top1_agreement"}


def test_a_trained_sae_is_measured_on_the_held_out_tokens(ref_vit, held_out):
    from vitlens.reference.shapes import generate
    from vitlens.sae.evaluate import evaluate_sae
    from vitlens.sae.train import train_sae

    r = train_sae(ref_vit, ref_vit.preprocess(list(generate(32, seed=1000).images)), site=SITE, n_features=64, k=4,
                  epochs=2, batch_size=8)
    e = evaluate_sae(ref_vit, r, held_out)
    x = patch_tokens(ref_vit, held_out).double()
    with torch.no_grad():
        recon = r.sae(x.float())[0].double()
    assert e.fvu == pytest.approx(float((recon - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum()), rel=1e-6)
    assert 0 < e.fvu < 1 and e.l0 <= 4 and 0 <= e.kl and 0 <= e.top1_agreement <= 1


def test_an_sae_of_another_width_or_without_a_site_is_refused_in_words(ref_vit, held_out):
    from vitlens.sae.evaluate import evaluate_sae

    with pytest.raises(InvalidParameterError, match="reads 64-wide tokens.*holds 128-wide"):
        evaluate_sae(ref_vit, SparseAutoencoder(SAEConfig(d_in=64, n_features=8, k=2, site=SITE)), held_out)
    with pytest.raises(InvalidParameterError, match="names no site"):
        evaluate_sae(ref_vit, SparseAutoencoder(SAEConfig(d_in=128, n_features=8, k=2)), held_out)
    with pytest.raises(InvalidParameterError, match="always_on"):
        evaluate_sae(ref_vit, exact_sae(128), held_out, always_on=1.5)


@pytest.mark.parametrize("name, prefix, grid", [("deit_tiny_distilled_patch16_224", 2, (14, 14)),
                                                ("swin_tiny_patch4_window7_224", 0, (56, 56))])
def test_random_init_timm_sites_are_read_and_spliced_back_in_place(name, prefix, grid):
    """A DeiT's two prefix tokens, and a Swin stage's channels-last map [B, H, W, C] read as its grid's tokens and
    written back in its own shape: an exact SAE spliced in leaves the output as it was."""
    from conftest import get_model
    from vitlens.sae.evaluate import evaluate_sae

    m = get_model(name)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    b = next(iter_site_batches(m, x, "blocks.1.hook_resid_post", 2))
    assert b.prefix == prefix and b.grid == grid and b.acts.shape[1] == prefix + grid[0] * grid[1]
    if prefix:
        assert select_tokens(b.acts, b.prefix, "prefix").shape == (2 * prefix, b.acts.shape[2])
    sae = exact_sae(b.acts.shape[2])
    sae.config.site, sae.config.tokens = "blocks.1.hook_resid_post", "all"
    r = evaluate_sae(m, sae, x)
    assert r.fvu < 1e-10 and r.kl < 1e-8 and r.top1_agreement == 1.0
