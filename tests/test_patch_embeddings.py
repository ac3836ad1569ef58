"""Patch embeddings that are no convolution (issue 48): Llama 4's Unfold + Linear with its class token after the
patches, timm's Gemma 4 linear patch embedding (2-D RoPE), timm's Qwen3-VL encoder (2-D RoPE): read exactly against
the models' own eager attention, outputs unchanged under capture, distance and rollout on each model's own grid."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import vitlens as vl
from vitlens.families.common.patches import patch_embedding

from test_generic_capture import numpy_distance, numpy_rollout
from test_any_vit_round3b import qwen_vl_float64
from test_generic_layouts import eager_twin, images

TOL = 1e-5


@pytest.fixture(scope="module")
def llama4():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          intermediate_size=128, image_size=32, patch_size=8, vision_output_dim=32,
                                          projector_input_dim=32, projector_output_dim=32, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.Llama4VisionModel(cfg).eval()


def _own_eager_maps(model: nn.Module, x: torch.Tensor,
                    attns: list[nn.Module]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A timm model's own non-fused attention (``fused_attn=False``: its explicit softmax, then ``attn_drop``): the
    probabilities read at each block's ``attn_drop`` input, and the model's output."""
    twin = copy.deepcopy(model)
    maps: list[torch.Tensor] = []
    names = {id(a): n for n, a in model.named_modules()}
    own = dict(twin.named_modules())
    for attn in attns:
        mod = own[names[id(attn)]]
        mod.fused_attn = False
        mod.attn_drop.register_forward_pre_hook(lambda _m, args: maps.append(args[0].detach().clone()))
    with torch.no_grad():
        out = twin(x)
    return maps, out


