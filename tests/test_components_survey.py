"""The survey's ``components`` statistic (issue 51): each head's part of the predicted-class logit and the ledger's
residual, summed per shard and merged; the merged mean equals the mean over all images in one process (to float64
summation's bound), whatever the shards; in-process (a Ray survey would start worker processes for the same
``run_shard``)."""
from __future__ import annotations

import numpy as np
import pytest

import vitlens as vl
from vitlens.survey import shapes_source
from vitlens.survey.components import HeadContributions
from vitlens.survey.sources import Shard
from vitlens.survey.stats import DEFAULT_SURVEY_VIEW_NAMES, SURVEY_VIEW_NAMES, flatten, merge, read_state, unflatten
from vitlens.survey.store import table_rows
from vitlens.survey.worker import run_shard

N = 6


@pytest.fixture(scope="module")
def setting():
    m = vl.load_model("ref-vit")
    source = shapes_source(N)
    images = source.read(Shard(0, 0, N))[0]
    return m, source, images


def summation_bound(values: np.ndarray) -> np.ndarray:
    """The rounding bound of two float64 summation orders of ``values`` [n, ...]: 2 n eps sum |x_i|, per entry."""
    return 2 * len(values) * np.finfo(np.float64).eps * np.abs(values).sum(0)


def test_merged_shards_give_the_mean_over_all_images_in_one_process(setting) -> None:
    m, source, images = setting
    # one process over every image; a batch of one throughout, so that each image's parts are the same
    # computation here and in the shards (a float32 forward's rounding may depend on the batch it runs in)
    each = [vl.decompose(m, [image]) for image in images]
    per_image = np.concatenate([d.heads.sum(-1) for d in each])  # [N, L, H]
    output = np.concatenate([d.output for d in each])
    residual = output - np.concatenate([d.total() for d in each])
    ledger = np.concatenate([d.ledger() for d in each])
    shards = [run_shard(m, source, Shard(i, a, b), ("components",), batch_size=1)
              for i, (a, b) in enumerate(((0, 2), (2, 3), (3, N)))]
    assert [s["n_images"] for s in shards] == [2, 1, 3]
    states = [unflatten(flatten(s["states"])) for s in shards]  # as the shard files hold them
    merged_ab = merge(merge(states[0], states[1]), states[2])
    merged_ba = merge(states[2], merge(states[1], states[0]))
    for merged in (merged_ab, merged_ba):
        kept = read_state("components", merged["components"])
        assert isinstance(kept, HeadContributions) and int(kept.n) == N
        assert np.all(np.abs(kept.mean() - per_image.mean(0)) <= summation_bound(per_image) / N)
        assert abs(float(kept.residual) - residual.sum()) <= summation_bound(residual[:, None])[0]
        assert abs(float(kept.output) - output.sum()) <= summation_bound(output[:, None])[0]
        assert float(kept.ledger_max) == ledger.max() <= 1e-5  # max merges exactly
    rows = table_rows("ref-vit", {}, merged_ab, N, [], {})
    mean = {(r["layer"], r["head"]): r["value"] for r in rows if r["metric"] == "head_contribution"}
    assert len(mean) == per_image.shape[1] * per_image.shape[2]
    assert mean[(2, 4)] == float(read_state("components", merged_ab["components"]).mean()[1, 3])
    assert {"ledger_residual", "ledger_max", "mlp_contribution", "head_contribution_std"} <= {r["metric"] for r in rows}


def test_components_is_offered_by_name_and_not_kept_by_default() -> None:
    from vitlens.cli import build_parser

    assert "components" in SURVEY_VIEW_NAMES and "components" not in DEFAULT_SURVEY_VIEW_NAMES
    assert DEFAULT_SURVEY_VIEW_NAMES == ("distance", "rollout", "predictions", "weights")
    assert build_parser().parse_args(["survey", "--models", "ref-vit", "--out", "x", "--views", "components"]).views \
        == ["components"]


def test_a_refused_model_keeps_no_components_and_shards_of_two_models_do_not_merge(setting) -> None:
    from test_mvit_app import NAME, _register

    _, source, images = setting
    _register()
    mvit = vl.load_model(NAME, pretrained=False)
    assert "components" not in run_shard(mvit, source, Shard(0, 0, 2), ("components",), 2)["states"]
    with pytest.raises(vl.InvalidParameterError, match="do not merge"):
        HeadContributions(6, 8).merge(HeadContributions(2, 4))
