"""Capture is exact and invisible: attention equals timm's own non-fused computation, and the
model's outputs are bit-for-bit those of a run without capture."""
from __future__ import annotations

import pytest
import torch

import vitlens as vl
from conftest import get_model, reference_attention

ARCHS = [
    ("vit_tiny_patch16_224", {}),
    ("vit_small_patch16_224", {}),
    ("vit_base_patch16_224", {}),
    ("deit_tiny_distilled_patch16_224", {}),  # class + distillation token
    ("vit_small_patch14_reg4_dinov2", {"img_size": 112}),  # 4 registers, no_embed_class
    ("vit_little_patch16_reg4_gap_256", {"img_size": 128}),  # registers, no class token, GAP
    ("vit_base_patch16_siglip_224", {"img_size": 96}),  # no class token, MAP head
    ("vit_tiny_r_s16_p8_224", {}),  # hybrid
    ("vit_base_r50_s16_224", {"img_size": 128}),  # R50 hybrid
    ("vit_tiny_patch16_224", {"img_size": (160, 224)}),  # non-square
    ("vit_tiny_patch16_224", {"qk_norm": True}),  # q/k LayerNorm
]


@pytest.mark.parametrize("name,kwargs", ARCHS, ids=[f"{n}{'-' + str(k) if k else ''}" for n, k in ARCHS])
def test_capture_equals_non_fused_path_and_keeps_logits_identical(name, kwargs):
    m = get_model(name, **kwargs)
    x = torch.randn(2, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = m.model(x)
        with vl.capture_attention(m) as cap:
            captured = m.model(x)
    assert torch.equal(plain, captured), "capture changed the model's output"
    ref_maps, _ = reference_attention(m.model, x)
    assert len(cap.maps) == len(ref_maps) == m.spec.num_layers
    t = m.spec.num_prefix_tokens + m.spec.grid[0] * m.spec.grid[1]
    for got, want in zip(cap.maps, ref_maps):
        assert got.shape == (2, m.spec.num_heads, t, t)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the attention is a distribution over keys for every query
    torch.testing.assert_close(cap.maps[-1].sum(-1), torch.ones(2, m.spec.num_heads, t), atol=1e-5, rtol=0)


def test_dynamic_img_size_model_at_a_second_resolution():
    m = get_model("vit_tiny_patch16_224", dynamic_img_size=True)
    x = torch.randn(1, 3, 160, 256, generator=torch.Generator().manual_seed(1))
    assert m.grid_for((160, 256)) == (10, 16)
    with torch.no_grad(), vl.capture_attention(m) as cap:
        m.model(x)
    ref_maps, _ = reference_attention(m.model, x)
    assert cap.maps[0].shape[-1] == 1 + 10 * 16
    for got, want in zip(cap.maps, ref_maps):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    d = vl.attention_distance(m, x)
    assert d.grid == (10, 16) and d.image_size == (160, 256)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_attention_masks_are_applied_like_timm(mask_kind, tiny):
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(2))
    t = 197
    keep = torch.ones(t, t, dtype=torch.bool)
    keep[:, 150:] = False  # hide the last patches as keys
    mask = keep if mask_kind == "bool" else torch.zeros(t, t).masked_fill(~keep, float("-inf"))
    with torch.no_grad():
        plain = tiny.model.forward_features(x, attn_mask=mask)
        with vl.capture_attention(tiny) as cap:
            captured = tiny.model.forward_features(x, attn_mask=mask)
    assert torch.equal(plain, captured)
    ref_maps, _ = reference_attention(tiny.model, x, attn_mask=mask)
    for got, want in zip(cap.maps, ref_maps):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        assert got[..., 150:].abs().max() == 0


def test_consumers_stream_each_block_in_order_without_storing(tiny):
    seen: list[tuple[int, tuple]] = []
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad(), vl.capture_attention(tiny, store=False, consumers=[lambda l, a: seen.append((l, a.shape))]) as cap:
        tiny.model(x)
    assert [layer for layer, _ in seen] == list(range(12))
    assert cap.maps == []