def llama4_eager(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Llama 4's own eager attention maps and output (its forward returns them with the hidden states asked too)."""
    with torch.no_grad():
        out = eager_twin(model)(pixel_values=x, output_attentions=True, output_hidden_states=True)
    return list(out.attentions), out.last_hidden_state


def test_linear_patch_embeddings_read_as_convolutions():
    # known answer: Unfold + Linear is the convolution of kernel = stride = patch whose filters are the rows
    unfold = nn.Module()
    unfold.unfold, unfold.linear = nn.Unfold(kernel_size=4, stride=4), nn.Linear(3 * 16, 5, bias=False)
    pe = patch_embedding(unfold)
    assert (pe.kind, pe.in_channels, pe.kernel, pe.stride, pe.grid((12, 8))) == ("linear", 3, (4, 4), (4, 4), (3, 2))
    conv = nn.Conv2d(3, 5, 4, 4, bias=False)
    with torch.no_grad():
        conv.weight.copy_(pe.filters().reshape(5, 3, 4, 4))
    x = torch.randn(2, 3, 12, 8, generator=torch.Generator().manual_seed(0))
    want = conv(x).flatten(2).transpose(1, 2)
    got = unfold.linear(unfold.unfold(x).transpose(1, 2))
    assert (got - want).abs().max().item() < 1e-5
    assert patch_embedding(nn.Linear(4, 4)) is None


def test_llama4_class_token_last_exact_against_its_eager_attention(llama4):
    x = images()
    want, want_hidden = llama4_eager(llama4, x)
    order = [16] + list(range(16))  # the model's cells then class -> class, cells
    m = vl.LoadedModel.from_module(llama4, name="llama4", device="cpu")
    assert (m.spec.family, m.spec.grid, m.spec.stride_px, m.spec.num_prefix_tokens) == ("generic", (4, 4), (8, 8), 1)
    assert m.spec.prefix_labels == ("class",) and "class at 16" in m.spec.describe()["token order"]
    with torch.no_grad():
        plain = llama4(pixel_values=x).last_hidden_state
    for mode in ("side", "inline"):
        with torch.no_grad(), vl.capture_attention(m, mode=mode) as cap:
            hidden = llama4(pixel_values=x).last_hidden_state
        if mode == "side":
            assert torch.equal(hidden, plain)
        assert (hidden - want_hidden).abs().max().item() < TOL
        assert len(cap.maps) == 2
        for got, ref in zip(cap.maps, want):
            assert got.shape == (2, 2, 17, 17)
            assert (got - ref[..., order, :][..., order]).abs().max().item() < TOL
    ref = [a[..., order, :][..., order].numpy() for a in want]
    result = vl.analyze(m, x, views=("distance", "rollout"))
    np.testing.assert_allclose(result.rollout.maps, numpy_rollout(ref, 1, (4, 4)), rtol=1e-4, atol=1e-6)
    for layer in range(2):
        np.testing.assert_allclose(result.distance.mean_px[layer], numpy_distance(ref[layer], (4, 4), (8, 8), 1),
                                   rtol=1e-4)
    w, where, text = m.family.pixel_filters(m.model, m.spec)
    assert w.shape == (32, 3, 8, 8) and where == "patch_embedding.linear" and "linear layer" in text


@pytest.fixture(scope="module")
def timm_models():
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    gemma = timm.create_model("gemma4_vit_167m_enc", pretrained=False, patch_size=8, embed_dim=32, depth=2,
                              num_heads=2, head_dim=16, intermediate_size=64, global_pool="avg",
                              pooling_kernel_size=2, position_embedding_size=16).eval()
    qwen = timm.create_model("qwen3_vit_88m_enc", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2,
                             num_heads=2, global_pool="avg").eval()
    return {"gemma4": gemma, "qwen3": qwen}


@pytest.mark.parametrize("key", ["gemma4", "qwen3"])
def test_timm_rope_encoders_exact_against_their_own_explicit_softmax(timm_models, key):
    model = timm_models[key]
    x = images(2, seed=2).clamp(0, 1)
    want, want_out = _own_eager_maps(model, x, [b.attn for b in model.blocks])
    m = vl.LoadedModel.from_module(model, name=key, device="cpu", data_config={"input_size": (3, 32, 32)})
    assert (m.spec.family, m.spec.grid, m.spec.stride_px, m.spec.num_prefix_tokens) == ("generic", (4, 4), (8, 8), 0)
    with torch.no_grad():
        plain = model(x)
    with torch.no_grad(), vl.capture_attention(m) as cap:
        out = model(x)
    assert torch.equal(out, plain) and (out - want_out).abs().max().item() < TOL
    assert len(cap.maps) == 2
    for got, ref in zip(cap.maps, want):
        assert got.shape == (2, 2, 16, 16) and (got - ref).abs().max().item() < TOL
    ref = [a.numpy() for a in want]
    result = vl.analyze(m, x, views=("distance",))
    for layer in range(2):
        np.testing.assert_allclose(result.distance.mean_px[layer], numpy_distance(ref[layer], (4, 4), (8, 8), 0),
                                   rtol=1e-4)


@pytest.fixture(scope="module")
def qwen3vl():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3VLVisionConfig(hidden_size=32, depth=2, num_heads=2, intermediate_size=64, patch_size=8,
                                           out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[])
    torch.manual_seed(0)
    return transformers.Qwen3VLVisionModel._from_config(cfg, attn_implementation="sdpa").eval()


def _qwen3vl_reference(model: nn.Module, m: "vl.LoadedModel", x: torch.Tensor) -> list[torch.Tensor]:
    """Each block's attention written out from its own input (``qwen_vl_float64``: Qwen3-VL's own rotation,
    softmax(q k^T * scaling) within each image's ``cu_seqlens`` tokens), in the model's own (2x2 merge-block) token
    order."""
    return qwen_vl_float64(model, lambda: m.forward(x))


def test_qwen3vl_merge_block_order_exact_against_its_own_attention(qwen3vl):
    from vitlens.core.tokens import merge_block_layout, standard_layout

    x = images(2, seed=5)
    m = vl.LoadedModel.from_module(qwen3vl, name="qwen3vl", device="cpu")
    assert (m.spec.family, m.spec.grid, m.spec.stride_px, m.spec.num_prefix_tokens) == ("generic", (4, 4), (8, 8), 0)
    assert "permuted" in m.spec.describe()["token order"]
    order = merge_block_layout((4, 4)).canonical_order()
    want = [a[..., order, :][..., order] for a in _qwen3vl_reference(qwen3vl, m, x)]
    with torch.no_grad():
        plain = m.forward(x)
    for mode in ("side", "inline"):
        with torch.no_grad(), vl.capture_attention(m, mode=mode) as cap:
            out = m.forward(x)
        if mode == "side":
            assert torch.equal(out, plain)
        assert (out - plain).abs().max().item() < TOL and len(cap.maps) == 2
        for got, ref in zip(cap.maps, want):
            assert got.shape == (2, 2, 16, 16) and (got - ref).abs().max().item() < TOL
    result = vl.analyze(m, x, views=("distance",))
    for layer in range(2):
        np.testing.assert_allclose(result.distance.mean_px[layer],
                                   numpy_distance(want[layer].numpy(), (4, 4), (8, 8), 0), rtol=1e-4)
    w, _, _ = m.family.pixel_filters(m.model, m.spec)
    assert w.shape == (32, 3, 8, 8)
    # the order is checked by lighting patches: a row-major layout stated for it is refused
    with pytest.raises(vl.UnsupportedModelError, match="wrong grid cells"):
        vl.load_model(copy.deepcopy(qwen3vl), device="cpu", token_layout=standard_layout((4, 4), ()))


def test_hf_gemma4_positioned_patches_exact_against_its_eager_attention():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma4VisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                          num_key_value_heads=1, head_dim=16, intermediate_size=64, patch_size=8,
                                          position_embedding_size=16, pooling_kernel_size=2,
                                          attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Gemma4VisionModel(cfg).eval()
    m = vl.LoadedModel.from_module(model, name="gemma4-hf", device="cpu", data_config={"input_size": (3, 32, 32)})
    assert (m.spec.family, m.spec.grid, m.spec.stride_px, m.spec.num_prefix_tokens) == ("generic", (4, 4), (8, 8), 0)
    x = images(2, seed=6).clamp(0, 1)
    # its processor's inputs, written out: patches row-major, each flattened (row, column, channel), (x, y) positions
    pixels = x.reshape(2, 3, 4, 8, 4, 8).permute(0, 2, 4, 3, 5, 1).reshape(2, 16, 192)
    ys, xs = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
    positions = torch.stack([xs.flatten(), ys.flatten()], -1).expand(2, -1, -1)
    with torch.no_grad():
        ref = eager_twin(model)(pixel_values=pixels, pixel_position_ids=positions, output_attentions=True)
        plain = model(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
    with torch.no_grad(), vl.capture_attention(m) as cap:
        out = model(pixel_values=pixels, pixel_position_ids=positions).last_hidden_state
    assert torch.equal(out, plain) and len(cap.maps) == 2
    for got, want in zip(cap.maps, ref.attentions):
        assert got.shape == (2, 2, 16, 16) and (got - want).abs().max().item() < TOL
    result = vl.analyze(m, x, views=("distance",))
    for layer in range(2):
        np.testing.assert_allclose(result.distance.mean_px[layer],
                                   numpy_distance(ref.attentions[layer].numpy(), (4, 4), (8, 8), 0), rtol=1e-4)
    # the filters are the linear layer's rows as a convolution of the pixels (its (row, column, channel) order)
    w, _, _ = m.family.pixel_filters(m.model, m.spec)
    conv = torch.nn.functional.conv2d(x.double(), w, stride=8).flatten(2).transpose(1, 2)
    assert (conv - model.patch_embedder.input_proj(pixels).double()).abs().max().item() < 1e-5
