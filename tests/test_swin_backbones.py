"""The Swin backbones inside Mask2Former, OneFormer and UperNet (issue 49): transformers' ``SwinBackbone``, read
through the whole model as a tower is (``ModelSpec.read_module`` names it), checked with tests/test_swin_variants.py's
helpers: capture against each layer's attention written out in float64 (side capture; inline is hf-swin's own
path, tested there), the whole model's outputs bit for bit under side capture, the windows against the hand-written pad-then-shift partition of a backbone
(``always_partition=True``: its last stage keeps its 4x4 windows' shift of 2 on a 4x4 grid, where a ``SwinModel``
clamps it to 0), the distance and the rollout against dense float64 computations. Tiny random models (56 px, 3
stages on 14x14, 7x7, 4x4 tokens). ``Swinv2Backbone`` (its layers run as a ``Swinv2Model``'s) likewise, with the weights
of a tiny ``Swinv2Model``, and UperNet read through it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import vitlens as vl
from test_swin import images
from test_swin_variants import (HF_SIZE, KINDS, VARIANTS, Variant, _hf_layers,
                                assert_distance_is_a_dense_float64_computation,
                                assert_rollout_is_a_brute_force_dense_composition, capture_against_reference,
                                hand_allowed, hand_windows_pad_first, reference_hf_swin, tiny_hf_swinv2)

transformers = pytest.importorskip("transformers")

#: a backbone keeps its last stage's shift (always_partition): that stage's second layer is a shifted window
BACKBONE = Variant("hf-swin", lambda: None, _hf_layers, "attention", reference_hf_swin, True,
                   [(4, 0), (4, 2), (4, 0), (4, 2), (4, 0), (4, 2)], KINDS[:5] + ["shifted window"])


def swin_config() -> "transformers.SwinConfig":
    size = {k: v for k, v in HF_SIZE.items() if k != "num_labels"}
    return transformers.SwinConfig(**size, out_features=["stage1", "stage2", "stage3"])


def peaky(backbone: torch.nn.Module, seed: int = 0) -> None:
    """Large random query and key weights and position biases (attention far from uniform), as tiny_hf_swin's."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in _hf_layers(backbone):
            layer.attention.q_proj.weight.normal_(0.0, 0.6, generator=g)
            layer.attention.k_proj.weight.normal_(0.0, 0.6, generator=g)
            layer.attention.relative_position_bias.relative_position_bias_table.normal_(0.0, 1.0, generator=g)


