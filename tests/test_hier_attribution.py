"""Attributions on hierarchical (windowed) models: the Grad-CAM family on the last stage's grid against
pytorch-grad-cam called directly and against the Grad-CAM formula written out here, captum's input methods
against captum called directly, the methods a hierarchical model is refused (by name, in one line naming those it
has) derived from ``METHOD_TABLE``, and what the report and the CLI offer it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from vitlens.attribution.methods import METHOD_TABLE, methods_for, preselected_methods
from vitlens.errors import InvalidParameterError, UnsupportedModelError

from test_swin import tiny_swin

SIZE = 64  # 16x16 patch grid (4 px), stages 16x16 -> 8x8 -> 4x4 (16 px cells), each tiling the input exactly


def load(module: torch.nn.Module, name: str = "tiny-swin") -> vl.LoadedModel:
    return vl.LoadedModel.from_module(module, name=name, device="cpu")


def batch(n: int = 2, size: int = SIZE) -> torch.Tensor:
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def swin() -> vl.LoadedModel:
    return load(tiny_swin(img=SIZE))


def hand_gradcam(model: torch.nn.Module, layer: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor,
                 to_nchw) -> np.ndarray:
    """Grad-CAM (Selvaraju et al. 2017) written out: the layer's activations A [B, C, h, w] and the gradient of
    the target logit G; weights = G averaged over the grid, map = ReLU(sum_c w_c A_c), in float64."""
    seen = {}
    hook = layer.register_forward_hook(lambda _m, _i, out: seen.update(out=out))
    try:
        with torch.enable_grad():
            xi = x.clone().requires_grad_(True)
            logits = model(xi)
            logits = getattr(logits, "logits", logits)
            grad, = torch.autograd.grad(logits.gather(1, targets[:, None]).sum(), seen["out"])
    finally:
        hook.remove()
    a, g = to_nchw(seen["out"].detach()).double(), to_nchw(grad).double()
    return (g.mean(dim=(2, 3), keepdim=True) * a).sum(1).clamp(min=0).numpy()


def test_gradcam_on_swin_is_pytorch_grad_cam_called_directly_on_the_last_stage(swin):
    from pytorch_grad_cam import GradCAM
    from pytorch_grad_cam.utils.image import scale_cam_image
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    x = batch()
    r = vl.attribute(swin, x, method="gradcam")
    assert r.params["target_layer"] == "layers.2.blocks.1"  # the last stage's last block (TimmSwin.cam_layer)
    assert r.grid == (4, 4) and r.maps.shape == (2, 4, 4) and tuple(r.stride_px) == (16, 16)
    assert "on stage 3's (the last) 4x4 grid (16 px cells), coarser than the 16x16 patch grid" in r.note
    assert r.upsampled().shape == (2, SIZE, SIZE)  # shown on the input, as every map
    assert np.all(r.maps >= 0) and np.all(r.maps.reshape(2, -1).max(1) > 0)
    # the reference: a fresh copy of the same weights (trainable, as the package expects), the package's own
    # GradCAM with the last block as target layer and its NHWC output put channels-first
    ref = tiny_swin(img=SIZE)
    targets = torch.as_tensor(r.targets)
    with GradCAM(model=ref, target_layers=[ref.layers[-1].blocks[-1]],
                 reshape_transform=lambda t: t.permute(0, 3, 1, 2)) as cam:
        package = cam(input_tensor=x, targets=[ClassifierOutputTarget(int(c)) for c in targets])  # [B, 64, 64]
    # the package min-max scales its grid CAM and resizes it to the input (per layer), then min-max scales the
    # mean over its layers again (BaseCAM.aggregate_multi_layers): ours, put through the same two steps
    ours = scale_cam_image(scale_cam_image(r.maps.astype(np.float32), (SIZE, SIZE)))
    np.testing.assert_allclose(ours, package, atol=1e-5)
    # and the formula itself, unscaled
    hand = hand_gradcam(ref, ref.layers[-1].blocks[-1], x, targets, lambda t: t.permute(0, 3, 1, 2))
    np.testing.assert_allclose(r.maps, hand, rtol=1e-5, atol=1e-6 * hand.max())


def test_the_cams_read_the_last_stage_and_name_another_layer_on_its_own_stage(swin):
    x = batch(1)
    for method in ("gradcam++", "layercam", "eigencam", "hirescam"):
        r = vl.attribute(swin, x, method=method)
        assert r.grid == (4, 4) and r.maps.shape == (1, 4, 4), method
    mid = vl.attribute(swin, x, method="gradcam", target_layer="layers.1.blocks.1")  # stage 2: 8x8, 8 px
    assert mid.grid == (8, 8) and tuple(mid.stride_px) == (8, 8) and "stage 2" in mid.note
    with pytest.raises(InvalidParameterError, match="stage grids"):
        vl.attribute(swin, x, method="gradcam", target_layer="layers.0.blocks.1.attn.qkv")  # windows, not a grid


def test_saliency_on_swin_is_captum_called_directly(swin):
    """Saliency is input-space and model-agnostic: captum's Saliency on the same weights, summed over channels and
    each patch's 4x4 pixels in float64 here. Tolerance: both are one float32 forward and backward of the same graph
    on the CPU (identical up to the order of float32 reductions, ~1e-7 relative); 1e-5 of the map's scale."""
    from captum.attr import IntegratedGradients, Saliency

    x = batch()
    ref = tiny_swin(img=SIZE)
    r = vl.attribute(swin, x, method="saliency")
    t = torch.as_tensor(r.targets)
    assert r.grid == (16, 16) and tuple(r.stride_px) == (4, 4) and r.note == ""
    pixels = Saliency(ref).attribute(x.clone().requires_grad_(True), target=t, abs=True).double().sum(1)
    expected = pixels.reshape(2, 16, 4, 16, 4).sum(dim=(2, 4)).numpy()
    np.testing.assert_allclose(r.maps, expected, rtol=1e-5, atol=1e-5 * expected.max())
    ig = vl.attribute(swin, x, method="integrated_gradients", n_steps=4)
    pixels = IntegratedGradients(ref).attribute(x, baselines=torch.zeros_like(x), target=t, n_steps=4,
                                                internal_batch_size=2).double().sum(1)
    expected = pixels.reshape(2, 16, 4, 16, 4).sum(dim=(2, 4)).numpy()
    np.testing.assert_allclose(ig.maps, expected, rtol=1e-4, atol=1e-5 * np.abs(expected).max())


