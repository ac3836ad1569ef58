"""Sanity checks (Adebayo et al. 2018): a map of the input alone survives the cascade unchanged, saliency does
not, the similarities equal scipy's Spearman and SSIM's formula, and the user's model is never changed."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from conftest import get_model
from vitlens.attribution import METHOD_TABLE, Method, sanity
from vitlens.attribution.sanity import (
    normalise_abs, parameter_groups, randomise_, sanity_check, sanity_table, spearman_rows, ssim_maps)


def input_only_map(m, x, t, grid, params, score):
    """An 'edge detector': each token's mean absolute horizontal pixel difference; the weights play no part."""
    edges = (x[..., :, 1:] - x[..., :, :-1]).abs().sum(1)
    edges = torch.nn.functional.pad(edges, (0, 1))
    b, h, w = edges.shape
    gh, gw = grid
    maps = edges.reshape(b, gh, h // gh, gw, w // gw).mean(dim=(2, 4)).double().cpu().numpy()
    return maps, t.cpu().numpy()


@pytest.fixture(scope="module")
def ref_vit():
    return vl.load_model("ref-vit", device="cpu")


def scenes(n: int = 4) -> list:
    from vitlens.reference.shapes import HELD_OUT_SEED, generate

    return list(generate(n, seed=HELD_OUT_SEED).images)


def test_spearman_equals_scipy_and_handles_ties_and_constants():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 30)), rng.normal(size=(5, 30))
    b[1] = a[1] ** 3  # monotone: 1
    b[2] = -a[2]  # reversed: -1
    a[3, :10] = 0.0  # ties
    got = spearman_rows(a, b)
    want = [spearmanr(x, y).statistic for x, y in zip(a, b)]
    np.testing.assert_allclose(got, want, rtol=1e-12)
    assert got[1] == pytest.approx(1.0) and got[2] == pytest.approx(-1.0)
    assert np.isnan(spearman_rows(np.ones((1, 4)), rng.normal(size=(1, 4))))[0]


def test_ssim_equals_the_formula_on_one_7x7_window_after_adebayos_normalisation():
    """With 7x7 maps and a 7x7 window, skimage keeps one window: SSIM = (2 mx my + C1)(2 sxy + C2) /
    ((mx^2 + my^2 + C1)(sx^2 + sy^2 + C2)) with sample (n - 1) moments, C1 = 0.01^2, C2 = 0.03^2 (data range 1)."""
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=(3, 7, 7)), rng.normal(size=(3, 7, 7))
    b[0] = -2 * a[0]  # same |map| up to scale: normalised equal, SSIM 1
    na, nb = normalise_abs(a), normalise_abs(b)
    for x, n in zip(a, na):
        p99 = np.percentile(np.abs(x), 99)
        np.testing.assert_allclose(n, np.clip(np.abs(x) / p99, 0, 1))
    want = []
    for x, y in zip(na.reshape(3, -1), nb.reshape(3, -1)):
        mx, my = x.mean(), y.mean()
        vx, vy, cxy = x.var(ddof=1), y.var(ddof=1), np.cov(x, y, ddof=1)[0, 1]
        c1, c2 = 0.01 ** 2, 0.03 ** 2
        want.append((2 * mx * my + c1) * (2 * cxy + c2) / ((mx ** 2 + my ** 2 + c1) * (vx + vy + c2)))
    np.testing.assert_allclose(ssim_maps(a, b), want, rtol=1e-10)
    assert ssim_maps(a, b)[0] == pytest.approx(1.0)
    with pytest.raises(vl.InvalidParameterError, match="3x3"):
        ssim_maps(a[:, :2, :2], b[:, :2, :2])


def test_the_cascade_covers_every_parameter_once_top_down(ref_vit):
    groups = parameter_groups(ref_vit)
    assert [g for g, _ in groups] == ["head", *[f"blocks.{i}" for i in range(5, -1, -1)], "embedding"]
    assert groups[0][1] == ["norm.weight", "norm.bias", "head.weight", "head.bias"]
    assert groups[-1][1] == ["cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias"]
    names = [n for _, ps in groups for n in ps]
    assert sorted(names) == sorted(n for n, _ in ref_vit.model.named_parameters()) and len(set(names)) == len(names)
    hybrid = vl.load_model("ref-hybrid", device="cpu")
    assert any(n.startswith("patch_embed.backbone.") for n in parameter_groups(hybrid)[-1][1])