def build(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the whole model, its Swin backbone) of a tiny random Mask2Former, OneFormer or UperNet."""
    torch.manual_seed(0)
    common = dict(backbone_config=swin_config(), num_labels=3)
    if kind == "upernet":
        model = transformers.UperNetForSemanticSegmentation(transformers.UperNetConfig(
            hidden_size=32, auxiliary_in_channels=64, auxiliary_channels=32, **common))
        backbone = model.backbone
    elif kind == "mask2former":
        model = transformers.Mask2FormerForUniversalSegmentation(transformers.Mask2FormerConfig(
            hidden_dim=32, mask_feature_size=32, feature_size=32, encoder_layers=1, decoder_layers=2, num_queries=4,
            encoder_feedforward_dim=32, dim_feedforward=32, num_attention_heads=2, **common))
        backbone = model.model.pixel_level_module.encoder
    else:
        model = transformers.OneFormerForUniversalSegmentation(transformers.OneFormerConfig(
            hidden_dim=32, mask_dim=32, conv_dim=32, encoder_layers=1, decoder_layers=2, num_queries=4,
            encoder_feedforward_dim=32, dim_feedforward=32, num_attention_heads=2, text_encoder_width=32,
            text_encoder_num_layers=1, text_encoder_context_length=8, text_encoder_n_ctx=2,
            text_encoder_proj_layers=1, **common))
        backbone = model.model.pixel_level_module.encoder
    peaky(backbone)
    return model.eval(), backbone


@pytest.fixture(scope="module")
def upernet() -> tuple[torch.nn.Module, torch.nn.Module]:
    return build("upernet")


@pytest.mark.parametrize("kind, path", [("mask2former", "model.pixel_level_module.encoder"),
                                        ("oneformer", "model.pixel_level_module.encoder"), ("upernet", "backbone")])
def test_each_model_is_read_through_its_swin_backbone(kind, path, upernet):
    model, backbone = upernet if kind == "upernet" else build(kind)
    m = vl.LoadedModel.from_module(model, name=kind)
    assert m.model is backbone and m.family.name == "hf-swin" and m.spec.kind == "hierarchical"
    assert m.spec.read_module == f"{path} (SwinBackbone)"
    assert (m.spec.image_size, m.spec.grid, m.spec.num_layers, m.spec.num_classes) == ((56, 56), (14, 14), 6, 0)
    with torch.no_grad():  # the output scored: the last feature map's mean over its tokens
        want = backbone(images(1)).feature_maps[-1].flatten(2).mean(-1)
        assert torch.equal(m.logits(images(1)), want)


def test_capture_is_each_layers_own_attention_and_side_capture_leaves_the_whole_models_outputs(upernet):
    model, backbone = upernet
    x = images(2)
    worst, moved = capture_against_reference(BACKBONE, backbone, "side", x)  # inline: hf-swin's own path, as tested
    assert worst < 1e-5 and moved == 0.0, (worst, moved)
    m = vl.LoadedModel.from_module(model, name="upernet")
    with torch.no_grad():
        plain = model(pixel_values=x).logits
        with vl.capture_attention(m, mode="side") as cap:
            out = model(pixel_values=x).logits  # the whole model's forward, its backbone read
    assert torch.equal(out, plain) and len(cap.maps) == 6


def test_the_windows_are_the_backbones_pad_then_shift_partition_kept_on_its_last_stage(upernet):
    _model, backbone = upernet
    m = vl.LoadedModel.from_module(backbone, name="swin-backbone")
    windows = m.family.windows(m.model, m.spec.image_size)
    assert [g.kind for g in windows] == BACKBONE.kinds
    seen = []
    hooks = [layer.attention.register_forward_pre_hook(lambda _m, a: seen.append(a[0].shape[0]))
             for layer in _hf_layers(backbone)]
    with torch.no_grad():
        m.logits(images(1))
    for h in hooks:
        h.remove()
    assert seen == [g.num_windows for g in windows]
    for g, (window, shift) in zip(windows, BACKBONE.window_shift, strict=True):
        np.testing.assert_array_equal(g.index, hand_windows_pad_first(g.grid, window, shift))
        np.testing.assert_array_equal(g.allowed, hand_allowed(g.grid, window, shift) & (g.index >= 0)[:, None, :])
    assert _hf_layers(backbone)[5].shift_size == 2  # the backbone's forward keeps it (always_partition)


def test_distance_and_rollout_equal_the_dense_float64_computations(upernet):
    m = vl.LoadedModel.from_module(upernet[0], name="upernet")
    got = assert_distance_is_a_dense_float64_computation(m, images(1))
    assert got.kinds == tuple(BACKBONE.kinds)
    roll = assert_rollout_is_a_brute_force_dense_composition(m, images(1))
    assert roll.source_token.startswith("mean over the last stage's tokens")


def test_swinv2_backbone_is_read_exactly_and_upernet_through_it():
    size = {k: v for k, v in HF_SIZE.items() if k != "num_labels"}
    config = transformers.Swinv2Config(**size, out_features=["stage1", "stage2", "stage3"])
    model = tiny_hf_swinv2(classifier=False)  # its peaky weights, handed to the backbone
    backbone = transformers.Swinv2Backbone(config).eval()
    missing, _unexpected = backbone.load_state_dict(model.state_dict(), strict=False)
    assert not missing
    v2 = VARIANTS["hf-swinv2-model"]
    m = vl.LoadedModel.from_module(backbone, name="swinv2-backbone")
    assert (m.family.name, m.spec.kind, m.spec.grid, m.spec.num_layers, m.spec.num_classes) == (
        "hf-swin", "hierarchical", (14, 14), 6, 0)
    windows = m.family.windows(m.model, m.spec.image_size)
    assert [g.kind for g in windows] == v2.kinds  # as the Swinv2Model's: no always_partition in Swin V2
    for g, (window, shift) in zip(windows, v2.window_shift, strict=True):
        np.testing.assert_array_equal(g.index, hand_windows_pad_first(g.grid, window, shift))
    x = images(1)
    # Swin V2's own eager probabilities, read at its dropout (inline reads the same: tests/test_swin_variants.py)
    worst, moved = capture_against_reference(Variant("hf-swin", lambda: None, _hf_layers, "attention", v2.reference,
                                                     True, v2.window_shift, v2.kinds), backbone, "side", x)
    assert worst < 1e-5 and moved == 0.0, (worst, moved)
    with torch.no_grad():  # the scored output: the last feature map's mean, the Swinv2Model's unnormed last stage
        last = model(pixel_values=x, output_hidden_states=True).reshaped_hidden_states[-1]
        assert torch.equal(m.logits(x), backbone(x).feature_maps[-1].flatten(2).mean(-1))
        torch.testing.assert_close(backbone(x).feature_maps[-1], last, rtol=0, atol=1e-6)
    got = assert_distance_is_a_dense_float64_computation(m, x)
    assert got.kinds == tuple(v2.kinds)
    assert_rollout_is_a_brute_force_dense_composition(m, x)
    torch.manual_seed(0)
    upernet = transformers.UperNetForSemanticSegmentation(transformers.UperNetConfig(
        hidden_size=32, auxiliary_in_channels=64, auxiliary_channels=32, backbone_config=config, num_labels=3)).eval()
    whole = vl.LoadedModel.from_module(upernet, name="upernet-v2")
    assert whole.model is upernet.backbone and whole.spec.read_module == "backbone (Swinv2Backbone)"
    with torch.no_grad():
        plain = upernet(pixel_values=x).logits
        with vl.capture_attention(whole, mode="side") as cap:
            out = upernet(pixel_values=x).logits
    assert torch.equal(out, plain) and len(cap.maps) == 6
