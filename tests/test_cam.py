"""The Grad-CAM family: a hand-built model whose Grad-CAM is known in closed form, agreement with
Grad-CAM / HiResCAM / LayerCAM computed independently with plain autograd on the patch tokens
(class, distillation and register tokens dropped; non-square grids; hybrids; Hugging Face,
torchvision and other timm families), ScoreCAM's batched weights against the package's own, the
target layer chosen automatically or by name, and the messages for a wrong layer or a missing package."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from conftest import get_model
from test_attribution import KEY_PATCH, key_patch_images, one_patch_model
from vitlens.attribution import attribute
from vitlens.attribution.cam import CAM_CLASSES, default_target_layer

pytest.importorskip("pytorch_grad_cam")


def independent_cam(m: vl.LoadedModel, x: torch.Tensor, layer: str, prefix: int, grid: tuple[int, int],
                    t: torch.Tensor, kind: str = "gradcam") -> np.ndarray:
    """Grad-CAM (relu(sum_c mean_tokens(grad) * act)), HiResCAM (relu(sum_c grad * act)) or LayerCAM
    (relu(sum_c relu(grad) * act)) on the patch tokens after ``prefix`` tokens, with plain autograd."""
    store = {}
    handle = dict(m.model.named_modules())[layer].register_forward_hook(lambda _m, _i, out: store.update(a=out))
    try:
        logits = m.forward(x.clone().requires_grad_(True)).float()
        (g,) = torch.autograd.grad(logits[torch.arange(len(t)), t].sum(), store["a"])
    finally:
        handle.remove()
    a, g = store["a"][:, prefix:].detach().double(), g[:, prefix:].double()  # [B, patches, C]
    weighted = {"gradcam": g.mean(1, keepdim=True) * a, "hirescam": g * a, "layercam": g.clamp(min=0) * a}[kind]
    return weighted.sum(-1).clamp(min=0).reshape(len(x), *grid).numpy()


def test_grad_cam_of_the_one_patch_model_is_a_quarter_of_each_patchs_positive_red():
    """Every token attends to the key patch alone and the class-0 logit is 4 x the class token's attention
    output in channel 0, so the gradient at the (identity) norm's output is 4 e0 on the key patch and 0
    elsewhere (the softmax is saturated: its gradient is below 1e-8); the mean over the 16 patches weighs
    channel 0 by 1/4, and the CAM of patch j is relu(mean red of j) / 4 (the patch embedding's channel 0)."""
    m = one_patch_model()
    x = key_patch_images(3)
    a = attribute(m, x, method="gradcam")
    assert a.params["target_layer"] == "blocks.0.norm1" and a.targets.tolist() == [0, 0, 0]
    red = x[:, 0].reshape(3, 4, 8, 4, 8).mean(dim=(2, 4)).double().numpy()
    np.testing.assert_allclose(a.maps, np.maximum(red, 0) / 4, atol=1e-6)
    assert np.all(a.maps[:, KEY_PATCH[0], KEY_PATCH[1]] == pytest.approx(0.25, abs=1e-6))


def _dynamic_vit():
    return get_model("vit_tiny_patch16_224", img_size=64, dynamic_img_size=True)


#: (model, input size, prefix tokens the independent computation drops, grid)
CASES = {
    "vit": (lambda: get_model("vit_tiny_patch16_224", img_size=64), (64, 64), 1, (4, 4)),
    "deit-distilled": (lambda: get_model("deit_tiny_distilled_patch16_224", img_size=64), (64, 64), 2, (4, 4)),
    "registers": (lambda: get_model("vit_small_patch14_reg4_dinov2", img_size=56, num_classes=5), (56, 56), 5, (4, 4)),
    "non-square": (_dynamic_vit, (48, 80), 1, (3, 5)),
    "hybrid": (lambda: vl.load_model("ref-hybrid", device="cpu"), (64, 64), 1, (8, 8)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_grad_cam_equals_an_independent_autograd_computation_on_the_patch_tokens(case):
    build, size, prefix, grid = CASES[case]
    m = build()
    assert m.spec.num_prefix_tokens == prefix
    x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(7))
    t = torch.tensor([1, 3])
    layer = default_target_layer(m)
    assert layer == f"{m.block_names()[-1]}.norm1"
    for kind in ("gradcam", "hirescam", "layercam") if case == "vit" else ("gradcam",):
        a = attribute(m, x, method=kind, target=t.tolist())
        assert a.maps.shape == (2, *grid) and a.grid == grid
        want = independent_cam(m, x, layer, prefix, grid, t, kind)
        assert want.max() > 0
        np.testing.assert_allclose(a.maps, want, rtol=1e-5, atol=1e-6 * want.max())


@pytest.mark.parametrize("family,norm,prefix", [
    ("hf-vit", "layernorm_before", 1),
    ("hf-deit", "layernorm_before", 2),
    ("hf-dinov2-reg", "norm1", 5),
    ("torchvision", "ln_1", 1),
    ("timm-eva02", "norm1", 1),
    ("timm-beit", "norm1", 1),
    ("timm-vit-parallel", "in_norm", 1),
])
def test_grad_cam_reads_each_family_at_its_last_pre_attention_norm(family, norm, prefix):
    from test_families import build

    module, _ = build(family)
    if family == "torchvision":  # torchvision starts its head at zero, which would make every CAM zero
        torch.nn.init.normal_(module.heads.head.weight, std=0.5)
    m = vl.LoadedModel.from_module(module, name=family, device="cpu")
    layer = default_target_layer(m)
    assert layer == f"{m.block_names()[-1]}.{norm}" and m.spec.num_prefix_tokens == prefix
    x = torch.randn(2, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(8))
    t = torch.tensor([0, 4])
    a = attribute(m, x, method="gradcam", target=t.tolist())
    want = independent_cam(m, x, layer, prefix, m.spec.grid, t)
    assert want.max() > 0
    np.testing.assert_allclose(a.maps, want, rtol=1e-5, atol=1e-6 * want.max())
    for method in CAM_CLASSES:
        params = {"masked_per_forward": 16} if method == "scorecam" else {}
        other = attribute(m, x, method=method, target=t.tolist(), **params)
        assert other.maps.shape == (2, *m.spec.grid) and np.isfinite(other.maps).all() and (other.maps >= 0).all()


def test_a_named_target_layer_is_used_and_a_wrong_one_is_named_with_its_neighbours():
    m = get_model("vit_tiny_patch16_224", img_size=64)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(9))
    t = torch.tensor([2, 5])
    a = attribute(m, x, method="gradcam", target=t.tolist(), target_layer="blocks.3.norm1")
    assert a.params["target_layer"] == "blocks.3.norm1"
    np.testing.assert_allclose(a.maps, independent_cam(m, x, "blocks.3.norm1", 1, (4, 4), t), rtol=1e-5, atol=1e-8)
    assert not np.allclose(a.maps, attribute(m, x, method="gradcam", target=t.tolist()).maps)
    with pytest.raises(vl.InvalidParameterError, match=r"blocks\.3\.norm1"):
        attribute(m, x, method="gradcam", target_layer="blocks.3.norm_1")
    with pytest.raises(vl.InvalidParameterError, match=r"'head' outputs \(2, 1000\)"):
        attribute(m, x, method="gradcam", target_layer="head")
    # a feature map at the token grid (the patch embedding's convolution) is taken as it is
    conv = attribute(m, x, method="gradcam", target=t.tolist(), target_layer="patch_embed.proj")
    assert conv.maps.shape == (2, 4, 4)


def test_batched_score_cam_weights_equal_the_packages_own():
    from pytorch_grad_cam import ScoreCAM
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget
    from vitlens.attribution.cam import _Scored, _score_cam_weights, token_reshape

    m = vl.load_model("ref-vit", device="cpu")
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(10))
    t = torch.tensor([1, 4])
    score = lambda inp: m.forward(inp).float()  # noqa: E731
    acts = np.random.default_rng(0).normal(size=(2, 128, 8, 8)).astype(np.float32)
    cam = ScoreCAM(_Scored(m.model, score), [m.model.blocks[-1].norm1],
                   reshape_transform=token_reshape(m.spec, (8, 8), 2, "blocks.5.norm1"))
    cam.activations_and_grads.release()  # only its weights are asked for
    theirs = cam.get_cam_weights(x, None, [ClassifierOutputTarget(1), ClassifierOutputTarget(4)], acts, None)
    ours = _score_cam_weights(score, x, acts, t, chunk=48)  # chunks that straddle the two images
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-7)
    a = attribute(m, x, method="scorecam", target=t.tolist(), masked_per_forward=100)
    assert a.maps.shape == (2, 8, 8) and a.params["masked_per_forward"] == 100


