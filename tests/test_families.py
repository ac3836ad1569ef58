"""Works on the user's model: every family x (exact maps, logits unchanged, every view runs,
attribution runs), offline with random-init models built from configs.

Exact maps: side capture equals each family's own reference (timm's non-fused path, Hugging Face's
``eager`` ``output_attentions``, torchvision's ``need_weights=True``) within 1e-5, and inline capture
equals it too; logits with side capture are bit-identical to a plain run."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

import vitlens as vl
from vitlens.errors import WeightsUnavailableError
from conftest import reference_attention


def timm_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return reference_attention(model, x)[0]


def parallel_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """timm's non-fused path of ParallelScalingBlock (the block computes its own attention)."""
    ref = copy.deepcopy(model)
    maps: list[torch.Tensor] = []
    for block in ref.blocks:
        block.fused_attn = False
        block.attn_drop.register_forward_hook(lambda _m, inp, _out: maps.append(inp[0].detach().clone()))
    with torch.no_grad():
        ref(x)
    return maps


def eager_copy(model: nn.Module) -> nn.Module:
    """A copy on transformers' eager attention (every sub-config: CLIP's vision tower has its own)."""
    ref = copy.deepcopy(model)
    for mod in ref.modules():
        if getattr(mod, "config", None) is not None:
            mod.config._attn_implementation = "eager"
    return ref


def hf_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(eager_copy(model)(pixel_values=x, output_attentions=True).attentions)


def hf_tower_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """CLIPModel / SiglipModel: the vision tower's own eager attentions (the text tower is not run)."""
    with torch.no_grad():
        return list(eager_copy(model).vision_model(pixel_values=x, output_attentions=True).attentions)


def mae_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """ViTMAE with mask_ratio 0, handed increasing noise: every patch kept in the image's order."""
    noise = torch.arange(16, dtype=x.dtype).expand(x.shape[0], -1)
    with torch.no_grad():
        out = eager_copy(model)(pixel_values=x, noise=noise, output_attentions=True)
    assert out.ids_restore.equal(torch.arange(16).expand(x.shape[0], -1)) and not out.mask.any()
    return list(out.attentions)


def siglip2_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Siglip2 on patches cut by its image processor's own function, one 4 x 4 grid, no padding."""
    from transformers.models.siglip2.image_processing_siglip2 import convert_image_to_patches

    patches = torch.stack([convert_image_to_patches(xi, 8) for xi in x])
    b, n = patches.shape[:2]
    with torch.no_grad():
        return list(eager_copy(model)(pixel_values=patches, pixel_attention_mask=torch.ones(b, n, dtype=torch.long),
                                      spatial_shapes=torch.tensor([[4, 4]] * b), output_attentions=True).attentions)


def mha_block_maps(h: torch.Tensor, blocks: nn.Module, attention: str) -> list[torch.Tensor]:
    """Pre-norm blocks whose ``attention`` is an nn.MultiheadAttention: its need_weights=True maps, per head."""
    maps = []
    with torch.no_grad():
        for block in blocks:
            y = block.ln_1(h)
            maps.append(getattr(block, attention)(y, y, y, need_weights=True, average_attn_weights=False)[1])
            h = block(h)
    return maps


def torchvision_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    with torch.no_grad():
        h = model._process_input(x)
        h = torch.cat([model.class_token.expand(h.shape[0], -1, -1), h], dim=1) + model.encoder.pos_embedding
    return mha_block_maps(h, model.encoder.layers, "self_attention")


def open_clip_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """open_clip's image blocks: nn.MultiheadAttention with need_weights=True, per head."""
    with torch.no_grad():
        h = model.visual._embeds(x)  # patches, class token, position table, ln_pre
    return mha_block_maps(h, model.visual.transformer.resblocks, "attn")


def open_clip_timm_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    return reference_attention(model.visual.trunk, x)[0]


def tiny_open_clip(timm_trunk: bool = False) -> nn.Module:
    """open_clip's CLIP built small: a 2-block 32 px image tower (or a tiny timm SigLIP trunk, MAP head)."""
    open_clip = pytest.importorskip("open_clip")
    import timm

    text = dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1)
    if not timm_trunk:
        return open_clip.model.CLIP(embed_dim=16, vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2,
                                                                  head_width=16), text_cfg=text)
    model = open_clip.model.CLIP(embed_dim=16, vision_cfg=dict(image_size=32, timm_model_name="vit_tiny_patch16_224",
                                                               timm_pool="map", timm_proj="none"), text_cfg=text)
    model.visual.trunk = timm.create_model("vit_base_patch16_siglip_224", pretrained=False, img_size=32, patch_size=8,
                                           embed_dim=16, depth=2, num_heads=2, num_classes=0, global_pool="map")
    return model


