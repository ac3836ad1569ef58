"""Issue 64: towers that crashed are read exactly or refused in one line. Qwen2-VL's tower (2-D RoPE, no position
table) loaded without a size is read at 224 px, exact against its own attention written out in float64 from each
block's input (sharpened: large random ``qkv`` weights, so a wrong token order shows); towers whose forward needs
what vitlens cannot know (text, a dataset index, window blocks) are refused in one line naming it."""
from __future__ import annotations

import pytest
import torch

import vitlens as vl
from test_any_vit_round3b import qwen_vl_float64

transformers = pytest.importorskip("transformers")

TOL = 1e-5


def qwen2vl_tower(seed: int = 0) -> torch.nn.Module:
    """A tiny random Qwen2-VL tower (patch 16, merge 2) with large random qkv weights (attention far from uniform)."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    cfg = transformers.Qwen2VLVisionConfig(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2,
                                           patch_size=16, spatial_merge_size=2)
    torch.manual_seed(seed)
    model = Qwen2VisionTransformerPretrainedModel._from_config(cfg, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight.normal_(0.0, 0.5, generator=g)
    return model


def qwen2vl_reference(model: torch.nn.Module, m: vl.LoadedModel, x: torch.Tensor) -> list[torch.Tensor]:
    """Each block's attention in float64 from its own input (``qwen_vl_float64`` with transformers' own Qwen2-VL
    ``apply_rotary_pos_emb_vision``), in the model's own (2x2 merge-block) token order."""
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    return qwen_vl_float64(model, lambda: m.forward(x), apply_rotary_pos_emb_vision)


def test_qwen2vl_tower_without_a_size_is_read_at_224px_exact_against_its_own_attention():
    from vitlens.core.tokens import merge_block_layout

    model = qwen2vl_tower()
    m = vl.LoadedModel.from_module(model, name="qwen2vl", device="cpu")  # crashed: no num_position_embeddings
    assert (m.spec.family, m.spec.image_size, m.spec.grid, m.spec.num_prefix_tokens) == ("generic", (224, 224),
                                                                                          (14, 14), 0)
    x = torch.randn(2, 3, 224, 224, generator=torch.Generator().manual_seed(3))
    order = merge_block_layout((14, 14)).canonical_order()
    want = [a[..., order, :][..., order] for a in qwen2vl_reference(model, m, x)]
    assert max(a.max().item() for a in want) > 0.5  # sharpened: a wrong order cannot hide in flat maps
    with torch.no_grad():
        plain = m.forward(x)
        with vl.capture_attention(m, mode="side") as cap:
            out = m.forward(x)
    assert torch.equal(out, plain) and len(cap.maps) == 2
    for got, ref in zip(cap.maps, want):
        assert got.shape == (2, 2, 196, 196)
        assert (got.double() - ref).abs().max().item() < TOL


def _omni() -> torch.nn.Module:
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniVisionEncoder

    cfg = transformers.Qwen2_5OmniVisionEncoderConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=64,
                                                      patch_size=8, spatial_merge_size=2, out_hidden_size=32,
                                                      fullatt_block_indexes=[1], window_size=32)
    return Qwen2_5OmniVisionEncoder._from_config(cfg, attn_implementation="sdpa")


def _vitpose_two_experts() -> torch.nn.Module:
    cfg = transformers.VitPoseBackboneConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
                                             intermediate_size=64, patch_size=8, image_size=[32, 32], num_experts=2,
                                             part_features=8, out_indices=[2])
    return transformers.VitPoseBackbone._from_config(cfg, attn_implementation="sdpa")


def _vilt() -> torch.nn.Module:
    cfg = transformers.ViltConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  patch_size=8, image_size=32, vocab_size=64)
    return transformers.ViltModel._from_config(cfg)


REFUSED = {
    "qwen2.5-omni": (_omni, "attends in windows of 32 px"),
    "vitpose-two-experts": (_vitpose_two_experts, "2 experts .*dataset_index"),
    "vilt": (_vilt, "embeds text and image .*input_ids"),
}


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_towers_needing_what_vitlens_cannot_know_are_refused_in_one_line_naming_it(key):
    build, says = REFUSED[key]
    for size in (None, (3, 64, 64)):  # crashed (AttributeError, ValueError) or was refused for a false reason
        with pytest.raises(vl.UnsupportedModelError, match=says) as refusal:
            vl.LoadedModel.from_module(build(), name=key, device="cpu",
                                       data_config={"input_size": size} if size else None)
        assert "\n" not in str(refusal.value)


