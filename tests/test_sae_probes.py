"""Linear probes per layer (issue 66, item 7): on the reference ViT, whose classifier reads the shapes, the probe at
the last block reads the class far above chance; the accuracies are those of scikit-learn fitted on the same
features by hand; the figure draws them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from vitlens.errors import InvalidParameterError


@pytest.fixture(scope="module")
def shapes(ref_vit):
    from vitlens.reference.shapes import generate

    b = generate(96, seed=0)
    return ref_vit.preprocess(list(b.images)), b.labels


def test_the_last_blocks_probe_reads_the_class_far_above_chance(ref_vit, shapes):
    from vitlens.figures import figure_for
    from vitlens.sae.probes import linear_probes

    x, y = shapes
    r = linear_probes(ref_vit, x, y, test_fraction=0.25)
    assert list(r.blocks) == list(range(6)) and r.n_test == 24 and r.n_train == 72
    assert r.class_token_accuracy[-1] > r.chance + 0.4 and r.mean_patch_accuracy[-1] > r.chance + 0.3
    fig = figure_for(r)
    assert np.allclose(np.asarray(fig.data[0].y), r.mean_patch_accuracy)
    assert np.allclose(np.asarray(fig.data[1].y), r.class_token_accuracy)
    assert "held-out" in repr(r) and len(r.to_pandas()) == 6


def test_a_probe_is_scikit_learns_fit_on_the_blocks_class_token(ref_vit, shapes):
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from vitlens.sae.probes import held_out_split, linear_probes

    x, y = shapes
    r = linear_probes(ref_vit, x, y, blocks=[2], seed=3)
    with torch.no_grad():
        feats = ref_vit.model.blocks[:3](ref_vit.model._pos_embed(ref_vit.model.patch_embed(x)))[:, 0].double()
    train, test = held_out_split(y, 0.25, 3)
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000, random_state=3))
    probe.fit(feats[train].numpy(), y[train])
    assert r.class_token_accuracy[0] == pytest.approx((probe.predict(feats[test].numpy()) == y[test]).mean())


@pytest.mark.parametrize("kwargs, words", [
    ({"labels": np.zeros(96)}, "at least two classes"),
    ({"labels": np.arange(5)}, "one class per image (96 images)"),
    ({"blocks": [6]}, "from 0 to 5"),
    ({"test_fraction": 1.0}, "test_fraction"),
])
def test_bad_probe_arguments_are_refused_by_name(ref_vit, shapes, kwargs, words):
    from vitlens.sae.probes import linear_probes

    x, y = shapes
    with pytest.raises(InvalidParameterError) as e:
        linear_probes(ref_vit, x, **{"labels": y, **kwargs})
    assert words in str(e.value)