def randomise_relative_bias(model: nn.Module) -> nn.Module:
    """BEiT starts its relative-position tables at zero; give them values so the bias shows."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for block in model.blocks:
            table = block.attn.relative_position_bias_table
            table.copy_(torch.randn(table.shape, generator=g))
    return model


def build(family: str) -> tuple[nn.Module, callable]:
    import timm

    torch.manual_seed(0)
    if family == "timm-beit":
        return randomise_relative_bias(timm.create_model("beit_base_patch16_224", pretrained=False, img_size=64,
                                                         depth=2, embed_dim=64, num_heads=2, num_classes=5)), timm_reference
    if family == "timm-beitv2":
        return randomise_relative_bias(timm.create_model("beitv2_base_patch16_224", pretrained=False, img_size=64,
                                                         depth=2, embed_dim=64, num_heads=2, num_classes=5)), timm_reference
    if family == "timm-eva02":
        return timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=56, depth=2,
                                 num_classes=5), timm_reference
    if family == "timm-eva":
        return timm.create_model("eva_giant_patch14_224", pretrained=False, img_size=56, depth=2, embed_dim=64,
                                 num_heads=2, num_classes=5), timm_reference
    if family == "timm-pe-core":  # Perception Encoder: AttentionRope, class token, MAP head, abs. table + RoPE
        return timm.create_model("vit_pe_core_tiny_patch16_384", pretrained=False, img_size=64, depth=2,
                                 embed_dim=64, num_heads=2, num_classes=5), timm_reference
    if family == "timm-rope-mixed":  # RoPE-Mixed: learned per-block, per-head frequencies, no abs. table
        return timm.create_model("vit_small_patch16_rope_mixed_224", pretrained=False, img_size=64, depth=2,
                                 embed_dim=64, num_heads=2, num_classes=5), timm_reference
    if family == "timm-rope-gqa":  # AttentionRope with separate projections and grouped-query key/value heads
        return timm.create_model("vit_small_patch16_rope_224", pretrained=False, img_size=64, depth=2, embed_dim=64,
                                 num_heads=4, qkv_fused=False, num_kv_heads=2, num_classes=5), timm_reference
    if family == "timm-dinov3":  # DINOv3 port: AttentionRope, DINOv3 RoPE, class token + 4 registers
        return timm.create_model("vit_small_patch16_dinov3", pretrained=False, img_size=64, depth=2, embed_dim=64,
                                 num_heads=2, num_classes=5), timm_reference
    if family == "timm-vit-parallel":  # ViT-22B-style parallel blocks: one fused qkv + MLP projection, qk norm
        return timm.create_model("vit_base_patch16_xp_224", pretrained=False, img_size=64, depth=2, embed_dim=64,
                                 num_heads=2, num_classes=5), parallel_reference
    if family == "timm-vit-subclass":
        from timm.models.vision_transformer import VisionTransformer

        class MyViT(VisionTransformer):
            """A user's fine-tuned copy: same blocks, a different head."""

        return MyViT(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5), timm_reference
    if family.startswith("hf-"):
        import transformers as tr

        common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                      patch_size=8)
        text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64,
                    bos_token_id=0, eos_token_id=1, pad_token_id=1)
        references = {"hf-clip-model": hf_tower_reference, "hf-siglip-model": hf_tower_reference,
                      "hf-vitmae": mae_reference, "hf-siglip2": siglip2_reference}
        patches = {k: v for k, v in common.items() if k != "image_size"}
        model = {
            "hf-clip": lambda: tr.CLIPVisionModel(tr.CLIPVisionConfig(**common)),
            "hf-clip-eager": lambda: tr.CLIPVisionModel(tr.CLIPVisionConfig(attn_implementation="eager", **common)),
            "hf-clip-model": lambda: tr.CLIPModel(tr.CLIPConfig(vision_config=common, text_config=text,
                                                                projection_dim=16)),
            "hf-siglip": lambda: tr.SiglipVisionModel(tr.SiglipVisionConfig(**common)),
            "hf-siglip-eager": lambda: tr.SiglipVisionModel(tr.SiglipVisionConfig(attn_implementation="eager",
                                                                                  **common)),
            "hf-siglip-model": lambda: tr.SiglipModel(tr.SiglipConfig(vision_config=common, text_config=text)),
            "hf-siglip2": lambda: tr.Siglip2VisionModel(tr.Siglip2VisionConfig(num_patches=16, **patches)),
            "hf-ijepa": lambda: tr.IJepaModel(tr.IJepaConfig(**common)),
            "hf-ijepa-cls": lambda: tr.IJepaForImageClassification(tr.IJepaConfig(num_labels=5, **common)),
            "hf-vitmae": lambda: tr.ViTMAEModel(tr.ViTMAEConfig(mask_ratio=0.0, **common)),
            "hf-vit": lambda: tr.ViTForImageClassification(tr.ViTConfig(num_labels=5, **common)),
            "hf-vit-eager": lambda: tr.ViTForImageClassification(tr.ViTConfig(num_labels=5, attn_implementation="eager",
                                                                              **common)),
            "hf-deit": lambda: tr.DeiTForImageClassificationWithTeacher(tr.DeiTConfig(num_labels=5, **common)),
            "hf-dinov2": lambda: tr.Dinov2Model(tr.Dinov2Config(**common)),
            "hf-dinov2-reg": lambda: tr.Dinov2WithRegistersForImageClassification(
                tr.Dinov2WithRegistersConfig(num_register_tokens=4, num_labels=5, **common)),
        }[family]()
        return model.eval(), references.get(family, hf_reference)
    if family == "openclip":
        return tiny_open_clip().eval(), open_clip_reference
    if family == "openclip-timm":
        return tiny_open_clip(timm_trunk=True).eval(), open_clip_timm_reference
    if family == "torchvision":
        from torchvision.models.vision_transformer import VisionTransformer

        return VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
                                 num_classes=5), torchvision_reference
    raise KeyError(family)


