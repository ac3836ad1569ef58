"""Nothing silently ignored (issue 30, sections 4 and 5): loaders refuse what they cannot honour, a
family honours or refuses the input size it is given, analyze() says why every unavailable weight view
is missing, the filter PCA's process-wide BLAS limit is serialised, and random-init loads are seeded."""
from __future__ import annotations

import html
import json
import threading
import time

import numpy as np
import pytest
import timm
import torch

import vitlens as vl
from vitlens.attribution import ComparisonTable
from vitlens.errors import InvalidParameterError, UnsupportedModelError, ViewNotAvailableError


@pytest.mark.parametrize("name, kwargs, named", [
    ("ref-vit", {"img_size": 128, "arch": "nonsense"}, ["arch='nonsense'", "img_size=128"]),
    ("ref-vit", {"img_size": 128}, ["img_size=128"]),
    ("hf:google/vit-base-patch16-224", {"img_size": 128}, ["img_size=128"]),
    ("open_clip:ViT-B-32", {"arch": "vit_tiny_patch16_224"}, ["arch='vit_tiny_patch16_224'"]),
    ("torchvision:vit_b_16", {"dynamic_img_size": True}, ["dynamic_img_size=True"]),
    ("vit_tiny_patch16_224", {"arch": "vit_small_patch16_224"}, ["arch='vit_small_patch16_224'"]),
])
def test_a_loader_refuses_the_arguments_it_would_ignore_naming_each(name, kwargs, named):
    with pytest.raises(InvalidParameterError) as e:
        vl.load_model(name, pretrained=False, **kwargs)
    message = str(e.value)
    assert message.count("\n") == 0 and "cannot honour" in message
    for part in named:
        assert part in message


def test_a_module_built_in_code_refuses_arch_and_keyword_arguments():
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1)
    with pytest.raises(InvalidParameterError, match="img_size=64"):
        vl.load_model(model, img_size=64)


def test_what_a_loader_honours_still_loads():
    m = vl.load_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1)
    assert m.spec.image_size == (32, 32) and m.spec.num_layers == 1
    assert vl.load_model("ref-vit").spec.image_size == (64, 64)


def test_a_family_that_reads_only_the_built_size_refuses_another_input_size():
    fixed = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1)
    with pytest.raises(UnsupportedModelError, match="built for 32x32 .* input_size \\(48, 48\\)"):
        vl.LoadedModel.from_module(fixed, data_config={"input_size": (3, 48, 48)})
    assert vl.LoadedModel.from_module(fixed, data_config={"input_size": (3, 32, 32)}).spec.grid == (2, 2)

    from torchvision.models.vision_transformer import VisionTransformer

    tv = VisionTransformer(image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=8)
    with pytest.raises(UnsupportedModelError, match="built for 32x32"):
        vl.LoadedModel.from_module(tv, data_config={"input_size": (3, 64, 64)})


def test_a_dynamic_timm_model_is_read_at_the_size_it_is_fed():
    dyn = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1, dynamic_img_size=True)
    m = vl.LoadedModel.from_module(dyn, data_config={"input_size": (3, 48, 64)})
    assert m.grid_for((48, 64)) == (3, 4)
    assert m.preprocess([np.zeros((20, 20, 3), np.uint8)]).shape[-2:] == (48, 64)


def test_analyze_says_why_every_unavailable_weight_view_is_missing(monkeypatch, tmp_path):
    m = vl.load_model("ref-vit")

    def no_filters(*args, **kwargs):
        raise ViewNotAvailableError("no pixel filters here (test)")

    monkeypatch.setattr(type(m.family), "pixel_filters", no_filters)
    r = vl.analyze(m, torch.randn(1, 3, 64, 64), views=("filters", "position"), n_components=2)
    assert r.filters is None and r.notes == {"filters": "no pixel filters here (test)"}
    assert r.position is not None and r.position_note == ""
    back = type(r).load(r.save(tmp_path / "a.json"))
    assert back.notes == r.notes


