"""The committed reference pair shows what MODEL_CARD.md says it shows, measured with vitlens on
held-out scenes (stream ``HELD_OUT_SEED``, never used in training). Margins sit below the
measured values; the issue's requirements are the floors in the comments."""
from __future__ import annotations

import numpy as np
import pytest

import vitlens as vl
from vitlens.attribution.evaluation import accuracy, rollout_mask_scores
from vitlens.reference.shapes import CLASSES, HELD_OUT_SEED, generate
from vitlens.views.distance import token_distance_matrix
from vitlens.views.position import neighbour_similarity

NAMES = ["ref-vit", "ref-hybrid"]
# measured on the 256 scenes used here (MODEL_CARD.md gives 512): mass ratio 1.74 / 4.83, above area
# 93.0% / 100%, pointing game 86.7% / 100%; the floor is a ratio of 1.5
ROLLOUT_FLOORS = {"ref-vit": (1.55, 0.88, 0.8), "ref-hybrid": (3.5, 0.97, 0.95)}
# held-out accuracy over 512 scenes: 94.3% / 100% (2,048 scenes: 94.5% / 100%); required >= 93%
ACCURACY_FLOORS = {"ref-vit": 0.93, "ref-hybrid": 0.98}


@pytest.fixture(scope="module")
def held_out():
    return generate(512, seed=HELD_OUT_SEED)


@pytest.fixture(scope="module", params=NAMES)
def ref(request):
    return vl.load_model(request.param, device="cpu")


def test_reference_models_load_offline_with_their_spec(ref):
    s = ref.spec
    assert (s.grid, s.stride_px, s.image_size, s.num_layers, s.num_heads, s.embed_dim) == (
        (8, 8), (8, 8), (64, 64), 6, 8, 128)
    assert s.kind == ("vit" if s.name == "ref-vit" else "hybrid")
    assert ref.label_names() == list(CLASSES)
    assert ref.source.endswith(f"{s.name}.safetensors")


def test_held_out_accuracy(ref, held_out):
    assert accuracy(ref, held_out.images, held_out.labels) >= ACCURACY_FLOORS[ref.spec.name]


def test_rollout_mass_falls_on_the_object(ref, held_out):
    scores = rollout_mask_scores(ref, held_out.images[:256], held_out.masks[:256]).summary()
    ratio, above, pointing = ROLLOUT_FLOORS[ref.spec.name]
    assert scores["n"] == 256  # required: >= 200 images
    assert scores["ratio_mean"] > ratio  # required: >= 1.5 (mass share 1.5x the object's area share)
    assert scores["share_above_area"] >= above
    assert scores["pointing_game"] >= pointing


def test_vit_position_embeddings_have_2d_structure():
    summary = neighbour_similarity(vl.position_similarity(vl.load_model("ref-vit", device="cpu")))
    assert summary["neighbours"] > summary["far_ge3"] + 0.4  # measured 0.94 vs 0.41; required: + 0.1
    assert summary["same_row_col_d2"] > summary["off_axis_d2"] + 0.03  # 0.823 vs 0.767
    assert summary["same_row_col_d3"] > summary["off_axis_d3"] + 0.03  # 0.689 vs 0.635


@pytest.fixture(scope="module")
def distances(held_out):
    return {n: vl.attention_distance(vl.load_model(n, device="cpu"), held_out.images[:128], batch_size=128)
            for n in NAMES}


def test_vit_has_local_first_layer_heads_and_distance_rises_with_depth(distances):
    """Paper Fig. 7 (right), offline: measured on these 128 scenes, ref-vit's layer-1 heads sit at
    15.0-25.6 px (0.45-0.77x the uniform 33.1 px; 6 of 8 at <= 0.6x) and the layer medians rise
    18.1, 26.9, 32.0, 31.3, 30.8, 31.8 px (last / first 1.76)."""
    d = distances["ref-vit"]
    uniform = float(token_distance_matrix((8, 8), (8, 8)).mean())
    assert d.uniform_px == pytest.approx(uniform)
    assert int((d.mean_px[0] <= 0.6 * uniform).sum()) >= 4  # required: >= 2
    medians = np.median(d.mean_px, axis=1)
    assert medians[-1] >= 1.5 * medians[0]  # required: >= 1.3
    assert np.all(d.mean_px[0] < 0.85 * uniform)  # no global head in layer 1 (MODEL_CARD.md says so)


def test_hybrid_first_layer_attends_farther_than_the_vits(distances):
    """Paper Fig. 11, offline: the hybrid trained alike (same sin-cos start, masked-patch phase and
    steps) leaves local work to its CNN: layer-1 median 27.3 px against the ViT's 18.1 (1.51x)."""
    vit, hybrid = (np.median(distances[n].mean_px[0]) for n in NAMES)
    assert hybrid >= 1.35 * vit  # required: >= 1.15
    assert int((distances["ref-hybrid"].mean_px[0] <= 0.6 * distances["ref-hybrid"].uniform_px).sum()) == 0


def test_compare_reads_fig_11s_contrast_for_the_pair(distances):
    from vitlens.report.data import comparison

    reading = comparison([distances["ref-vit"], distances["ref-hybrid"]], NAMES).reading()
    assert reading.startswith("Fig. 11's contrast: ref-hybrid's layer-1 heads attend 1.5"), reading


def test_embedding_filter_pca_reports_its_source(ref):
    r = vl.embedding_filter_pca(ref, n_components=20)
    assert ("patch embedding E" in r.source) == (ref.spec.kind == "vit")
    assert 0 < r.explained_variance_ratio.sum() <= 1