def test_attributions_leave_the_model_as_it_is(swin):
    x = batch()
    before = swin.logits(x).clone()
    hooks = lambda: sum(len(mod._forward_hooks) + len(mod._forward_pre_hooks) + len(mod._backward_hooks)  # noqa: E731
                        for mod in swin.model.modules())
    n_hooks = hooks()
    for method in ("gradcam", "saliency", "rollout", "eigencam"):
        vl.attribute(swin, x, method=method)
    assert torch.equal(swin.logits(x), before) and hooks() == n_hooks
    assert all(p.grad is None and not p.requires_grad for p in swin.model.parameters())


def test_methods_reading_a_vits_attention_are_refused_by_name_in_one_line(swin):
    refused = [k for k, mt in METHOD_TABLE.items() if "hierarchical" not in mt.kinds]
    assert {"grad_rollout", "attnlrp", "attnlrp_gamma", "cp_lrp"} <= set(refused)
    offered = methods_for(swin)
    assert offered == tuple(k for k in METHOD_TABLE if k not in refused)
    for method in refused:
        with pytest.raises(UnsupportedModelError) as e:
            vl.attribute(swin, batch(1), method=method)
        line = str(e.value)
        assert "\n" not in line and method in line and "hierarchical" in line
        assert line.endswith(f"the methods defined for it: {', '.join(offered)}.")


def test_the_registry_lists_what_the_report_and_the_cli_offer(swin):
    from vitlens.attribution.methods import available_methods, default_methods
    from vitlens.cli import CliError, build_parser, report_methods

    offered = methods_for("hierarchical")
    assert offered == methods_for(swin) == methods_for(swin.spec)
    assert {"rollout", "saliency", "integrated_gradients", "input_x_gradient", "occlusion", "gradcam",
            "eigencam", "scorecam"} <= set(offered)
    assert report_methods(["all"], None, swin) == [k for k in available_methods() if k in offered]
    assert report_methods(None, None, swin) == list(preselected_methods(swin)) == ["rollout", "saliency"]
    assert set(default_methods(swin)) <= set(offered) and "gradcam" in default_methods(swin)
    with pytest.raises(CliError, match="grad_rollout reads a ViT's"):
        report_methods(["grad_rollout"], None, swin)
    said: list[str] = []
    assert report_methods(["grad_rollout", "gradcam"], said.append, swin) == ["gradcam"]  # another model may have it
    assert len(said) == 1 and "no grad_rollout" in said[0]
    help_text = build_parser()._subparsers._group_actions[0].choices["report"].format_help()
    assert "hierarchical" in " ".join(help_text.split())


