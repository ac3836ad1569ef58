"""Whole models read through their vision tower, and the three crashes of the any-ViT probe (issue 48 §1): a
backbone's output (Dinov2Backbone, Depth Anything's), VLMs whose image features need other inputs (Idefics3 and
SmolVLM take images per sample, InstructBLIP a Q-Former prompt), a MAP head that is an ``nn.MultiheadAttention``
(Phi-4-multimodal's). Each model's maps against its vision tower's own eager attention, its output unchanged."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vitlens as vl

tr = pytest.importorskip("transformers")

TOL = 1e-5
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
              patch_size=8)
TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
            vocab_size=128)


def images(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(7))


def idefics3() -> nn.Module:
    return tr.Idefics3Model(tr.Idefics3Config(vision_config=dict(VISION), text_config=dict(model_type="llama", **TEXT),
                                              scale_factor=2))


def smolvlm() -> nn.Module:
    return tr.SmolVLMModel(tr.SmolVLMConfig(vision_config=dict(VISION), text_config=dict(model_type="llama", **TEXT),
                                            scale_factor=2))


def instructblip() -> nn.Module:
    qformer = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                   encoder_hidden_size=32, vocab_size=128)
    text = dict(model_type="opt", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, ffn_dim=64,
                vocab_size=128, word_embed_proj_dim=32)
    return tr.InstructBlipForConditionalGeneration(tr.InstructBlipConfig(
        vision_config=dict(VISION), qformer_config=qformer, text_config=text, num_query_tokens=4))


WHOLE = {"Idefics3Model": idefics3, "SmolVLMModel": smolvlm, "InstructBlipForConditionalGeneration": instructblip}


def eager_tower(tower: nn.Module) -> nn.Module:
    """The vision tower's twin on attn_implementation='eager' (its explicit softmax, output_attentions)."""
    twin = type(tower)._from_config(copy.deepcopy(tower.config), attn_implementation="eager")
    twin.load_state_dict(tower.state_dict())
    return twin.eval()


@pytest.mark.parametrize("key", list(WHOLE))
def test_a_whole_vlm_is_read_at_its_vision_tower_exactly(key):
    """The whole VLM loads, every view runs, the maps equal the tower's eager attention, and the output the views
    score is the tower's own pooled output (a VLM's image features feed its language model and need other inputs),
    unchanged by the capture."""
    torch.manual_seed(0)
    model = WHOLE[key]().eval()
    tower = model.vision_model
    x = images()
    m = vl.LoadedModel.from_module(model, name=key, device="cpu")
    assert m.spec.grid == (4, 4) and m.spec.num_layers == 2
    with torch.no_grad():
        want = eager_tower(tower)(pixel_values=x, output_attentions=True).attentions
        plain = m.logits(x)
        own = tower(pixel_values=x)
        hidden = own.last_hidden_state  # no pooled output: the class token, or the mean token without one
        pooled = own.pooler_output if getattr(own, "pooler_output", None) is not None else \
            hidden[:, 0] if m.spec.num_prefix_tokens else hidden.mean(1)
        assert torch.equal(plain, pooled)
        with vl.capture_attention(m) as cap:
            out = m.logits(x)
    assert torch.equal(out, plain) and len(cap.maps) == 2
    for got, ref in zip(cap.maps, want):
        assert (got - ref).abs().max().item() < TOL
    distance, rollout = vl.attention_distance(m, x), vl.attention_rollout(m, x[:1])
    assert distance.mean_px.shape == (2, 2) and rollout.maps.shape == (1, 4, 4)
    assert len(vl.attention_maps(m, x[:1]).maps) == 2


def test_dinov2_backbone_gives_every_view_and_its_last_feature_map():
    """Depth Anything's backbone: exact against its eager attention; its output is its last feature map (as the
    ViTDet and DINOv3 backbones'), which the capture leaves bit-identical."""
    torch.manual_seed(0)
    model = tr.Dinov2Backbone(tr.Dinov2Config(**VISION, out_features=["stage2"])).eval()
    x = images()
    m = vl.LoadedModel.from_module(model, name="dinov2-backbone", device="cpu")
    assert m.spec.family == "hf-vit" and m.spec.grid == (4, 4) and m.spec.num_prefix_tokens == 1
    with torch.no_grad():
        want = eager_tower(model)(pixel_values=x, output_attentions=True).attentions
        plain = m.logits(x)
        assert torch.equal(plain, model(pixel_values=x).feature_maps[-1]) and plain.shape == (2, 32, 4, 4)
        with vl.capture_attention(m) as cap:
            out = m.logits(x)
    assert torch.equal(out, plain)
    for got, ref in zip(cap.maps, want):
        assert (got - ref).abs().max().item() < TOL
    assert vl.attention_distance(m, x).mean_px.shape == (2, 2)
    assert vl.attention_rollout(m, x[:1]).maps.shape == (1, 4, 4)
    assert len(vl.attention_maps(m, x[:1]).maps) == 2