def test_cams_explain_a_prompt_on_an_open_clip_tower():
    open_clip = pytest.importorskip("open_clip")
    from test_text_targets import TEXT, VISION, char_tokenizer, images

    torch.manual_seed(0)
    m = vl.LoadedModel.from_module(open_clip.model.CLIP(embed_dim=16, vision_cfg=VISION, text_cfg=TEXT), device="cpu")
    assert default_target_layer(m) == "visual.transformer.resblocks.1.ln_1"
    x = images()
    dog = attribute(m, x, method="gradcam", target="a photo of a dog", tokenizer=char_tokenizer)
    cat = attribute(m, x, method="gradcam", target="a photo of a cat", tokenizer=char_tokenizer)
    assert dog.maps.shape == (2, 4, 4) and dog.target_kind == "text" and not np.allclose(dog.maps, cat.maps)
    eig = attribute(m, x, method="eigencam")
    assert eig.targets.tolist() == [-1, -1] and eig.maps.shape == (2, 4, 4)  # class-agnostic on a feature model


def test_without_grad_cam_the_message_says_how_to_install_it(monkeypatch, tiny):
    import builtins

    real_import = builtins.__import__

    def without(module, *args, **kwargs):
        if module.startswith("pytorch_grad_cam"):
            raise ImportError("No module named 'pytorch_grad_cam'")
        return real_import(module, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    with pytest.raises(vl.ViewNotAvailableError, match=r"pip install 'vitlens\[cam\]'"):
        attribute(tiny, torch.randn(1, 3, 224, 224), method="gradcam")