FAMILIES = ["timm-beit", "timm-beitv2", "timm-eva02", "timm-eva", "timm-pe-core", "timm-rope-mixed", "timm-rope-gqa",
            "timm-dinov3", "timm-vit-parallel", "timm-vit-subclass", "hf-vit", "hf-vit-eager",
            "hf-deit", "hf-dinov2", "hf-dinov2-reg", "hf-clip", "hf-clip-model", "hf-siglip", "hf-siglip-model",
            "hf-siglip2", "hf-ijepa", "hf-ijepa-cls", "hf-vitmae", "torchvision", "openclip", "openclip-timm"]
#: the same models on transformers' eager attention (the rows above run sdpa, transformers' default): maps only
EAGER = ["hf-clip-eager", "hf-siglip-eager"]
PREFIX = {"hf-deit": 2, "hf-dinov2-reg": 5, "timm-dinov3": 5, "hf-siglip": 0, "hf-siglip-eager": 0,
          "hf-siglip-model": 0,
          "hf-siglip2": 0, "hf-ijepa": 0, "hf-ijepa-cls": 0, "openclip-timm": 0}
#: families without a learned absolute position table, and what the position view says instead
NO_TABLE = {"timm-beit": "relative-position bias", "timm-beitv2": "relative-position bias",
            "timm-rope-mixed": "rotary embeddings", "timm-rope-gqa": "rotary embeddings",
            "timm-dinov3": "rotary embeddings", "hf-vitmae": "sin-cos"}