def test_randomise_keeps_each_tensors_mean_and_std_and_is_seeded():
    lin = torch.nn.Linear(200, 100).requires_grad_(False)
    with torch.no_grad():
        lin.weight.normal_(0.3, 0.05, generator=torch.Generator().manual_seed(0))
        lin.bias.fill_(0.25)  # constant: no structure, stays
    before = lin.weight.clone()
    randomise_(lin, ["weight", "bias"], torch.Generator().manual_seed(7))
    w = lin.weight.detach().double()
    before = before.detach()
    # the draw's sample mean and std scatter by 0.05 / sqrt(20000) ~ 3.5e-4 and ~0.5%: 5 sigma
    assert float(w.mean()) == pytest.approx(float(before.double().mean()), abs=1.8e-3)
    assert float(w.std()) == pytest.approx(float(before.double().std()), rel=0.025)
    assert abs(float(np.corrcoef(w.flatten(), before.double().flatten())[0, 1])) < 0.02  # a fresh draw
    assert torch.all(lin.bias == 0.25)
    again = torch.nn.Linear(200, 100)
    with torch.no_grad():
        again.weight.copy_(before)
    randomise_(again, ["weight"], torch.Generator().manual_seed(7))
    assert torch.equal(again.weight, lin.weight)


def test_a_map_of_the_input_alone_barely_changes(ref_vit, monkeypatch):
    monkeypatch.setitem(METHOD_TABLE, "input_edges", Method("input_edges", input_only_map))
    r = sanity_check(ref_vit, scenes(3), method="input_edges")
    np.testing.assert_allclose(r.spearman_abs, 1.0)
    np.testing.assert_allclose(r.spearman, 1.0)
    np.testing.assert_allclose(r.ssim, 1.0)
    assert r.verdict().startswith("input_edges: barely changes") and ">= 0.5" in r.verdict()
    assert r.maps.shape == (len(r.steps) + 1, 3, 8, 8)


def test_saliency_decorrelates_at_the_bottom_of_ref_vit_and_the_users_model_is_unchanged(ref_vit, tmp_path):
    state = {k: v.clone() for k, v in ref_vit.model.state_dict().items()}
    x = scenes(4)
    r = sanity_check(ref_vit, x, method="saliency", seed=1)
    assert all(torch.equal(v, state[k]) for k, v in ref_vit.model.state_dict().items())
    assert np.all(r.targets == vl.attribute(ref_vit, x, method="saliency").targets)  # targets fixed to the original's
    # on ref-vit saliency keeps 0.75-0.77 after the head and the top blocks: it survives them (issue 45, item 2)
    first = r.first_decorrelated()
    assert r.final()["spearman_abs"] < 0.5 and first is not None and first >= 1
    assert r.verdict_word() == sanity.verdict_of(r.step_means(), r.steps)
    assert r.verdict_word().startswith("survives the head")
    assert r.spearman_abs.shape == (4, 8) and len(r.to_rows()) == 8
    assert vl.load_result(r.save(tmp_path / "s.npz")).equals(r)


def test_saliency_on_a_random_vit_changes():
    m = get_model("vit_tiny_patch16_224", img_size=96)
    x = torch.randn(3, 3, 96, 96, generator=torch.Generator().manual_seed(3))
    r = sanity_check(m, x, method="saliency")
    assert r.final()["spearman_abs"] < 0.5 and r.final()["ssim"] < 0.5


