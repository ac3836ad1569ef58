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
# measured over 512 held-out scenes (MODEL_CARD.md): ratio 2.02 / 2.03, above area 100% / 98.4%,
# pointing game 100% / 90%; the floors leave room for the 256-image subset used here
ROLLOUT_FLOORS = {"ref-vit": (1.6, 0.95, 0.95), "ref-hybrid": (1.6, 0.9, 0.8)}


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
    assert accuracy(ref, held_out.images, held_out.labels) >= 0.95  # required: >= 0.90


def test_rollout_mass_falls_on_the_object(ref, held_out):
    scores = rollout_mask_scores(ref, held_out.images[:256], held_out.masks[:256]).summary()
    ratio, above, pointing = ROLLOUT_FLOORS[ref.spec.name]
    assert scores["n"] == 256  # required: >= 200 images
    assert scores["ratio_mean"] > ratio  # required: > 1 (mass share above the object's area share)
    assert scores["share_above_area"] >= above
    assert scores["pointing_game"] >= pointing


def test_vit_position_embeddings_have_2d_structure():
    summary = neighbour_similarity(vl.position_similarity(vl.load_model("ref-vit", device="cpu")))
    assert summary["neighbours"] > summary["far_ge3"] + 0.2
    assert summary["same_row_col_d2"] > summary["off_axis_d2"] + 0.05
    assert summary["same_row_col_d3"] > summary["off_axis_d3"] + 0.04


def test_first_layer_heads_are_not_local_as_the_model_card_reports(ref, held_out):
    """The paper's local low-layer heads do not appear in this small-data pair (Raghu et al. 2021);
    MODEL_CARD.md reports it and vitlens must show it: every layer-1 head near uniform attention."""
    d = vl.attention_distance(ref, held_out.images[:128], batch_size=128)
    uniform = float(token_distance_matrix((8, 8), (8, 8)).mean())
    assert np.all(d.mean_px[0] > 0.85 * uniform)


def test_embedding_filter_pca_reports_its_source(ref):
    r = vl.embedding_filter_pca(ref, n_components=20)
    assert ("patch embedding E" in r.source) == (ref.spec.kind == "vit")
    assert 0 < r.explained_variance_ratio.sum() <= 1