def test_hooks_are_removed_after_the_context(tiny):
    before = [(len(b.attn._forward_pre_hooks), len(b.attn.q_norm._forward_hooks), len(b.attn.k_norm._forward_hooks))
              for b in tiny.model.blocks]
    with vl.capture_attention(tiny):
        pass
    after = [(len(b.attn._forward_pre_hooks), len(b.attn.q_norm._forward_hooks), len(b.attn.k_norm._forward_hooks))
             for b in tiny.model.blocks]
    assert before == after


def test_bf16_autocast_keeps_attention_in_float32():
    m = get_model("vit_tiny_patch16_224")
    m16 = vl.LoadedModel(model=m.model, spec=m.spec, device=m.device, dtype=torch.bfloat16, data_config=m.data_config)
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), vl.capture_attention(m16) as cap:
        m16.logits(x)
    with torch.no_grad(), vl.capture_attention(m) as cap32:
        m.logits(x)
    assert all(a.dtype == torch.float32 for a in cap.maps)
    # bf16 queries/keys move the probabilities a little, not the picture
    assert max((a - b).abs().max().item() for a, b in zip(cap.maps, cap32.maps)) < 0.05
    d16 = vl.attention_distance(m16, x)
    d32 = vl.attention_distance(m, x)
    assert d16.mean_px.dtype == "float64"
    assert abs(d16.mean_px - d32.mean_px).max() < 2.0


def test_relpos_models_are_read_by_the_generic_call_level_capture():
    # their relative bias reaches scaled_dot_product_attention as its attn_mask (tests/test_generic_capture.py)
    m = vl.load_model("vit_relpos_small_patch16_224", pretrained=False, device="cpu")
    assert m.spec.family == "generic" and m.spec.grid == (14, 14) and m.spec.num_prefix_tokens == 0


def test_capture_refuses_a_raw_unsupported_module():
    import timm

    xcit = timm.create_model("xcit_nano_12_p16_224", pretrained=False, img_size=32, depth=1)
    with pytest.raises(vl.UnsupportedModelError, match="cross-covariance"):
        vl.capture_attention(xcit)


def test_inline_mode_captures_the_maps_the_output_uses_and_restores_fusion():
    m = get_model("deit_tiny_distilled_patch16_224")
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(4))
    fused_before = [b.attn.fused_attn for b in m.model.blocks]
    with torch.no_grad(), vl.capture_attention(m, mode="inline") as cap:
        out = m.model(x)
    assert [b.attn.fused_attn for b in m.model.blocks] == fused_before
    ref_maps, ref_out = reference_attention(m.model, x)
    assert torch.equal(out, ref_out)  # timm's non-fused path, exactly
    for got, want in zip(cap.maps, ref_maps):
        assert torch.equal(got, want)
    with torch.no_grad():
        torch.testing.assert_close(out, m.model(x), atol=1e-4, rtol=1e-4)  # fused run: float rounding only


def test_inline_mode_without_detach_keeps_maps_in_the_graph():
    m = get_model("vit_tiny_patch16_224")
    # the weights are frozen, so the graph runs through the input, as in gradient attribution methods
    x = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    with vl.capture_attention(m, mode="inline", detach=False) as cap:
        logits = m.model(x)
    grads = torch.autograd.grad(logits[0, 3], cap.maps)
    assert all(g is not None and g.shape == a.shape for g, a in zip(grads, cap.maps))
    assert grads[-1].abs().sum() > 0


def test_capture_parameters_are_validated(tiny):
    with pytest.raises(vl.InvalidParameterError, match="mode"):
        vl.capture_attention(tiny, mode="fast")
    with pytest.raises(vl.InvalidParameterError, match="inline"):
        vl.capture_attention(tiny, detach=False)