def test_sanity_table_puts_methods_side_by_side_and_has_a_figure(ref_vit, monkeypatch, tmp_path):
    from vitlens.figures import sanity_figure

    monkeypatch.setitem(METHOD_TABLE, "input_edges", Method("input_edges", input_only_map))
    t = sanity_table(ref_vit, scenes(2), methods=["rollout", "input_edges"])
    rows = t.to_rows()
    assert [row["method"] for row in rows] == ["rollout", "input_edges"]
    assert rows[1]["verdict"] == "barely changes" and rows[1]["spearman_abs"] == pytest.approx(1.0)
    # rollout reads attention only: randomising the head leaves it exactly as it was
    np.testing.assert_allclose(t.results[0].spearman[:, 0], 1.0)
    fig = sanity_figure(t.results)
    assert len(fig.data) == 6 and list(fig.data[0].x)[:2] == ["original", "head"]
    assert vl.load_result(t.save(tmp_path / "t.json")).equals(t)
    with pytest.raises(vl.InvalidParameterError, match="methods"):
        sanity_table(ref_vit, scenes(1), methods=["nope"])


def test_the_verdict_reads_the_cascade_one_rule_for_rollout_saliency_and_grad_rollout(ref_vit):
    """Adebayo et al. read Fig. 2 step by step, with one cutoff: rollout reads attention only, so randomising the head
    leaves it exactly as it was (Spearman 1 by construction), and saliency keeps ~0.76 after the head on ref-vit:
    both survive the head (the issue: saliency read "depends on the weights" beside grad rollout, which falls below
    0.5 at the head, because a second cutoff of 0.9 the figure did not draw split them)."""
    t = sanity_table(ref_vit, scenes(4), methods=["rollout", "saliency", "grad_rollout"], seed=0)
    rollout, saliency, grad = t.results
    np.testing.assert_allclose(rollout.spearman_abs[:, 0], 1.0)
    for r in (rollout, saliency):
        first = r.first_decorrelated()
        assert first is not None and first >= 1 and r.verdict_word().startswith("survives the head")
        assert r.survives() == r.step_labels()[:first] and r.survives()[0] == "head"
        assert f"first decorrelates at step {first + 1} of 8, {r.step_labels()[first]}" in r.verdict()
        assert "still >= 0.5 after randomising head (" in r.verdict()
    if grad.step_means()[0] < 0.5:  # grad rollout's gradient runs through the head
        assert grad.verdict_word() == "depends on the weights" and grad.survives() == []
    rows = t.to_rows()
    assert rows[0]["survives"].startswith("head") and rows[0]["verdict"] == rollout.verdict_word()
    assert rows[1]["first_decorrelated"] == saliency.step_labels()[saliency.first_decorrelated()]


def result_of(curve, steps=("head", "blocks.1", "blocks.0"), method="m"):
    """A hand-set result: the same Spearman curve for 2 images."""
    a = np.tile(np.asarray(curve, dtype=np.float64), (2, 1))
    return sanity.SanityResult(method=method, steps=list(steps), parameters=[[] for _ in steps], spearman_abs=a,
                               spearman=a, ssim=a, maps=np.zeros((len(steps) + 1, 2, 3, 3)),
                               targets=np.zeros(2, dtype=np.int64))


def test_the_verdict_of_hand_set_similarities():
    """Known answers from hand-set Spearman curves (3 steps, 2 images): the one cutoff of 0.5."""
    assert result_of([0.95, 0.92, 0.2]).verdict_word() == "survives the head and 1 top block"
    assert result_of([0.95, 0.92, 0.2]).first_decorrelated() == 2
    assert result_of([0.6, 0.2, 0.1]).verdict_word() == "survives the head"
    assert result_of([0.95, 0.6, 0.55]).verdict_word() == "barely changes"
    assert result_of([0.4, 0.6, 0.1]).verdict_word() == "depends on the weights"
    assert result_of([0.4, 0.6, 0.1]).survives() == []
    assert result_of([0.7, 0.2], steps=("blocks.1", "blocks.0")).verdict_word() == "survives 1 top block"
    assert result_of([np.nan, np.nan, np.nan]).verdict_word() == "undefined"