def test_the_app_offers_the_registrys_methods_for_the_models_kind():
    """The app's Attributions page reads ``methods_for(m)`` and ``preselected_methods(m)`` (the source, checked
    here without starting the app; tests/test_swin_app.py runs it)."""
    import ast
    from pathlib import Path

    source = (Path(__file__).resolve().parents[1] / "vitlens_app" / "views" / "attributions.py").read_text()
    tree = ast.parse(source)
    render = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "render_attributions")
    text = ast.get_source_segment(source, render)
    assert "methods_for(m)" in text and "preselected_methods(m)" in text
    assert 'multiselect("Methods", list(offered)' in text


def test_compare_methods_scores_the_cams_on_their_own_cells(swin, tmp_path):
    """The perturbation metrics remove a CAM's cells (16 px on the last stage), not the 4 px patches."""
    from vitlens.attribution import compare_methods
    from vitlens.attribution.perturbation import removal_masks

    x = batch(1)
    table = compare_methods(swin, x, methods=["gradcam", "saliency"], metrics=["deletion_insertion", "perturbation"])
    assert [a.method for a in table.attributions] == ["gradcam", "saliency"]
    cam = table.attributions[0]
    masks = removal_masks(cam.maps, [0.0, 1 / 16], True, cam.cell_px(swin.spec.stride_px), (SIZE, SIZE))
    assert int(masks[0, 1].sum()) == 16 * 16  # one 16x16 cell of the 4x4 grid
    again = vl.load_result(cam.save(tmp_path / "cam.json"))
    assert tuple(again.stride_px) == (16, 16) and again.grid == (4, 4)


def test_hf_swin_gradcam_reads_its_final_norm_on_the_last_stage():
    from test_swin_variants import tiny_hf_swin

    m = load(tiny_hf_swin(), "tiny-hf-swin")
    x = batch(1, 56)
    r = vl.attribute(m, x, method="gradcam")
    assert r.params["target_layer"] == "swin.layernorm"  # a transformers Swin layer returns a tuple
    assert r.grid == (4, 4) and tuple(r.stride_px) == (16, 16)  # 14 -> 7 -> 4 tokens (the merging pads 7 to 8)
    ref = tiny_hf_swin()
    hand = hand_gradcam(ref, ref.swin.layernorm, x, torch.as_tensor(r.targets),
                        lambda t: t.reshape(t.shape[0], 4, 4, t.shape[-1]).permute(0, 3, 1, 2))
    np.testing.assert_allclose(r.maps, hand, rtol=1e-5, atol=1e-6 * hand.max())


def test_sam_encoder_without_a_classifier_explains_its_output_and_refuses_a_class_in_one_line():
    import timm

    torch.manual_seed(0)
    model = timm.create_model("samvit_base_patch16", pretrained=False, img_size=56, patch_size=8, embed_dim=32,
                              depth=2, num_heads=2, window_size=3, global_attn_indexes=(1,), neck_chans=16,
                              num_classes=0).eval()
    m = load(model, "tiny-sam")
    assert m.spec.kind == "hierarchical" and m.spec.num_classes == 0
    agnostic = [k for k in methods_for(m) if not METHOD_TABLE[k].needs_target]
    assert agnostic == ["rollout", "eigencam"]
    with pytest.raises(InvalidParameterError) as e:
        vl.attribute(m, batch(1, 56), method="gradcam", target=2)
    assert "\n" not in str(e.value) and "no classifier head" in str(e.value) and "direction" in str(e.value)
    g = vl.attribute(m, batch(1, 56), method="gradcam")  # the encoder's output norm (issue 63.1)
    assert g.target_kind == "output" and np.isfinite(g.maps).all()
    r = vl.attribute(m, batch(1, 56), method="eigencam")  # class-agnostic: the last block's 7x7 grid
    assert r.params["target_layer"] == "blocks.1" and r.grid == (7, 7) and tuple(r.stride_px) == (8, 8)
    assert r.note.startswith("class-agnostic") and "coarser" not in r.note