@pytest.mark.parametrize("family", FAMILIES + EAGER)
def test_maps_are_exact_and_logits_unchanged(family):
    module, reference = build(family)
    m = vl.LoadedModel.from_module(module, name=family, device="cpu")
    assert m.spec.num_prefix_tokens == PREFIX.get(family, 1) == len(m.spec.prefix_labels)
    x = torch.randn(2, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = m.forward(x)
        with vl.capture_attention(m) as side:
            captured = m.forward(x)
        with vl.capture_attention(m, mode="inline") as inline:
            m.forward(x)
    assert torch.equal(plain, captured), "side capture changed the output"
    want = reference(m.model, x)
    t = m.spec.num_prefix_tokens + m.spec.grid[0] * m.spec.grid[1]
    assert len(side.maps) == len(want) == m.spec.num_layers
    for got_side, got_inline, ref in zip(side.maps, inline.maps, want):
        assert got_side.shape == (2, m.spec.num_heads, t, t)
        torch.testing.assert_close(got_side, ref.float(), atol=1e-5, rtol=0)
        torch.testing.assert_close(got_inline.float(), ref.float(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_view_and_an_attribution_run(family):
    module, _ = build(family)
    m = vl.LoadedModel.from_module(module, name=family, device="cpu")
    x = torch.randn(3, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(2))
    r = vl.analyze(m, x, batch_size=2, n_components=3)
    assert r.distance.mean_px.shape == (m.spec.num_layers, m.spec.num_heads) and np.isfinite(r.distance.mean_px).all()
    assert r.rollout.maps.shape == (3, *m.spec.grid)
    assert r.filters.components.shape[0] == 3
    if family in NO_TABLE:
        assert r.position is None and NO_TABLE[family] in r.position_note
    else:
        assert r.position is not None and r.position.similarity.shape == (*m.spec.grid, *m.spec.grid)
    if m.spec.num_classes:
        for method in ("grad_rollout", "saliency"):
            a = vl.attribute(m, x, method=method)
            assert a.maps.shape == (3, *m.spec.grid) and np.isfinite(a.maps).all()
        assert r.rollout.predictions.tolist() == m.logits(x).argmax(-1).tolist()
    else:
        assert (r.rollout.predictions == -1).all()  # a feature model predicts nothing


def test_eva_without_a_learned_position_table_says_so_in_the_position_view():
    import timm

    model = timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=56, depth=1, use_abs_pos_emb=False)
    m = vl.LoadedModel.from_module(model, name="eva02-rope-only", device="cpu")
    with pytest.raises(vl.ViewNotAvailableError, match="rotary embeddings"):
        vl.position_similarity(m)
    assert "rotary embeddings" in vl.analyze(m, torch.randn(1, 3, 56, 56), n_components=2).position_note


@pytest.mark.parametrize("name,what", [("mvitv2_small_cls", "MViT v2 with a class token"), ("xcit_nano_12_p16_224", "XCiT"),
                                       ("naflexvit_base_patch16_gap", "NaFlexViT")])
def test_remaining_refusals_name_what_is_unsupported(name, what):
    with pytest.raises(vl.UnsupportedModelError, match=what):
        vl.load_model(name, pretrained=False)


def test_a_module_vitlens_does_not_understand_is_refused_naming_its_first_block():
    from timm.models.vision_transformer import Block, VisionTransformer

    class MyBlock(Block):
        pass

    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, block_fn=MyBlock)
    with pytest.raises(vl.UnsupportedModelError, match="block 0 is a MyBlock"):
        vl.LoadedModel.from_module(model)
    with pytest.raises(vl.UnsupportedModelError, match="not a Vision Transformer"):
        vl.LoadedModel.from_module(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten()))


def test_hugging_face_models_load_from_a_folder_offline_with_their_processor(tmp_path):
    import json

    import transformers as tr

    model = tr.ViTForImageClassification(tr.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                      intermediate_size=64, image_size=32, patch_size=8, num_labels=3,
                                                      id2label={0: "cat", 1: "dog", 2: "fox"}))
    model.save_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "do_resize": True, "size": {"height": 32, "width": 32}, "resample": 2,
        "image_mean": [0.1, 0.2, 0.3], "image_std": [0.4, 0.5, 0.6]}))
    m = vl.load_model(f"hf:{tmp_path}", device="cpu")
    assert m.spec.family == "hf-vit" and m.spec.grid == (4, 4) and m.label_names() == ["cat", "dog", "fox"]
    assert m.data_config["mean"] == (0.1, 0.2, 0.3) and m.data_config["interpolation"] == "bilinear"
    x = torch.randn(1, 3, 32, 32)
    assert torch.equal(m.logits(x), model.eval()(pixel_values=x).logits)
    assert vl.analyze(m, vl.sample_images()[:1], n_components=2).rollout.predicted_labels[0] in ("cat", "dog", "fox")


def test_hub_and_torchvision_weights_offline_fail_fast_with_a_way_out(monkeypatch):
    import time

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(WeightsUnavailableError, match="not in the local cache"):
        vl.load_model("hf:google/vit-base-patch16-224")
    with pytest.raises(WeightsUnavailableError, match="pretrained=False"):
        vl.load_model("torchvision:vit_b_16")
    assert time.monotonic() - t0 < 5
    m = vl.load_model("torchvision:vit_b_32", pretrained=False, device="cpu")
    assert m.spec.family == "torchvision-vit" and m.spec.grid == (7, 7) and m.spec.num_classes == 1000
    with pytest.raises(vl.UnknownModelError, match="vit_b_16"):
        vl.load_model("torchvision:resnet50")