def _sharpened(tower: torch.nn.Module, factor: float = 4.0) -> torch.nn.Module:
    """A CLIP-style tower's queries and keys scaled (attention far from uniform, so a wrong tower or order shows)."""
    with torch.no_grad():
        for name, weight in tower.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "query.weight", "key.weight")):
                weight.mul_(factor)
    return tower


def test_video_llava_given_images_reads_its_image_tower_exactly():
    from test_whole_models import TEXT, VISION, eager_tower

    cfg = transformers.VideoLlavaConfig(vision_config=dict(VISION, projection_dim=32), text_config=dict(TEXT),
                                        vision_feature_layer=-1)
    torch.manual_seed(0)
    model = transformers.VideoLlavaForConditionalGeneration._from_config(cfg, attn_implementation="sdpa").eval()
    image, video = _sharpened(model.model.image_tower), _sharpened(model.model.video_tower)
    m = vl.LoadedModel.from_module(model, name="video-llava", device="cpu")
    assert m.spec.read_module == "model.image_tower (CLIPVisionModel)"  # was model.video_tower
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = eager_tower(image)(pixel_values=x, output_attentions=True).attentions
        other = eager_tower(video)(pixel_values=x, output_attentions=True).attentions
        with vl.capture_attention(m) as cap:
            m.logits(x)
    assert len(cap.maps) == 2
    for got, ref, wrong in zip(cap.maps, want, other):
        assert (got - ref).abs().max().item() < TOL
        assert (got - wrong).abs().max().item() > 0.1  # the two towers' maps differ: reading the other one shows


def _pixio(n_cls: int = 8) -> torch.nn.Module:
    cfg = transformers.PixioConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                   image_size=32, patch_size=8, n_cls_tokens=n_cls)
    torch.manual_seed(0)
    return _sharpened(transformers.PixioModel._from_config(cfg, attn_implementation="sdpa").eval())


def test_pixio_class_tokens_stated_by_its_config_are_its_prefix_exact_against_eager():
    from test_whole_models import eager_tower

    model = _pixio()
    m = vl.LoadedModel.from_module(model, name="pixio", device="cpu")  # was refused: 24 tokens are not 16 + 1
    assert (m.spec.grid, m.spec.num_prefix_tokens) == ((4, 4), 8)
    assert m.spec.prefix_labels == tuple(f"class {i}" for i in range(1, 9))
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        want = eager_tower(model)(pixel_values=x, output_attentions=True).attentions
        plain = m.forward(x)
        with vl.capture_attention(m) as cap:
            out = m.forward(x)
    assert torch.equal(out, plain) and len(cap.maps) == 2
    for got, ref in zip(cap.maps, want):
        assert got.shape == (2, 2, 24, 24) and (got - ref).abs().max().item() < TOL


def test_a_prefix_count_the_config_states_but_the_model_does_not_make_is_refused():
    model = _pixio()
    model.config.n_cls_tokens = 4  # the embedding still makes 8 class tokens
    with pytest.raises(vl.UnsupportedModelError, match="24 tokens.*plus 4 prefix tokens"):
        vl.LoadedModel.from_module(model, name="pixio", device="cpu")


def _timm_classifiers() -> dict[str, torch.nn.Module]:
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    gemma = timm.create_model("gemma4_vit_167m", pretrained=False, patch_size=8, embed_dim=32, depth=2, num_heads=2,
                              head_dim=16, intermediate_size=64, pooling_kernel_size=2, position_embedding_size=16,
                              num_classes=5).eval()
    qwen = timm.create_model("qwen3_vit_88m", pretrained=False, img_size=32, patch_size=8, embed_dim=32, depth=2,
                             num_heads=2, num_classes=5).eval()
    for model in (gemma, qwen):
        with torch.no_grad():
            for name, weight in model.encoder.blocks.named_parameters():
                if name.endswith(("qkv.weight", "q_norm.weight", "k_norm.weight")):  # gemma4: q, k normed
                    weight.mul_(3.0)  # sharpened: a wrong token order cannot hide in flat maps
    return {"gemma4": gemma, "qwen3": qwen}


