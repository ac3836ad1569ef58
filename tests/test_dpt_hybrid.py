"""DPT-hybrid (transformers ``DPTModel`` / ``DPTForDepthEstimation`` with ``is_hybrid=True``: a BiT stem of stride 16
before the ViT) read by the generic capture as a hybrid, the stem's stride the token stride, against the model's own
eager attention."""
from __future__ import annotations

import copy

import pytest
import torch

import vitlens as vl


def config():  # noqa: ANN201 (a transformers config)
    from transformers import BitConfig, DPTConfig

    bit = BitConfig(global_padding="same", layer_type="bottleneck", depths=[1, 1, 1], hidden_sizes=[32, 64, 128],
                    embedding_size=32, num_groups=4, out_features=["stage1", "stage2", "stage3"],
                    embedding_dynamic_padding=True)
    return DPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=64,
                     patch_size=16, is_hybrid=True, backbone_featmap_shape=[1, 128, 4, 4], backbone_out_indices=[0, 1],
                     neck_hidden_sizes=[32, 64, 32, 32], fusion_hidden_size=16, backbone_config=bit)


@pytest.fixture(scope="module", params=["DPTModel", "DPTForDepthEstimation"])
def dpt(request):  # noqa: ANN001, ANN201
    import transformers

    torch.manual_seed(0)
    cls = getattr(transformers, request.param)
    model = cls(config()).eval()
    twin = cls._from_config(copy.deepcopy(model.config), attn_implementation="eager").eval()
    twin.load_state_dict(model.state_dict())
    return model, twin


def test_dpt_hybrid_is_read_as_a_hybrid_at_its_stems_stride(dpt):
    model, twin = dpt
    m = vl.LoadedModel.from_module(model, device="cpu")
    assert (m.spec.family, m.spec.kind, m.spec.grid, m.spec.stride_px, m.spec.num_prefix_tokens) == (
        "generic", "hybrid", (4, 4), (16, 16), 1)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    dpt_model = twin.dpt if hasattr(twin, "dpt") else twin
    with torch.no_grad():
        want = dpt_model(pixel_values=x, output_attentions=True).attentions
        plain = m.logits(x)
    for mode in ("side", "inline"):
        with torch.no_grad(), vl.capture_attention(m, mode=mode) as cap:
            out = m.logits(x)
        if mode == "side":
            assert torch.equal(out, plain)
        assert len(cap.maps) == len(want) == 2
        for got, ref in zip(cap.maps, want):
            assert got.shape == ref.shape == (2, 2, 17, 17) and (got - ref).abs().max().item() < 1e-5
    name, _text = m.family.pixel_filters(m.model, m.spec)[1:]
    assert name.endswith("backbone.bit.embedder.convolution")