@pytest.mark.parametrize("package,name,extra", [("transformers", "hf:google/vit-base-patch16-224", "hf"),
                                                ("open_clip", "open_clip:ViT-B-32", "openclip")])
def test_without_an_optional_package_the_message_says_how_to_get_it(monkeypatch, package, name, extra):
    import builtins

    real_import = builtins.__import__

    def without(module, *args, **kwargs):
        if module == package or module.startswith(package + "."):
            raise ImportError(f"No module named {package!r}")
        return real_import(module, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    with pytest.raises(vl.UnsupportedModelError, match=rf"pip install 'vitlens\[{extra}\]'"):
        vl.load_model(name)


def test_parallel_blocks_expose_their_blocks_and_where_their_heads_meet():
    import timm

    model = timm.create_model("vit_base_patch16_xp_224", pretrained=False, img_size=32, patch_size=16, depth=2,
                              embed_dim=32, num_heads=2, num_classes=3)
    m = vl.LoadedModel.from_module(model, name="xp", device="cpu")
    attns = m.family.attention_modules(m.model)
    assert [m.family.head_outputs(a) for a in attns] == [b.attn_out_proj for b in model.blocks]
    names = {id(mod): n for n, mod in model.named_modules()}
    assert [names[id(a)].rsplit(".", 1)[0] for a in attns] == ["blocks.0", "blocks.1"]
    assert vl.head_importance(m, torch.randn(2, 3, 32, 32), batch_size=2).logit_drop.shape == (2, 2)


def test_clip_and_mae_checkpoints_load_from_a_folder_as_vitlens_reads_them(tmp_path):
    import json

    import transformers as tr

    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=8)
    clip = tr.CLIPModel(tr.CLIPConfig(vision_config=common, projection_dim=16, text_config=dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=1)))
    clip.save_pretrained(tmp_path / "clip")
    (tmp_path / "clip" / "preprocessor_config.json").write_text(json.dumps({
        "do_resize": True, "size": {"shortest_edge": 32}, "do_center_crop": True,
        "crop_size": {"height": 32, "width": 32}, "resample": 3, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711]}))
    m = vl.load_model(f"hf:{tmp_path / 'clip'}", device="cpu")
    assert type(m.model).__name__ == "CLIPModel" and m.model.text_model is not None  # the text tower stays
    assert m.spec.num_layers == 2 and m.spec.grid == (4, 4) and m.data_config["crop_mode"] == "center"
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():  # the projected image embedding of the checkpoint as transformers loads it
        want = tr.CLIPModel.from_pretrained(tmp_path / "clip").eval().get_image_features(pixel_values=x).pooler_output
    assert torch.equal(m.logits(x), want)

    mae = tr.ViTMAEModel(tr.ViTMAEConfig(**common))  # mask_ratio 0.75, as MAE checkpoints are saved
    with pytest.raises(vl.UnsupportedModelError, match="mask_ratio"):
        vl.LoadedModel.from_module(copy.deepcopy(mae))
    mae.save_pretrained(tmp_path / "mae")
    m = vl.load_model(f"hf:{tmp_path / 'mae'}", device="cpu")
    assert m.model.config.mask_ratio == 0.0 and m.spec.num_prefix_tokens == 1
    with vl.capture_attention(m) as cap:
        m.logits(x)
    assert cap.maps[0].shape == (1, 2, 17, 17)  # every patch, behind the class token