@pytest.mark.parametrize("key", ["gemma4", "qwen3"])
def test_timm_vit_classifiers_are_read_through_their_encoder_with_their_own_logits(key):
    from test_patch_embeddings import _own_eager_maps

    model = _timm_classifiers()[key]
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    want, want_out = _own_eager_maps(model, x, [b.attn for b in model.encoder.blocks])
    m = vl.LoadedModel.from_module(model, name=key, device="cpu", data_config={"input_size": (3, 32, 32)})
    assert (m.spec.family, m.spec.read_module, m.spec.grid, m.spec.num_classes) == ("generic", "", (4, 4), 5)
    with torch.no_grad():
        plain = model(x)
        with vl.capture_attention(m) as cap:
            out = m.logits(x)
    assert out.shape == (2, 5) and torch.equal(out, plain)  # the classifier's logits, not the encoder's features
    assert (out - want_out).abs().max().item() < TOL and len(cap.maps) == 2
    for got, ref in zip(cap.maps, want):
        assert got.shape == (2, 2, 16, 16) and (got - ref).abs().max().item() < TOL


def test_an_openclip_tower_on_a_timm_swin_gets_the_windowed_views_of_its_trunk():
    """Distance and rollout refused it ("its family (openclip-timm) attends globally"); now they follow the trunk:
    the same numbers as the trunk loaded alone (the timm Swin family's, exact against Swin's own attention in
    tests/test_swin.py), and the maps equal the trunk's, sharpened."""
    import numpy as np

    open_clip = pytest.importorskip("open_clip")
    timm = pytest.importorskip("timm")
    text = dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1)
    torch.manual_seed(0)
    vision = dict(image_size=64, timm_model_name="swin_tiny_patch4_window7_224", timm_pool="avg", timm_proj="none")
    model = open_clip.model.CLIP(embed_dim=16, vision_cfg=vision, text_cfg=text)
    model.visual.trunk = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, img_size=64, patch_size=4,
                                           window_size=4, embed_dim=16, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 2),
                                           num_classes=0)
    with torch.no_grad():
        for name, weight in model.visual.trunk.named_parameters():
            if name.endswith("qkv.weight"):
                weight.mul_(3.0)
    m = vl.LoadedModel.from_module(model, name="oc-swin", device="cpu")
    alone = vl.LoadedModel.from_module(model.visual.trunk, name="swin", device="cpu")
    assert (m.family.name, m.spec.kind, m.spec.family) == ("openclip-timm-windowed", "hierarchical",
                                                           "openclip-timm-windowed:timm-swin")
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), vl.capture_attention(m) as cap:
        m.forward(x)
    with torch.no_grad(), vl.capture_attention(alone) as ref:
        alone.forward(x)
    assert len(cap.maps) == len(ref.maps) == 5
    for got, want in zip(cap.maps, ref.maps):
        assert torch.equal(got, want)
    distance, want_distance = vl.attention_distance(m, x), vl.attention_distance(alone, x)
    np.testing.assert_allclose(distance.mean_px, want_distance.mean_px, rtol=0, atol=1e-9)
    rollout, want_rollout = vl.attention_rollout(m, x[:1]), vl.attention_rollout(alone, x[:1])
    np.testing.assert_allclose(rollout.maps, want_rollout.maps, rtol=0, atol=1e-9)


def test_mgpstr_eager_only_tower_is_read_at_its_softmax_exact_against_its_own_attentions():
    cfg = transformers.MgpstrConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, mlp_ratio=2.0,
                                    patch_size=8, image_size=[32, 64], max_token_length=8)
    torch.manual_seed(0)
    model = transformers.MgpstrModel._from_config(cfg).eval()
    with torch.no_grad():
        for block in model.encoder.blocks:  # sharpened: large random qkv weights
            block.attn.qkv.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(1))
    m = vl.LoadedModel.from_module(model, name="mgp-str", device="cpu")  # was refused: blocks in an nn.Sequential
    assert (m.spec.family, m.spec.grid, m.spec.num_prefix_tokens) == ("generic", (4, 8), 1)
    x = torch.randn(2, 3, 32, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        own = model(pixel_values=x, output_attentions=True)
        with vl.capture_attention(m) as cap:
            out = m.forward(x)
    assert len(cap.maps) == 2 and max(a.max().item() for a in own.attentions) > 0.5
    assert torch.equal(out, own.last_hidden_state[:, 0])  # its output: the class token, unchanged by the capture
    for got, ref in zip(cap.maps, own.attentions):
        assert got.shape == (2, 2, 33, 33) and (got - ref).abs().max().item() < TOL
