"""Position-embedding similarity (Fig. 7 centre) and embedding-filter PCA (Fig. 7 left):
hand-built embeddings and filters with known answers, and independent numpy computations."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.views.position import PositionSimilarityResult
from conftest import get_model
from vitlens.views.position import neighbour_similarity


def small_vit(**kwargs):
    """A 2x2-patch ViT (32 px, 16 px patches, D=4) whose weights the tests set by hand."""
    from timm.models.vision_transformer import VisionTransformer

    model = VisionTransformer(img_size=32, patch_size=16, embed_dim=4, depth=1, num_heads=1, num_classes=3, **kwargs)
    return vl.LoadedModel.from_module(model, name="hand-built", device="cpu", source="test")


def test_hand_built_position_embeddings_give_known_cosines_and_drop_the_prefix_row():
    m = small_vit()
    with torch.no_grad():
        m.model.pos_embed[0] = torch.tensor([
            [100.0, -3.0, 7.0, 1.0],  # class token: must not appear anywhere
            [1.0, 0.0, 0.0, 0.0],  # patch (0, 0)
            [0.0, 2.0, 0.0, 0.0],  # patch (0, 1)
            [1.0, 1.0, 0.0, 0.0],  # patch (1, 0)
            [-3.0, 0.0, 0.0, 0.0],  # patch (1, 1)
        ])
    r = vl.position_similarity(m)
    s = 1 / np.sqrt(2)
    expected = np.array([[1, 0, s, -1], [0, 1, s, 0], [s, s, 1, -s], [-1, 0, -s, 1]])
    np.testing.assert_allclose(r.similarity.reshape(4, 4), expected, atol=1e-7)
    assert r.similarity.shape == (2, 2, 2, 2) and r.grid == (2, 2) and not r.resized


def test_no_embed_class_rows_are_all_patch_rows():
    m = get_model("vit_small_patch14_reg4_dinov2", img_size=112)
    assert m.spec.pos_embed_prefix == 0 and m.spec.num_prefix_tokens == 5
    pos = m.model.pos_embed[0].double().numpy()
    unit = pos / np.linalg.norm(pos, axis=1, keepdims=True)
    np.testing.assert_allclose(vl.position_similarity(m).similarity.reshape(64, 64), unit @ unit.T, atol=1e-10)


def test_distilled_model_drops_both_prefix_rows():
    m = get_model("deit_tiny_distilled_patch16_224")
    pos = m.model.pos_embed[0, 2:].double().numpy()
    unit = pos / np.linalg.norm(pos, axis=1, keepdims=True)
    np.testing.assert_allclose(vl.position_similarity(m).similarity.reshape(196, 196), unit @ unit.T, atol=1e-10)


def test_resized_grid_compares_bicubically_resampled_embeddings(tiny):
    import torch.nn.functional as F

    r = vl.position_similarity(tiny, grid=(7, 10))
    assert r.similarity.shape == (7, 10, 7, 10) and r.resized and r.model_grid == (14, 14)
    grid = tiny.model.pos_embed[0, 1:].float().reshape(1, 14, 14, -1).permute(0, 3, 1, 2)
    resized = F.interpolate(grid, size=(7, 10), mode="bicubic", antialias=True, align_corners=False)
    rows = resized[0].permute(1, 2, 0).reshape(70, -1).double().numpy()
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    np.testing.assert_allclose(r.similarity.reshape(70, 70), unit @ unit.T, atol=1e-6)
    same = vl.position_similarity(tiny, grid=(14, 14))
    assert not same.resized and same.equals(vl.position_similarity(tiny))


def test_model_without_learned_position_embedding_is_not_available():
    m = get_model("vit_tiny_patch16_224", pos_embed="none")
    with pytest.raises(vl.ViewNotAvailableError, match="not available for"):
        vl.position_similarity(m)
    assert not m.spec.has_pos_embed


def test_neighbour_summary_on_a_known_structure():
    # similarity = exp(-city-block distance): neighbours e^-1; (0,2) e^-2 against (1,2) e^-3;
    # (0,3) e^-3 against (2,2) e^-4 and (1,3) e^-4
    rr, cc = np.divmod(np.arange(25), 5)
    d = np.abs(rr[:, None] - rr[None]) + np.abs(cc[:, None] - cc[None])
    res = PositionSimilarityResult(similarity=np.exp(-d).reshape(5, 5, 5, 5), grid=(5, 5), model_grid=(5, 5),
                                      resized=False)
    summary = neighbour_similarity(res)
    assert summary["neighbours"] == pytest.approx(np.exp(-1))
    assert summary["same_row_col_d2"] == pytest.approx(np.exp(-2))
    assert summary["off_axis_d2"] == pytest.approx(np.exp(-3))
    assert summary["same_row_col_d3"] == pytest.approx(np.exp(-3))
    assert summary["off_axis_d3"] == pytest.approx(np.exp(-4))
    assert summary["far_ge3"] < summary["same_row_col_d2"]


def test_filter_pca_of_rank_one_filters_finds_that_filter():
    m = small_vit()
    pattern = torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m.model.patch_embed.proj.weight.copy_(torch.tensor([1.0, -2.0, 0.5, 3.0]).view(4, 1, 1, 1) * pattern)
    r = vl.embedding_filter_pca(m, n_components=1)
    unit = (pattern / pattern.norm()).double().numpy()
    # the filters are stored in float32, so rank one holds to float32 rounding
    assert abs(float((r.components[0] * unit).sum())) == pytest.approx(1.0, abs=1e-6)
    assert r.explained_variance_ratio[0] == pytest.approx(1.0, abs=1e-6)
    assert r.module == "patch_embed.proj"


def test_filter_pca_matches_numpy_svd(tiny):
    r = vl.embedding_filter_pca(tiny, n_components=28)
    x = tiny.model.patch_embed.proj.weight.detach().double().reshape(192, -1).numpy()
    xc = x - x.mean(0)
    _, s, vt = np.linalg.svd(xc, full_matrices=False)
    assert r.components.shape == (28, 3, 16, 16)
    for i in range(28):
        assert abs(float(r.components[i].ravel() @ vt[i])) == pytest.approx(1.0, abs=1e-8)
    np.testing.assert_allclose(r.explained_variance_ratio, (s**2 / (s**2).sum())[:28], rtol=1e-9)


def test_hybrid_filters_come_from_the_weight_standardised_stem_conv():
    m = get_model("vit_tiny_r_s16_p8_224")
    r = vl.embedding_filter_pca(m, n_components=5)
    assert "first convolution" in r.source and r.module == "patch_embed.backbone.conv"
    assert r.components.shape == (5, 3, 7, 7)
    conv = m.model.patch_embed.backbone.conv
    w = conv.weight.detach().double().reshape(64, -1).numpy()
    w = (w - w.mean(1, keepdims=True)) / np.sqrt(w.var(1, keepdims=True) + conv.eps)
    _, s, vt = np.linalg.svd(w - w.mean(0), full_matrices=False)
    for i in range(5):
        assert abs(float(r.components[i].ravel() @ vt[i])) == pytest.approx(1.0, abs=1e-8)


def test_too_many_components_names_the_limit():
    m = get_model("vit_tiny_r_s16_p8_224")
    with pytest.raises(vl.InvalidParameterError, match="between 1 and 64"):
        vl.embedding_filter_pca(m, n_components=65)



def test_filter_pca_of_two_orthogonal_patterns_explains_9_to_1():
    """Filters a_i u + b_i v with orthonormal u, v and centred a = (3, -3, 3, -3), b = (1, 1, -1, -1):
    the components are u and v (up to sign), explaining 9/10 and 1/10 of the variance."""
    m = small_vit()
    g = torch.Generator().manual_seed(1)
    basis, _ = torch.linalg.qr(torch.randn(3 * 16 * 16, 2, generator=g, dtype=torch.float64))
    u, v = basis[:, 0], basis[:, 1]
    a = torch.tensor([3.0, -3.0, 3.0, -3.0], dtype=torch.float64)
    b = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    with torch.no_grad():
        m.model.patch_embed.proj.weight.copy_((a[:, None] * u + b[:, None] * v).view(4, 3, 16, 16))
    r = vl.embedding_filter_pca(m, n_components=2)
    np.testing.assert_allclose(r.explained_variance_ratio, [0.9, 0.1], atol=1e-6)
    assert abs(float(r.components[0].ravel() @ u.numpy())) == pytest.approx(1.0, abs=1e-6)
    assert abs(float(r.components[1].ravel() @ v.numpy())) == pytest.approx(1.0, abs=1e-6)