def test_equal_curves_get_equal_verdicts_and_a_verdict_changes_only_at_the_drawn_cutoff():
    """Issue 45, item 2: saliency at 0.86-0.75 down to block 2 read "depends on the weights" while rollout with a
    like curve read "ignores the head and 2 top blocks" (a 0.9 cutoff split them). One rule: curves on the same side
    of the one cutoff at every step get the same verdict, whatever the method."""
    saliency_like = [0.86, 0.8, 0.78, 0.75, 0.76, 0.55, 0.3, 0.2]
    rollout_like = [1.0, 0.95, 0.92, 0.7, 0.6, 0.52, 0.35, 0.25]
    steps = ["head", *[f"blocks.{i}" for i in range(5, -1, -1)], "embedding"][:8]
    a, b = result_of(saliency_like, steps, "saliency"), result_of(rollout_like, steps, "rollout")
    assert a.verdict_word() == b.verdict_word() == "survives the head and 5 top blocks"
    assert result_of(saliency_like, steps, "grad_rollout").verdict_word() == a.verdict_word()
    assert result_of([0.4, *saliency_like[1:]], steps).verdict_word() == "depends on the weights"
    # the numbers name blocks from 1: blocks.5 of six is block 6
    assert a.step_labels() == ["head", "block 6", "block 5", "block 4", "block 3", "block 2", "block 1", "embedding"]
    assert [row["randomised"] for row in a.to_rows()][:2] == ["head", "block 6"]
    assert [row["module"] for row in a.to_rows()][:2] == ["head", "blocks.5"]
    assert "block 1 (mean Spearman of |maps| 0.3 < 0.5)" in a.verdict()


def test_the_figure_draws_the_verdicts_cutoff_where_it_is_read_and_the_rule_is_said_once():
    from vitlens.figures import sanity_figure

    r = result_of([0.86, 0.8, 0.2])
    fig = sanity_figure([r])
    lines = [sh for sh in fig.layout.shapes if sh.type == "line"]
    assert len(lines) == 1 and lines[0].y0 == lines[0].y1 == r.threshold and lines[0].xref == "x domain"
    assert any("cutoff 0.5" in (an.text or "") for an in fig.layout.annotations)
    assert list(fig.data[0].x) == ["original", "head", "block 2", "block 1"]
    assert fig.data[0].name.endswith(": survives the head and 1 top block")
    rule = sanity.verdict_rule(0.5)
    assert "0.5" in rule and "0.9" not in rule and "survives the head" in rule and "depends on the weights" in rule
    assert not hasattr(sanity, "INSENSITIVE")  # the second cutoff is gone


def test_the_report_says_the_same_rule_and_draws_the_same_figure():
    """Issue 45: the report explained two cutoffs the app did not; now both print ``verdict_rule`` and the report
    draws the sanity figure with its cutoff; its table reads labels (blocks from 1), not identifiers."""
    import html
    from types import SimpleNamespace

    from vitlens.report.html import sanity_section

    steps = ["head", "blocks.1", "blocks.0", "embedding"]
    table = sanity.SanityTable(results=[result_of([0.8, 0.7, 0.2, 0.1], steps, "saliency"),
                                        result_of([0.3, 0.2, 0.1, 0.1], steps, "grad_rollout")])
    page = sanity_section(SimpleNamespace(sanity=table))
    assert html.escape(sanity.verdict_rule(0.5)) in page and "0.9" not in page.split("<div", 1)[0]
    assert "verdict cutoff 0.5" in page and "gradient rollout" in page  # the figure, with its legend's labels
    assert "survives the head and 1 top block" in page and "depends on the weights" in page
    assert "first below the cutoff at" in page and "block 1" in page and "first_decorrelated" not in page


def test_one_image_alone_is_read_as_one_image_by_the_comparison_and_sanity_tables(ref_vit):
    """A single PIL image (not in a list) is one image: the tables equal those of ``[image]`` (``list(image)`` raised)."""
    from vitlens.attribution import compare_methods

    image = scenes(1)[0]
    alone = compare_methods(ref_vit, image, methods=("rollout",), metrics=["deletion_insertion"], steps=4)
    listed = compare_methods(ref_vit, [image], methods=("rollout",), metrics=["deletion_insertion"], steps=4)
    assert alone.attributions[0].maps.shape[0] == 1
    np.testing.assert_array_equal(alone.attributions[0].maps, listed.attributions[0].maps)
    t = sanity_table(ref_vit, image, methods=["rollout"])
    assert t.results[0].spearman.shape[0] == 1
