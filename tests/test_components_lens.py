"""The logit lens and token norms (issue 51; docs/definitions.md, "Logit lens", "Token norms"): checked against
the blocks run by hand and the attention computed from the weights in plain torch."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import VisionTransformer

import vitlens as vl
from vitlens.errors import UnsupportedModelError

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5)


@pytest.fixture(scope="module")
def model() -> VisionTransformer:
    torch.manual_seed(0)
    return VisionTransformer(**SMALL, reg_tokens=2).double().eval()


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    x[0, :, 8:16, 16:24] *= 400  # one patch token of image 0 made huge: an outlier from the embeddings on
    return x


def by_hand(m: VisionTransformer, x: torch.Tensor) -> list[torch.Tensor]:
    """The residual at each depth, the blocks called one by one."""
    z = m.norm_pre(m._pos_embed(m.patch_embed(x)))
    out = [z]
    for blk in m.blocks:
        z = blk(z)
        out.append(z)
    return out


def test_logit_lens_reads_each_depth_and_ends_at_the_output(model: VisionTransformer, pixels: torch.Tensor) -> None:
    r = vl.logit_lens(model, pixels, target=2, top_k=3)
    with torch.no_grad():
        out = model(pixels)[:, 2].numpy()
        depths = by_hand(model, pixels)
        want = np.stack([model.head(model.norm(z)[:, 0])[:, 2].numpy() for z in depths], 1)
        tokens = np.stack([model.head(model.norm(z))[..., 2].numpy() for z in depths], 1)
    np.testing.assert_array_equal(r.pooled[:, -1], out)  # the last depth is the output
    np.testing.assert_allclose(r.pooled, want, rtol=1e-12)
    np.testing.assert_allclose(r.tokens, tokens, rtol=1e-12)
    assert r.pooled.shape == (2, 3) and r.top_classes.shape == (2, 3, 3)
    assert (r.top_logits[:, :, 0] >= r.pooled).all()
    assert len(r.to_rows()) == 6 and "output" in r.summary()


def test_logit_lens_last_depth_on_a_map_model(pixels: torch.Tensor) -> None:
    torch.manual_seed(0)
    m = VisionTransformer(**SMALL, global_pool="map", class_token=False).double().eval()
    r = vl.logit_lens(m, pixels)
    with torch.no_grad():
        np.testing.assert_array_equal(r.pooled[:, -1], m(pixels).max(-1).values.numpy())


def test_token_norms_and_the_attention_outliers_draw(model: VisionTransformer, pixels: torch.Tensor) -> None:
    r = vl.token_norms(model, pixels)
    with torch.no_grad():
        depths = by_hand(model, pixels)
        norms = torch.stack([z.norm(dim=-1) for z in depths], 1).numpy()
        np.testing.assert_allclose(r.norms, norms, rtol=1e-12)
        p = 3  # class token + 2 registers
        token = p + 1 * 4 + 2  # patch row 1, column 2
        assert r.outliers[0, 0, token] and r.first_depth[0, token] == 0
        med = np.median(norms[:, :, p:], axis=-1, keepdims=True)
        np.testing.assert_array_equal(r.outliers[..., p:], norms[..., p:] > r.factor * med)
        assert not r.outliers[..., :p].any()
        blk = model.blocks[0]  # the class token's attention to the outliers in block 1, from the weights
        a_in = F.layer_norm(depths[0], (32,), blk.norm1.weight, blk.norm1.bias, blk.norm1.eps)
        q, k, _ = (a_in @ blk.attn.qkv.weight.T + blk.attn.qkv.bias).split(32, -1)
        q, k = (t.reshape(2, -1, 4, 8).transpose(1, 2) for t in (q, k))
        att = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1).mean(1)  # [B, N, N]
        mask = torch.as_tensor(r.outliers[:, 0], dtype=torch.float64)
        np.testing.assert_allclose(r.class_attention[:, 0], (att[:, 0] * mask).sum(-1).numpy(), rtol=1e-12)
        np.testing.assert_allclose(r.register_attention[:, 0], att[:, 0, 1:3].sum(-1).numpy(), rtol=1e-12)
        np.testing.assert_allclose(r.patch_attention[:, 0], (att[:, p:] * mask[:, None]).sum(-1).mean(-1).numpy(),
                                   rtol=1e-12)
    assert r.class_attention[1, 0] == 0  # image 1 has no outlier in the embeddings
    assert "outlier" in r.summary() and len(r.to_rows()) == 6


def test_lens_and_norms_refuse_a_model_without_one_stream(pixels: torch.Tensor) -> None:
    for fn in (vl.logit_lens, vl.token_norms):
        with pytest.raises(UnsupportedModelError, match="Sequential"):
            fn(torch.nn.Sequential(torch.nn.Flatten()), pixels)


def test_lens_and_norms_figures(model: VisionTransformer, pixels: torch.Tensor) -> None:
    from vitlens import figures

    lens = vl.logit_lens(model, pixels)
    np.testing.assert_allclose(np.asarray(figures.figure_for(lens).data[1].y), lens.pooled[1])
    norms = vl.token_norms(model, pixels)
    np.testing.assert_allclose(np.asarray(figures.figure_for(norms).data[0].z), norms.norms[0])


def test_lens_and_norms_results_save_and_load(model: VisionTransformer, pixels: torch.Tensor, tmp_path) -> None:
    for r in (vl.logit_lens(model, pixels), vl.token_norms(model, pixels)):
        back = vl.load_result(r.save(tmp_path / f"{r.kind}.npz"))
        assert type(back) is type(r) and back.equals(r)
        assert r.to_csv().count(b"\n") == len(r.to_rows()) + 1 and "<table" in r._repr_html_()
