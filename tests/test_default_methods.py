"""compare_methods's default method list: every method that is available, not slow (scorecam is left out; the CAMs
only with grad-cam installed) and not a named variant of another (attnlrp_gamma, cp_lrp), and a default call runs
exactly those."""
from __future__ import annotations

import torch

import vitlens as vl
from vitlens.attribution import METHODS
from vitlens.attribution import methods as methods_module
from vitlens.attribution.cam import CAM_CLASSES, CAM_PACKAGE
from vitlens.attribution.methods import SLOW_METHODS, default_methods

# the one place a method's extra package is looked for (Method.available)
with_cams = (methods_module, "package_available", lambda package: True)
without_cams = (methods_module, "package_available", lambda package: package != CAM_PACKAGE)


def test_the_default_is_every_available_method_but_the_slow_ones(monkeypatch):
    monkeypatch.setattr(*with_cams)
    variants = ("attnlrp_gamma", "cp_lrp")
    assert default_methods() == tuple(name for name in METHODS if name not in ("scorecam", *variants))
    assert SLOW_METHODS == ("scorecam",) and "gradcam" in default_methods() and "attnlrp" in default_methods()
    monkeypatch.setattr(*without_cams)
    assert default_methods() == tuple(name for name in METHODS if name not in (*CAM_CLASSES, *variants))


def test_a_default_compare_methods_call_runs_the_default_methods(monkeypatch):
    monkeypatch.setattr(*without_cams)  # as without grad-cam installed
    m = vl.load_model("ref-vit", device="cpu")
    table = vl.compare_methods(m, torch.randn(1, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(0)),
                               steps=2, metrics=["deletion_insertion"])
    assert [row["method"] for row in table.to_rows()] == list(default_methods())


# --- the report's default attribution set

def test_the_reports_default_attributions_are_the_quick_preselected_set():
    from vitlens.attribution.methods import METHOD_TABLE, available_methods, preselected_methods
    from vitlens import cli

    default = cli.report_methods(None)
    assert default == [k for k in preselected_methods() if k in available_methods()] and default
    assert not any(METHOD_TABLE[k].slow for k in default) and "occlusion" not in default
    assert cli.report_methods(["all"]) == list(available_methods())
    assert cli.report_methods(["occlusion"]) == ["occlusion"]
    args = cli.build_parser().parse_args(["report", "--attributions", "--methods", "all"])
    assert args.methods == ["all"]