def test_the_filter_pcas_blas_limit_is_held_by_one_thread_at_a_time(monkeypatch):
    """threadpool_limits is process-wide: two overlapping entries would restore each other's limit."""
    import sklearn.decomposition
    from threadpoolctl import threadpool_info

    real = sklearn.decomposition.PCA
    inside, overlap = [0], [0]
    guard = threading.Lock()

    class SlowPCA(real):
        def fit(self, x, y=None):
            with guard:
                inside[0] += 1
                overlap[0] = max(overlap[0], inside[0])
            time.sleep(0.2)
            try:
                return super().fit(x, y)
            finally:
                with guard:
                    inside[0] -= 1

    monkeypatch.setattr(sklearn.decomposition, "PCA", SlowPCA)
    m = vl.load_model("ref-vit")
    before = [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]
    out: list = []
    threads = [threading.Thread(target=lambda: out.append(vl.embedding_filter_pca(m, 3))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(out) == 3 and overlap[0] == 1
    assert all(r.equals(out[0]) for r in out)
    assert [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"] == before


def test_random_init_loads_are_seeded_and_leave_the_callers_random_stream_alone():
    from vitlens.loading.seeded import RANDOM_INIT_SEED, load_model_seeded

    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = load_model_seeded("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's stream is where it was
    b = load_model_seeded("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1)
    c = load_model_seeded("vit_tiny_patch16_224", pretrained=False, seed=RANDOM_INIT_SEED + 1, img_size=32, depth=1)
    sa, sb, sc = a.model.state_dict(), b.model.state_dict(), c.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_an_error_hint_for_an_interface_there_is_not_is_refused():
    from vitlens.errors import INTERFACES, VitlensError

    assert INTERFACES == ("python", "cli", "app")
    e = VitlensError("wrong.", fixes={"python": "do a.", "cli": "do b."})
    assert e.message_for("cli") == "wrong. do b." and e.message_for("app") == "wrong. do a."
    with pytest.raises(ValueError, match="'CLI'"):
        VitlensError("wrong.", fixes={"CLI": "never shown"})
    with pytest.raises(ValueError, match="'web'"):
        e.message_for("web")


def test_attribution_defaults_are_read_from_the_method_table_with_a_deprecation():
    import vitlens.attribution as va

    with pytest.warns(DeprecationWarning, match="METHOD_TABLE"):
        defaults = va.DEFAULTS
    assert defaults == {k: mt.defaults for k, mt in va.METHOD_TABLE.items()}
    assert "DEFAULTS" not in va.__all__


def test_num_tokens_counts_the_prefix_and_the_patch_tokens_of_a_grid():
    spec = vl.load_model("ref-vit").spec
    assert spec.num_tokens() == spec.num_prefix_tokens + spec.num_patch_tokens == 1 + 8 * 8
    assert spec.num_tokens((3, 5)) == 1 + 15


# ---------------------------------------------------------------- METHOD_TABLE is the one source
def test_the_method_lists_are_derived_from_the_table():
    from vitlens.attribution import methods as am
    from vitlens.attribution import sanity

    table = am.METHOD_TABLE
    assert am.SLOW_METHODS == ("scorecam",) == tuple(k for k, mt in table.items() if mt.slow)
    assert sanity.QUICK_METHODS == ("rollout", "grad_rollout", "saliency", "input_x_gradient", "gradcam")
    assert am.preselected_methods() == ("rollout", "grad_rollout", "saliency")
    assert {k for k, mt in table.items() if mt.class_agnostic} == {"rollout", "eigencam"}
    assert {k for k, mt in table.items() if mt.rollout_row} == {"rollout", "grad_rollout"}
    cams = {k for k, mt in table.items() if mt.package == "pytorch_grad_cam"}
    from vitlens.attribution.cam import CAM_CLASSES, cam_package_available

    assert cams == set(CAM_CLASSES)
    assert set(am.available_methods()) == set(table) - (set() if cam_package_available() else cams)
    variants = {k for k, mt in table.items() if mt.variant_of}
    assert variants == {"attnlrp_gamma", "cp_lrp"}
    assert all(table[k].variant_of in table for k in variants)
    assert set(am.default_methods()) == set(am.available_methods()) - {"scorecam"} - variants


@pytest.fixture()
def registered_method():
    """A method registered by this test alone: the mean of the input's channels on each token's block."""
    from vitlens.attribution import methods as am
    from vitlens.core.resample import pixels_to_grid

    def brightness(m, x, t, grid, params, score):
        return pixels_to_grid(x * params["gain"], grid, reduce="mean"), t.cpu().numpy()

    method = am.register_method(am.Method("test_brightness", brightness, {"gain": 1.0}, quick=True, preselected=True))
    with pytest.raises(InvalidParameterError, match="exists already"):
        am.register_method(method)
    yield method
    del am.METHOD_TABLE[method.name]


def test_a_registered_method_is_attributed_compared_and_listed(registered_method):
    from vitlens.attribution import compare_methods
    from vitlens.attribution.methods import available_methods, default_methods, preselected_methods
    from vitlens.attribution.sanity import quick_methods

    m = vl.load_model("ref-vit")
    x = torch.rand(2, 3, 64, 64)
    a = vl.attribute(m, x, method="test_brightness", gain=2.0)
    want = (x.double() * 2.0).sum(1).reshape(2, 8, 8, 8, 8).mean(dim=(2, 4)).numpy()  # channels summed, block mean
    np.testing.assert_allclose(a.maps, want, rtol=1e-12)
    for names in (available_methods(), default_methods(), preselected_methods(), quick_methods()):
        assert "test_brightness" in names
    table = compare_methods(m, x, methods=["test_brightness"], metrics=("deletion_insertion",), steps=2)
    assert [r["method"] for r in table.rows] == ["test_brightness"]


def test_a_registered_method_is_in_the_cli_choices_and_the_report(registered_method, tmp_path, capsys):
    from vitlens import cli

    report = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["report"]._actions
                  if a.dest == "methods")
    assert "test_brightness" in report.choices
    assert "test_brightness" in cli.report_methods(None)
    assert cli.report_methods(["test_brightness"]) == ["test_brightness"]
    out = tmp_path / "r.html"
    assert cli.main(["report", "--model", "ref-vit", "--out", str(out), "--attributions", "--methods", "test_brightness",
                     "--attribution-images", "2", "--n-images", "4", "--quiet"]) == 0
    page = out.read_text()
    assert "test_brightness" in page
    assert cli.main(["report", "--model", "ref-vit", "--out", str(tmp_path / "s.html"), "--methods", "saliency"]) == 2
    assert "add --attributions" in capsys.readouterr().err


@pytest.fixture()
def registered_metric():
    """A perturbation metric registered by this test alone: the target's probability drop with the half of the
    tokens the map ranks highest set to black (Chefer et al.'s removal at one fraction)."""
    from vitlens.attribution import metrics as mm
    from vitlens.attribution.perturbation import perturbation_test

    def half_removed(m, images, a, s):
        return perturbation_test(m, images, a, fractions=(0.0, 0.5), labels=s.labels, batch_size=s.batch_size,
                                 protocol=s.protocol, ordering=s.ordering)

    metric = mm.register_metric(mm.Metric(
        "test_half_removed", half_removed,
        lambda r: {"half_removed_drop": float((r.positive[:, 0] - r.positive[:, 1]).mean())},
        lambda r: (mm.Curve("Half the tokens removed (test metric)", r.fractions, r.positive),),
        "half_removed_drop: the target's probability drop with the top half of the tokens removed (a test metric)",
        default=True, title="Test metric: half removed"))
    with pytest.raises(InvalidParameterError, match="exists already"):
        mm.register_metric(metric)
    yield metric
    del mm.METRIC_TABLE[metric.name]
    del mm.PROTOCOLS[(metric.name, "vitlens")]


def hand_half_removed_drop(m, x, maps, targets):
    """The probability drop with the top half of each map's tokens set to black, by hand (8x8 px tokens)."""
    mean = torch.tensor(m.data_config["mean"])[:, None, None]
    std = torch.tensor(m.data_config["std"])[:, None, None]
    drops = []
    for j in range(len(x)):
        gh, gw = maps[j].shape
        top = np.argsort(-maps[j].reshape(-1), kind="stable")[: (gh * gw) // 2]
        y = x[j].clone()
        for tok in top:
            r, c = divmod(int(tok), gw)
            y[:, r * 8:(r + 1) * 8, c * 8:(c + 1) * 8] = ((0.0 - mean) / std)[:, :, :1].expand(-1, 8, 8)
        with torch.no_grad():
            p = m.logits(torch.stack([x[j], y])).softmax(-1)[:, int(targets[j])].double()
        drops.append(float(p[0] - p[1]))
    return float(np.mean(drops))


def test_a_registered_metric_is_scored_in_the_table_and_listed(registered_metric):
    from vitlens.attribution.metrics import default_metrics, metric_names

    m = vl.load_model("ref-vit")
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    assert "test_half_removed" in metric_names() and "test_half_removed" in default_metrics()
    table = vl.compare_methods(m, x, methods=["saliency"], metrics=["test_half_removed"])
    assert list(table.rows[0]) == ["method", "half_removed_drop", "map_seconds_per_image", "total_seconds_per_image"]
    a = table.attributions[0]
    want = hand_half_removed_drop(m, x, a.maps, a.targets)
    assert table.rows[0]["half_removed_drop"] == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert table.protocols == {"test_half_removed": "vitlens, signed"}
    assert [r.method for r in table.scores["test_half_removed"]] == ["saliency"]
    # its figure is drawn from the entry alone: one panel per Curve, the mean curve, the row's number in the legend
    from vitlens.figures import metric_figure

    fig = metric_figure(registered_metric, table.scores["test_half_removed"])
    assert [a.text for a in fig.layout.annotations] == ["Half the tokens removed (test metric)"]
    np.testing.assert_allclose(fig.data[0].y, table.scores["test_half_removed"][0].positive.mean(0))
    # a column the entry gives no label reads as its name with spaces (issue 45: no raw identifiers in legends)
    assert fig.data[0].name == f"saliency (half removed drop {vl.results.significant(table.rows[0]['half_removed_drop'])})"
    # the default metrics include it, and two one-method tables concatenate its results
    both = ComparisonTable.concat([table, vl.compare_methods(m, x, methods=["rollout"], steps=2)])
    assert [r.method for r in both.scores["test_half_removed"]] == ["saliency", "rollout"]
    with pytest.raises(InvalidParameterError, match="test_half_removed"):  # the refusal lists it among the names
        vl.compare_methods(m, x, methods=["saliency"], metrics=["roar"])


def test_a_registered_metric_is_in_the_cli_choices_and_the_report(registered_metric, tmp_path, capsys):
    from vitlens import cli

    report = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["report"]._actions
                  if a.dest == "metrics")
    assert "test_half_removed" in report.choices
    out = tmp_path / "r.html"
    assert cli.main(["report", "--model", "ref-vit", "--out", str(out), "--attributions", "--methods", "saliency",
                     "--metrics", "test_half_removed", "--attribution-images", "2", "--n-images", "4", "--quiet"]) == 0
    page = out.read_text()
    # its column, its sentence and its figure (drawn from the entry's curves) are on the page, no other metric's
    assert "half_removed_drop" in page and html.escape(registered_metric.about) in page
    assert "Half the tokens removed (test metric)" in page and "deletion_auc" not in page
    saved = vl.load_result(out.with_suffix(".json"))
    assert list(saved.attributions[0].scores) == ["test_half_removed"]
    assert cli.main(["report", "--model", "ref-vit", "--out", str(tmp_path / "s.html"), "--metrics", "road"]) == 2
    assert "add --attributions" in capsys.readouterr().err


def test_a_registered_metric_is_offered_preselected_and_drawn_by_the_app(registered_metric):
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "app.py"), default_timeout=120)
    at.run()
    at.radio(key="view").set_value("Attributions").run()
    picker = at.multiselect(key="metrics")
    assert "test_half_removed" in picker.options and "test_half_removed" in picker.value  # Metric.default
    at.multiselect(key="methods").set_value(["saliency"]).run()
    picker.set_value(["test_half_removed"]).run()
    assert [e.value for e in at.exception] == [] and [e.value for e in at.error] == []
    columns = list(at.dataframe[0].value.columns)  # the app's shapes have masks: the mask metrics follow
    assert columns[:2] == ["method", "half removed drop"] and "deletion AUC" not in columns
    assert columns[-2:] == ["map seconds per image", "total seconds per image"]
    titles = [json.loads(c.proto.spec)["layout"].get("title", {}).get("text", "") for c in at.get("plotly_chart")]
    assert "Test metric: half removed" in titles