def test_phi4_multimodal_map_head_is_read_from_its_multihead_attention():
    """Phi-4-multimodal's vision tower pools through a probe and an ``nn.MultiheadAttention`` (no SDPA call): its
    pool map equals the module's own weights (``need_weights=True, average_attn_weights=False``), and the blocks'
    maps come with it."""
    torch.manual_seed(0)
    model = tr.Phi4MultimodalVisionModel(tr.Phi4MultimodalVisionConfig(**VISION)).eval()
    x = images(1)
    m = vl.LoadedModel.from_module(model, name="phi4-vision", device="cpu")
    head = model.head
    seen: list[torch.Tensor] = []

    def weights(mod: nn.Module, args: tuple, kwargs: dict, _out: tuple) -> None:
        _o, w = mod.forward(kwargs["query"], kwargs["key"], kwargs["value"], key_padding_mask=kwargs["key_padding_mask"],
                            need_weights=True, average_attn_weights=False)
        seen.append(w)

    handle = head.attention.register_forward_hook(weights, with_kwargs=True)
    try:
        with torch.no_grad():
            model(pixel_values=x)
    finally:
        handle.remove()
    maps = vl.attention_maps(m, x)
    assert len(maps.maps) == 2 and maps.pool is not None and maps.pool.shape == (2, 1, 16)
    assert abs(maps.pool - seen[0][0].numpy()).max() < TOL
    assert maps.pool_attention().shape == (2, 4, 4)


def depth_anything() -> nn.Module:
    backbone = tr.Dinov2Config(**VISION, out_features=["stage1", "stage2"], reshape_hidden_states=False)
    return tr.DepthAnythingForDepthEstimation(tr.DepthAnythingConfig(
        backbone_config=backbone, fusion_hidden_size=16, neck_hidden_sizes=[8, 16], head_hidden_size=8,
        reassemble_factors=[2, 1]))


def vitpose() -> nn.Module:
    backbone = tr.VitPoseBackboneConfig(**{**VISION, "image_size": [32, 32]}, out_indices=[2])
    return tr.VitPoseForPoseEstimation(tr.VitPoseConfig(backbone_config=backbone))


def dpt() -> nn.Module:
    return tr.DPTForDepthEstimation(tr.DPTConfig(**VISION, backbone_out_indices=[0, 1], neck_hidden_sizes=[8, 16],
                                                 reassemble_factors=[2, 1], fusion_hidden_size=16, head_in_index=-1))


def llava() -> nn.Module:
    return tr.LlavaForConditionalGeneration(tr.LlavaConfig(
        vision_config=tr.CLIPVisionConfig(**VISION), text_config=dict(model_type="llama", **TEXT),
        vision_feature_layer=-1))


def owlvit() -> nn.Module:
    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=128,
                bos_token_id=0, eos_token_id=1, pad_token_id=2)
    return tr.OwlViTForObjectDetection(tr.OwlViTConfig(vision_config=dict(VISION), text_config=text))


#: a whole model, the tower vitlens reads in it (``spec.read_module``) and the family that reads that tower
TOWERS = {
    "DepthAnythingForDepthEstimation": (depth_anything, "backbone (Dinov2Backbone)", "hf-vit"),
    "VitPoseForPoseEstimation": (vitpose, "backbone (VitPoseBackbone)", "generic"),
    "DPTForDepthEstimation": (dpt, "dpt (DPTModel)", "generic"),
    "LlavaForConditionalGeneration": (llava, "model.vision_tower (CLIPVisionModel)", "hf-vit"),
    "OwlViTForObjectDetection": (owlvit, "owlvit.vision_model (OwlViTVisionTransformer)", "generic"),
}


@pytest.mark.parametrize("key", list(TOWERS))
def test_depth_pose_detection_and_vlm_models_are_read_through_their_tower(key):
    """No family reads the whole model; its vision tower is found, named in the spec (and its facts), and read
    exactly: every block's map equals the same tower's eager attention in the whole model's eager twin."""
    build, read, family = TOWERS[key]
    torch.manual_seed(0)
    model = build().eval()
    x = images()
    m = vl.load_model(model, device="cpu")
    assert (m.spec.read_module, m.spec.family, m.spec.grid) == (read, family, (4, 4))
    assert m.spec.describe()["read through"] == read
    twin = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager")
    twin.load_state_dict(model.state_dict())
    with torch.no_grad():
        want = twin.eval().get_submodule(read.split(" ")[0])(pixel_values=x, output_attentions=True).attentions
        plain = m.logits(x)
        with vl.capture_attention(m) as cap:
            out = m.logits(x)
    assert torch.equal(out, plain) and len(cap.maps) == len(want) == 2
    for got, ref in zip(cap.maps, want):
        assert (got - ref).abs().max().item() < TOL
    assert vl.attention_rollout(m, x[:1]).maps.shape == (1, 4, 4)


def test_transformers_wrapper_of_a_timm_model_is_the_timm_model():
    """``TimmWrapperForImageClassification``: read as the timm ViT it wraps (the timm family, its class logits),
    with the same maps as that model loaded alone; the spec names ``timm_model``."""
    torch.manual_seed(0)
    model = tr.TimmWrapperForImageClassification(tr.TimmWrapperConfig(
        architecture="vit_tiny_patch16_224", num_labels=5, model_args=dict(img_size=32, depth=2))).eval()
    m = vl.load_model(model, device="cpu")
    alone = vl.load_model(model.timm_model, device="cpu")
    assert m.spec.family == "timm-vit" and m.spec.read_module == "timm_model (VisionTransformer)"
    assert m.spec.num_classes == 5 and m.spec.grid == (2, 2)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(m.logits(x), model(pixel_values=x).logits)
    a, b = vl.attention_distance(m, x), vl.attention_distance(alone, x)
    assert (a.mean_px == b.mean_px).all()


def test_a_model_with_no_tower_vitlens_reads_keeps_its_own_refusal():
    """A ResNet (no vision tower of a ViT inside): the refusal is the model's own, naming what vitlens reads."""
    timm = pytest.importorskip("timm")
    with pytest.raises(vl.UnsupportedModelError, match="not a Vision Transformer vitlens can read"):
        vl.load_model(timm.create_model("resnet10t", pretrained=False), device="cpu")
