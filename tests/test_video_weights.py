"""The weight views of video ViTs (issue 50; docs/definitions.md "Video: weights"): position similarity over
space and time and the tubelet-filter PCA, on small random-init Hugging Face models, against hand-built tables and
filters with known answers and independent numpy computations."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.errors import InvalidParameterError, UnsupportedModelError, ViewNotAvailableError

transformers = pytest.importorskip("transformers")
SMALL = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def models():
    t = transformers
    torch.manual_seed(0)
    return {
        "vivit": t.VivitModel(t.VivitConfig(image_size=32, num_frames=4, tubelet_size=[2, 8, 8], **SMALL)).eval(),
        "timesformer": t.TimesformerModel(t.TimesformerConfig(image_size=32, patch_size=8, num_frames=4,
                                                              **SMALL)).eval(),
        "videomae": t.VideoMAEModel(t.VideoMAEConfig(image_size=32, patch_size=8, num_frames=4, tubelet_size=2,
                                                     **SMALL)).eval(),
        "vjepa2": t.VJEPA2Model(t.VJEPA2Config(crop_size=32, patch_size=8, frames_per_clip=4, tubelet_size=2,
                                               hidden_size=32, num_hidden_layers=1, num_attention_heads=2, mlp_ratio=2,
                                               pred_hidden_size=32, pred_num_hidden_layers=1,
                                               pred_num_attention_heads=2)).eval(),
    }


def cosines(x: np.ndarray) -> np.ndarray:
    """Independent cosine matrix of rows, by loops over pairs."""
    n = len(x)
    out = np.empty((n, n))
    for i in range(n):
        for j in range(n):
            out[i, j] = x[i] @ x[j] / (np.linalg.norm(x[i]) * np.linalg.norm(x[j]))
    return out


def test_a_kronecker_table_factorises_into_its_time_and_space_cosines(models):
    # E[t, p] = a_t (x) b_p: cos(E[t, p], E[t2, p2]) = cos(a_t, a_t2) cos(b_p, b_p2), so time = cos(a), space = cos(b)
    m = models["vivit"]
    rng = np.random.default_rng(0)
    a = np.array([[1.0, 0.0], [0.0, 2.0]])  # two orthogonal time steps (powers of two: exact in float32)
    b = rng.normal(size=(16, 16)).astype(np.float32).astype(np.float64)  # 4x4 cells, as the float32 table holds
    table = np.einsum("ti,pj->tpij", a, b).reshape(32, 32)
    with torch.no_grad():
        m.embeddings.position_embeddings[0, 0] = 100.0  # the class row: must not count
        m.embeddings.position_embeddings[0, 1:] = torch.from_numpy(table)
    r = vl.video_position_similarity(m)
    np.testing.assert_allclose(r.time, np.eye(2), rtol=0, atol=1e-12)
    np.testing.assert_allclose(r.space.reshape(16, 16), cosines(b), rtol=0, atol=1e-12)
    assert r.table == "joint" and not r.sinusoidal and r.frames_per_step == 2 and r.space.shape == (4, 4, 4, 4)
    assert r.joint.shape == (2, 4, 4, 2, 4, 4)


def test_a_joint_table_against_an_independent_computation(models):
    m = models["vivit"]
    table = np.random.default_rng(1).normal(size=(32, 32)).astype(np.float32).astype(np.float64)  # as stored
    with torch.no_grad():
        m.embeddings.position_embeddings[0, 1:] = torch.from_numpy(table)
    r = vl.video_position_similarity(m)
    full = cosines(table)  # rows in (t, r, c) order
    np.testing.assert_allclose(r.joint.reshape(32, 32), full, rtol=0, atol=1e-12)
    time = np.array([[np.mean([full[t * 16 + p, t2 * 16 + p] for p in range(16)]) for t2 in range(2)]
                     for t in range(2)])
    space = np.mean([full[t * 16:(t + 1) * 16, t * 16:(t + 1) * 16] for t in range(2)], axis=0)
    np.testing.assert_allclose(r.time, time, rtol=0, atol=1e-12)
    np.testing.assert_allclose(r.space.reshape(16, 16), space, rtol=0, atol=1e-12)
    with torch.no_grad():  # the same table on every time step: time similarity 1 everywhere
        m.embeddings.position_embeddings[0, 17:] = m.embeddings.position_embeddings[0, 1:17]
    np.testing.assert_allclose(vl.video_position_similarity(m).time, 1.0, rtol=0, atol=1e-12)


def test_timesformer_reads_its_two_tables_each_on_its_own(models):
    m = models["timesformer"]
    time = np.zeros((4, 32))  # orthogonal time rows (disjoint supports, exact in float32)
    for t in range(4):
        time[t, 8 * t:8 * t + 8] = np.random.default_rng(t).normal(size=8).astype(np.float32)
    with torch.no_grad():
        m.embeddings.time_embeddings[0] = torch.from_numpy(time)
    r = vl.video_position_similarity(m)
    np.testing.assert_allclose(r.time, np.eye(4), rtol=0, atol=1e-12)
    spatial = m.embeddings.position_embeddings[0, 1:].detach().double().numpy()
    np.testing.assert_allclose(r.space.reshape(16, 16), cosines(spatial), rtol=0, atol=1e-12)
    assert r.table == "separate" and r.joint is None and r.frames_per_step == 1
    only = transformers.TimesformerModel(transformers.TimesformerConfig(
        image_size=32, patch_size=8, num_frames=4, attention_type="space_only", **SMALL))
    r = vl.video_position_similarity(only)
    assert r.time is None and "no time table" in r.summary()


def test_videomae_sinusoid_is_computed_and_flagged(models):
    r = vl.video_position_similarity(models["videomae"])
    assert r.sinusoidal and r.table == "joint sinusoidal" and "not learned" in r.summary()
    n, d = 32, 32  # the 1-D sin-cos code of the token index, independently
    angles = np.arange(n)[:, None] / np.power(10000, 2 * (np.arange(d) // 2) / d)[None, :]
    code = np.where(np.arange(d) % 2 == 0, np.sin(angles), np.cos(angles))
    # the model keeps its table in float32: the cosines agree to float32's rounding of the table
    np.testing.assert_allclose(r.joint.reshape(n, n), cosines(code), rtol=0, atol=1e-6)


def test_vjepa2_has_no_table_and_says_so_in_one_line(models):
    with pytest.raises(ViewNotAvailableError) as e:
        vl.video_position_similarity(models["vjepa2"])
    text = str(e.value)
    assert "VJEPA2Model" in text and "rotary" in text and "\n" not in text


def test_filters_differing_only_in_time_step_k_put_component_one_there(models):
    m = models["videomae"]
    rng = np.random.default_rng(3)
    base = rng.normal(size=(3, 2, 8, 8))
    w = np.repeat(base[None], 32, axis=0)
    w[:, :, 1] += rng.normal(size=(32, 1, 1, 1)) * rng.normal(size=(3, 8, 8))  # one direction, slice 1 only
    with torch.no_grad():
        m.embeddings.patch_embeddings.projection.weight.copy_(torch.from_numpy(w))
    r = vl.video_filter_pca(m, n_components=1)
    assert r.components.shape == (1, 2, 3, 8, 8)
    # float32 weights: the quiet slice is the filters' float32 rounding, squared
    np.testing.assert_allclose(r.time_energy[0], [0.0, 1.0], rtol=0, atol=1e-10)
    np.testing.assert_allclose(r.explained_variance_ratio, [1.0], rtol=0, atol=1e-10)


def test_filter_pca_against_numpy_svd(models):
    m = models["vjepa2"]
    r = vl.video_filter_pca(m, n_components=5)
    w = m.encoder.embeddings.patch_embeddings.proj.weight.detach().double().numpy()  # [D, C, t, p, p]
    x = w.transpose(0, 2, 1, 3, 4).reshape(32, -1)
    x = x - x.mean(0)
    _, s, vt = np.linalg.svd(x, full_matrices=False)
    for i in range(5):
        got = r.components[i].reshape(-1)
        assert abs(abs(got @ vt[i]) - 1.0) < 1e-8
    np.testing.assert_allclose(r.explained_variance_ratio, (s**2 / (s**2).sum())[:5], rtol=1e-8, atol=0)
    np.testing.assert_allclose(r.time_energy.sum(1), 1.0, rtol=0, atol=1e-12)
    assert r.module == "encoder.embeddings.patch_embeddings.proj" and r.n_filters == 32


def test_a_per_frame_embedding_is_one_time_step(models):
    r = vl.video_filter_pca(models["timesformer"], n_components=3)
    assert r.components.shape == (3, 1, 3, 8, 8) and np.all(r.time_energy == 1.0)
    with pytest.raises(InvalidParameterError):
        vl.video_filter_pca(models["timesformer"], n_components=33)


def test_other_models_are_refused_and_results_round_trip(models, tmp_path):
    vit = transformers.ViTModel(transformers.ViTConfig(image_size=32, patch_size=8, **SMALL))
    with pytest.raises(UnsupportedModelError) as e:
        vl.video_filter_pca(vit)
    assert "not a video model" in str(e.value)
    r = vl.video_position_similarity(models["vivit"])
    back = vl.load_result(r.save(tmp_path / "p.npz"))
    np.testing.assert_array_equal(back.space, r.space)
    np.testing.assert_array_equal(back.joint, r.joint)
    f = vl.video_filter_pca(models["vivit"], n_components=2)
    back = vl.load_result(f.save(tmp_path / "f.npz"))
    np.testing.assert_array_equal(back.components, f.components)
    assert len(f.to_rows()) == 2 and len(r.to_rows()) == 4 + 256


def test_the_figures_draw_every_panel(models):
    from vitlens import figures

    r = vl.video_position_similarity(models["vivit"])
    fig = figures.figure_for(r)
    assert len(fig.data) == 2 and fig.data[0].z.shape == (2, 2) and "learned, joint table" in fig.layout.title.text
    only = transformers.TimesformerModel(transformers.TimesformerConfig(
        image_size=32, patch_size=8, num_frames=4, attention_type="space_only", **SMALL))
    assert len(figures.video_position_figure(vl.video_position_similarity(only)).data) == 1  # no time panel
    f = vl.video_filter_pca(models["vivit"], n_components=3)
    fig = figures.figure_for(f)
    assert len(fig.data) == 3 * 2 and fig.data[0].z.shape == (8, 8, 3)
    # a component's slices are scaled together: the two slices' pixels span 0..255 between them
    both = np.concatenate([fig.data[0].z, fig.data[1].z], axis=1)
    assert both.min() == 0 and both.max() == 255