def test_open_clip_names_load_random_or_from_the_local_cache_only(tmp_path, monkeypatch):
    import json

    open_clip = pytest.importorskip("open_clip")
    import huggingface_hub
    from open_clip import pretrained as oc_pretrained

    (tmp_path / "vitlens-tiny.json").write_text(json.dumps({
        "embed_dim": 16, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 2, "head_width": 16},
        "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}}))
    open_clip.add_model_config(tmp_path / "vitlens-tiny.json")
    m = vl.load_model("open_clip:vitlens-tiny", device="cpu")
    assert m.spec.family == "openclip-vit" and m.source == "random init" and m.spec.grid == (4, 4)
    assert m.model.transformer is not None  # the text tower stays
    with pytest.raises(vl.UnknownModelError, match="no architecture"):
        vl.load_model("open_clip:ViT-B-99")
    with pytest.raises(WeightsUnavailableError, match="local cache"):
        vl.load_model("open_clip:ViT-B-32/laion2b_s34b_b79k")

    # a tag whose weights are in the hub cache: loaded from that file, with the tag's preprocessing
    weights = open_clip.create_model("vitlens-tiny", pretrained=None)
    torch.save(weights.state_dict(), tmp_path / "open_clip_pytorch_model.bin")
    monkeypatch.setitem(oc_pretrained._PRETRAINED, "vitlens-tiny", {"tiny": {
        "hf_hub": "vitlens/tiny/", "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}})
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name, **_: str(
        tmp_path / name) if (repo, name) == ("vitlens/tiny", "open_clip_pytorch_model.bin") else None)
    m = vl.load_model("open_clip:vitlens-tiny/tiny", device="cpu")
    assert m.source.endswith("open_clip_pytorch_model.bin") and m.data_config["mean"] == (0.5, 0.5, 0.5)
    loaded = m.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in weights.state_dict().items())

    custom = open_clip.model.CLIP(embed_dim=16, vision_cfg={**json.loads(
        (tmp_path / "vitlens-tiny.json").read_text())["vision_cfg"], "qk_norm": True}, text_cfg=dict(
        context_length=8, vocab_size=64, width=32, heads=2, layers=1))
    # open_clip's own Attention (qk-norm): not the openclip-vit family's, read by the generic call-level capture
    # (tests/test_generic_layouts.py checks it exact)
    assert vl.LoadedModel.from_module(custom, device="cpu").spec.family == "generic"


def timm_pool_reference(pool: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm AttentionPoolLatent's non-fused scores, written out: its latent queries over every token."""
    b, n, _ = x.shape
    if pool.pos_embed is not None:
        x = x + pool.pos_embed.unsqueeze(0)
    q = pool.q(pool.latent.expand(b, -1, -1)).reshape(b, pool.latent_len, pool.num_heads, pool.head_dim).transpose(1, 2)
    k = pool.kv(x).reshape(b, n, 2, pool.num_heads, pool.head_dim).permute(2, 0, 3, 1, 4)[0]
    q, k = pool.q_norm(q), pool.k_norm(k)
    return ((q * pool.scale) @ k.transpose(-2, -1)).softmax(dim=-1)


def hf_pool_reference(head: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """SigLIP's MAP head: its nn.MultiheadAttention's own per-head weights (need_weights, not averaged)."""
    probe = head.probe.repeat(x.shape[0], 1, 1)
    return head.attention(probe, x, x, need_weights=True, average_attn_weights=False)[1]


@pytest.mark.parametrize("family", ["timm-siglip-map", "timm-pe-core", "hf-siglip", "hf-siglip2", "openclip-timm"])
def test_map_heads_show_their_own_attention_exactly(family):
    from vitlens.families.pooling import capture_pool_attention

    if family == "timm-siglip-map":
        import timm

        torch.manual_seed(0)
        module = timm.create_model("vit_base_patch16_siglip_224", pretrained=False, img_size=32, patch_size=8,
                                   embed_dim=32, depth=2, num_heads=2, num_classes=5)
    else:
        module = build(family)[0]
    m = vl.LoadedModel.from_module(module, name=family, device="cpu")
    if family.startswith("hf-"):
        pool, reference = vl.families.hf.vision_tower(m.model).head, hf_pool_reference
    else:
        pool, reference = (m.model.visual.trunk if family.startswith("openclip") else m.model).attn_pool, \
            timm_pool_reference
    seen = []
    handle = pool.register_forward_pre_hook(lambda _mod, args: seen.append(args[0]))
    x = torch.randn(2, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        plain = m.forward(x)
        with capture_pool_attention(m) as cap:
            captured = m.forward(x)
        want = reference(pool, seen[0])
    handle.remove()
    assert torch.equal(plain, captured), "pool capture changed the output"
    t = m.spec.num_prefix_tokens + m.spec.grid[0] * m.spec.grid[1]
    assert cap.maps[0].shape == want.shape == (2, want.shape[1], want.shape[2], t)
    torch.testing.assert_close(cap.maps[0], want.float(), atol=1e-5, rtol=0)
    assert cap.patch_maps(m.spec).shape == (*want.shape[:3], *m.spec.grid)


def test_models_without_a_map_head_say_there_is_no_pool_attention():
    from vitlens.families.pooling import capture_pool_attention

    m = vl.LoadedModel.from_module(build("timm-vit-subclass")[0], device="cpu")
    with pytest.raises(vl.ViewNotAvailableError, match="no pool attention"):
        with capture_pool_attention(m):
            pass


@pytest.mark.parametrize("family", ["hf-siglip", "timm-pe-core"])
def test_attention_maps_carry_the_pool_attention_of_map_heads(family):
    """The Attention maps view's pool query: the pool's own probabilities of the same forward, its probe over the
    patch tokens on their grid (PE-Core: a class token too, which the pool reads and the grid leaves out)."""
    from vitlens.families.pooling import capture_pool_attention

    m = vl.LoadedModel.from_module(build(family)[0], name=family, device="cpu")
    x = torch.randn(1, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(4))
    r = vl.attention_maps(m, x)
    with torch.no_grad(), capture_pool_attention(m) as cap:
        m.forward(x)
    np.testing.assert_allclose(r.pool, cap.maps[0][0].numpy(), atol=1e-6)
    np.testing.assert_allclose(r.pool_attention(0), cap.patch_maps(m.spec)[0, :, 0].numpy(), atol=1e-6)
    assert r.maps.shape[0] == m.spec.num_layers and "attention pool" in r.summary()
    plain = vl.attention_maps(vl.LoadedModel.from_module(build("timm-vit-subclass")[0], device="cpu"),
                              torch.zeros(1, 3, 32, 32))
    assert plain.pool is None
    with pytest.raises(vl.ViewNotAvailableError, match="no pool attention"):
        plain.pool_attention()


def test_hugging_face_classifiers_on_clip_and_siglip_towers_ablate_heads_at_their_out_proj():
    import transformers as tr

    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=8)
    model = tr.CLIPForImageClassification(tr.CLIPConfig(vision_config=common, num_labels=3, text_config=dict(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=64,
        bos_token_id=0, eos_token_id=1, pad_token_id=1)))
    m = vl.LoadedModel.from_module(model, device="cpu")
    assert m.spec.num_classes == 3 and m.spec.num_layers == 2
    assert [m.family.head_outputs(a) for a in m.family.attention_modules(m.model)] == \
        [layer.self_attn.out_proj for layer in model.vision_model.encoder.layers]
    assert vl.head_importance(m, torch.randn(2, 3, 32, 32), batch_size=2).logit_drop.shape == (2, 2)


@pytest.mark.parametrize("family", ["hf-siglip", "timm-pe-core"])
def test_rollout_can_start_from_the_attention_pools_row(family):
    """source="pool": v = the pool's probabilities (heads mean-fused, queries averaged), then v A'_L ... A'_1, the
    chain written out here with the full matrices; source_token says the pool was used."""
    from vitlens.families.pooling import capture_pool_attention

    m = vl.LoadedModel.from_module(build(family)[0], name=family, device="cpu")
    x = torch.randn(2, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(5))
    r = vl.attention_rollout(m, x, source="pool")
    with torch.no_grad(), vl.capture_attention(m) as cap, capture_pool_attention(m) as pool:
        m.forward(x)
    v = pool.maps[0].double().mean(dim=(1, 2))  # [B, T]
    eye = torch.eye(v.shape[-1], dtype=torch.float64)
    for a in reversed(cap.maps):
        a = a.double().mean(1) + eye
        v = torch.bmm(v.unsqueeze(1), a / a.sum(-1, keepdim=True)).squeeze(1)
    want = v[:, m.spec.num_prefix_tokens:]
    want = (want / want.amax(-1, keepdim=True)).reshape(2, *m.spec.grid).numpy()
    np.testing.assert_allclose(r.maps, want, atol=1e-6)
    assert r.source_token == "attention pool"
    default = vl.attention_rollout(m, x)
    assert default.source_token == ("class token" if m.spec.has_class_token else "mean over patch tokens")
    assert not np.allclose(default.maps, r.maps)
    with pytest.raises(vl.ViewNotAvailableError, match="no pool attention"):
        vl.attention_rollout(vl.LoadedModel.from_module(build("timm-vit-subclass")[0], device="cpu"),
                             torch.zeros(1, 3, 32, 32), source="pool")
