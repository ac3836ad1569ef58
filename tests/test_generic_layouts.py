"""The generic call-level capture's layouts (vitlens/families/layouts.py): global-attention ViTs of Hugging Face
transformers and OpenCLIP that no family names, read at their one scaled_dot_product_attention call per block,
each against its own eager (non-fused) attention; and the refusals that stay."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitlens as vl

from test_generic_capture import numpy_distance, numpy_rollout  # the independent references, one copy

TOL = 1e-5
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
             patch_size=8)


def images(n: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def randomise(model: nn.Module, names: tuple[str, ...]) -> nn.Module:
    """Random values for the parameters random init leaves at zero (relative-position tables, register tokens):
    a zero bias would make any bias handling look exact."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(n in name for n in names):
                p.copy_(torch.randn(p.shape, generator=g))
    return model


# ------------------------------------------------------------------------------------------------ Hugging Face


def hf_dinov3() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.DINOv3ViTModel(transformers.DINOv3ViTConfig(**SMALL, num_register_tokens=2)).eval()


def hf_aimv2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.Aimv2VisionModel(transformers.Aimv2VisionConfig(**SMALL, use_head=True)).eval()


def hf_data2vec() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Data2VecVisionConfig(**SMALL, use_relative_position_bias=True)
    return randomise(transformers.Data2VecVisionModel(cfg), ("relative_position_bias_table",)).eval()


def hf_beit_shared_bias() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.BeitConfig(**SMALL, use_shared_relative_position_bias=True, use_absolute_position_embeddings=True)
    return randomise(transformers.BeitModel(cfg), ("relative_position_bias_table", "position_embeddings")).eval()


def hf_metaclip2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.MetaClip2VisionModel(transformers.MetaClip2VisionConfig(**SMALL)).eval()


def eager_twin(model: nn.Module) -> nn.Module:
    """The same weights on attn_implementation='eager' (transformers' explicit softmax, output_attentions)."""
    twin = type(model)._from_config(copy.deepcopy(model.config), attn_implementation="eager")
    twin.load_state_dict(model.state_dict())
    assert twin.config._attn_implementation == "eager"
    return twin.eval()


def eager_reference(model: nn.Module, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    with torch.no_grad():
        out = eager_twin(model)(pixel_values=x, output_attentions=True)
    assert out.attentions is not None and len(out.attentions) == model.config.num_hidden_layers
    return list(out.attentions), out.last_hidden_state


HF_MODELS = {
    # name: (builder, family, prefix tokens, prefix labels)
    "dinov3": (hf_dinov3, "generic", 3, ("class", "register 1", "register 2")),
    "aimv2": (hf_aimv2, "generic", 0, ()),
    "data2vec": (hf_data2vec, "generic", 1, ("class",)),
    "beit": (hf_beit_shared_bias, "generic", 1, ("class",)),
    "metaclip2": (hf_metaclip2, "hf-vit", 1, ("class",)),
}


@pytest.mark.parametrize("key", list(HF_MODELS))
def test_hf_models_are_exact_against_their_own_eager_attention(key):
    build, family, prefix, labels = HF_MODELS[key]
    model = build()
    assert model.config._attn_implementation == "sdpa"
    x = images()
    want, want_hidden = eager_reference(model, x)
    m = vl.LoadedModel.from_module(model, name=key, device="cpu")
    assert (m.spec.family, m.spec.grid, m.spec.stride_px, m.spec.num_prefix_tokens, m.spec.prefix_labels,
            m.spec.num_heads, m.spec.num_layers) == (family, (4, 4), (8, 8), prefix, labels, 2, 2)
    with torch.no_grad():
        plain, plain_hidden = m.logits(x), model(pixel_values=x).last_hidden_state
    for mode in ("side", "inline"):
        with torch.no_grad(), vl.capture_attention(m, mode=mode) as cap:
            out, hidden = m.logits(x), model(pixel_values=x).last_hidden_state
        if mode == "side":  # the fused forward untouched, bit for bit
            assert torch.equal(out, plain) and torch.equal(hidden, plain_hidden)
        assert (hidden - want_hidden).abs().max().item() < TOL
        assert len(cap.maps) == 2 and cap.maps[0].shape == (2, 2, 16 + prefix, 16 + prefix)
        for got, ref in zip(cap.maps, want):
            assert (got - ref).abs().max().item() < TOL
    if family == "generic":
        assert "generic call-level capture" in repr(m)


def hf_wrappers() -> dict[str, nn.Module]:
    import transformers

    text = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, vocab_size=99,
                max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    return {
        # the vision tower of a model with a text tower: the output is get_image_features
        "Aimv2Model": transformers.Aimv2Model(transformers.Aimv2Config(vision_config=SMALL, text_config=text,
                                                                        projection_dim=16)),
        # a classifier around the base model (its ``beit``): the output is its logits
        "BeitForImageClassification": transformers.BeitForImageClassification(
            transformers.BeitConfig(**SMALL, num_labels=5, use_relative_position_bias=True)),
        # a backbone: the output is its last feature map
        "DINOv3ViTBackbone": transformers.DINOv3ViTBackbone(
            transformers.DINOv3ViTConfig(**SMALL, num_register_tokens=1, out_features=["stage2"])),
    }


def test_hf_wrappers_are_read_at_their_vision_tower():
    x = images()
    shapes = {"Aimv2Model": (2, 16), "BeitForImageClassification": (2, 5), "DINOv3ViTBackbone": (2, 32, 4, 4)}
    for key, model in hf_wrappers().items():
        model.eval()
        m = vl.load_model(model, device="cpu")
        assert m.spec.family == "generic" and m.spec.num_classes == (5 if "Classification" in key else 0)
        with torch.no_grad():
            plain = m.logits(x)
            with vl.capture_attention(m) as cap:
                out = m.logits(x)
        assert tuple(out.shape) == shapes[key] and torch.equal(out, plain) and len(cap.maps) == 2, key


def test_hf_model_inline_keeps_the_maps_in_the_graph():
    m = vl.LoadedModel.from_module(hf_dinov3(), device="cpu")
    x = images(1).requires_grad_(True)
    with vl.capture_attention(m, mode="inline", detach=False) as cap:
        out = m.forward(x)
    assert cap.maps[1].requires_grad
    out[0, 0].backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_rollout_and_distance_of_dinov3_equal_numpy_on_its_eager_maps():
    model = hf_dinov3()
    x = images(3, seed=4)
    want, _ = eager_reference(model, x)
    ref = [a.numpy() for a in want]
    m = vl.LoadedModel.from_module(model, device="cpu")
    result = vl.analyze(m, x, views=("distance", "rollout"))
    np.testing.assert_allclose(result.rollout.maps, numpy_rollout(ref, 3, (4, 4)), rtol=1e-4, atol=1e-6)
    for layer in range(2):
        np.testing.assert_allclose(result.distance.mean_px[layer], numpy_distance(ref[layer], (4, 4), (8, 8), 3),
                                   rtol=1e-4)
    assert m.family.position_table(model, m.spec) is None  # RoPE: no learned table
    assert m.family.pixel_filters(model, m.spec)[1] == "embeddings.patch_embeddings"


@pytest.mark.parametrize("key", ["aimv2", "data2vec", "beit"])
def test_the_paper_views_run_on_each_hf_layout_model(key):
    m = vl.LoadedModel.from_module(HF_MODELS[key][0](), device="cpu")
    result = vl.analyze(m, images(2), views=("distance", "rollout"))
    assert result.rollout.maps.shape == (2, 4, 4) and np.isfinite(result.distance.mean_px).all()


def test_aimv2_attention_pool_is_its_heads_one_sdpa_call():
    from vitlens.families.pooling import capture_pool_attention

    model = hf_aimv2()
    x = images()
    seen: dict[str, torch.Tensor] = {}
    model.head.register_forward_pre_hook(lambda _m, args: seen.__setitem__("h", args[0].detach()))
    m = vl.LoadedModel.from_module(model, device="cpu")
    with torch.no_grad():
        plain = m.logits(x)
        with capture_pool_attention(m) as pool:
            out = m.logits(x)
    assert torch.equal(out, plain)
    head, h = model.head, seen["h"]
    b, t, d = h.shape
    k = head.k_proj(h).reshape(b, t, 2, d // 2).transpose(1, 2)
    q = head.cls_token.reshape(1, 1, 2, d // 2).transpose(1, 2)
    want = ((q @ k.transpose(-2, -1)) / (d // 2) ** 0.5).softmax(-1)
    assert pool.maps[0].shape == (2, 2, 1, 16) and (pool.maps[0] - want).abs().max().item() < TOL


def test_hf_layout_model_on_eager_is_refused_with_the_fix():
    with pytest.raises(vl.UnsupportedModelError, match="attn_implementation='eager'.*load it with "
                                                       "attn_implementation='sdpa'"):
        vl.LoadedModel.from_module(eager_twin(hf_dinov3()), device="cpu")


def test_hf_windowed_models_are_read_by_their_family_or_refused_by_name():
    import transformers

    swin = transformers.SwinModel(transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                                           num_heads=[1, 2], window_size=4))
    assert vl.LoadedModel.from_module(swin, device="cpu").spec.family == "hf-swin"  # its windows, exact
    hiera = transformers.HieraModel(transformers.HieraConfig(embed_dim=8, image_size=[64, 64], patch_size=[7, 7],
                                                             depths=[1, 1], num_heads=[1, 1], num_query_pool=1))
    assert vl.LoadedModel.from_module(hiera, device="cpu").spec.family == "hf-hiera"  # its mask units, exact
    sam = transformers.SamVisionModel(transformers.SamVisionConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=1, image_size=32, patch_size=8, output_channels=8,
        mlp_dim=16, global_attn_indexes=[0]))
    with pytest.raises(vl.UnsupportedModelError, match="SAM"):
        vl.LoadedModel.from_module(sam, device="cpu")


def test_hf_folder_loads_on_sdpa_through_the_hf_prefix(tmp_path):
    model = hf_data2vec()
    eager_twin(model).save_pretrained(tmp_path / "d2v")  # saved from an eager model: hf: loads it on sdpa
    for pretrained in (True, False):
        m = vl.load_model(f"hf:{tmp_path / 'd2v'}", pretrained=pretrained, device="cpu")
        assert m.spec.family == "generic" and m.model.config._attn_implementation == "sdpa"
        assert m.data_config["mean"] == (0.5, 0.5, 0.5)
    x = images()
    with torch.no_grad():
        assert torch.equal(m.logits(x), m.logits(x))
    m = vl.load_model(f"hf:{tmp_path / 'd2v'}", device="cpu")  # the saved weights, exact as the module's
    with torch.no_grad(), vl.capture_attention(m) as cap:
        m.logits(x)
    want, _ = eager_reference(model, x)
    assert max((a - b).abs().max().item() for a, b in zip(cap.maps, want)) < TOL


# ---------------------------------------------------------------------------------------------------- OpenCLIP


def open_clip_tower(**options: object) -> nn.Module:
    from open_clip.transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(image_size=32, patch_size=8, width=32, layers=2, heads=2, mlp_ratio=2.0, output_dim=16,
                             **options).eval()


def open_clip_reference(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """softmax(ln_q(q) ln_k(k)^T / sqrt(d)) from each block's input and open_clip's Attention weights, computed
    here by hand: open_clip 3.3's own non-fused path (use_fsdpa=False) fails on 4-D tensors (torch.bmm)."""
    from vitlens.families.openclip import visual_of

    inputs: list[torch.Tensor] = []
    blocks = visual_of(model).transformer.resblocks
    handles = [b.attn.register_forward_pre_hook(lambda _m, args: inputs.append(args[0].detach())) for b in blocks]
    with torch.no_grad():
        encode = getattr(model, "encode_image", model)
        encode(x)
    for h in handles:
        h.remove()
    maps = []
    with torch.no_grad():
        for block, h in zip(blocks, inputs):
            attn = block.attn
            b, t, c = h.shape
            q, k, _ = F.linear(h, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
            q, k = (z.reshape(b, t, attn.num_heads, -1).transpose(1, 2) for z in (q, k))
            q, k = attn.ln_q(q), attn.ln_k(k)
            maps.append((torch.einsum("bhqd,bhkd->bhqk", q, k) * attn.head_dim ** -0.5).softmax(-1))
    return maps


def open_clip_model(**vision: object) -> nn.Module:
    """A whole (tiny) open_clip CLIP model, its image tower built with ``vision`` options."""
    import open_clip

    torch.manual_seed(0)
    return open_clip.CLIP(embed_dim=16, vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2, head_width=16,
                                                        mlp_ratio=2.0, **vision),
                          text_cfg=dict(context_length=8, vocab_size=64, width=16, heads=2, layers=1)).eval()


OPEN_CLIP_MODELS = {
    "qk_norm": lambda: open_clip_tower(qk_norm=True),
    "head_scale_inner_norm": lambda: open_clip_tower(scale_heads=True, scale_attn_inner=True, scale_attn=True,
                                                     scale_fc=True),
    "clip_qk_norm": lambda: open_clip_model(qk_norm=True),
}


@pytest.mark.parametrize("key", list(OPEN_CLIP_MODELS))
def test_open_clip_attention_blocks_are_exact(key):
    model = OPEN_CLIP_MODELS[key]()
    if key == "head_scale_inner_norm":  # a head scale that is not one, or the output would not show it
        with torch.no_grad():
            for block in model.transformer.resblocks:
                block.attn.head_scale.copy_(torch.tensor([0.5, 2.0]).reshape(2, 1, 1))
    x = images()
    want = open_clip_reference(model, x)
    m = vl.LoadedModel.from_module(model, name=key, device="cpu")
    assert (m.spec.family, m.spec.grid, m.spec.num_prefix_tokens, m.spec.prefix_labels) == \
        ("generic", (4, 4), 1, ("class",))
    assert "generic call-level capture" in repr(m) and m.spec.has_pos_embed
    with torch.no_grad():
        plain = m.logits(x)
    for mode in ("side", "inline"):
        with torch.no_grad(), vl.capture_attention(m, mode=mode) as cap:
            out = m.logits(x)
        assert torch.equal(out, plain) if mode == "side" else (out - plain).abs().max().item() < TOL
        for got, ref in zip(cap.maps, want):
            assert (got - ref).abs().max().item() < TOL
    result = vl.analyze(m, x, views=("distance", "rollout"))
    np.testing.assert_allclose(result.rollout.maps, numpy_rollout([a.numpy() for a in want], 1, (4, 4)),
                               rtol=1e-4, atol=1e-6)
    prefix = "visual." if key.startswith("clip") else ""
    assert m.family.pixel_filters(model, m.spec)[1] == f"{prefix}conv1"


def test_open_clip_scaled_cosine_attention_is_refused_in_one_line():
    with pytest.raises(vl.UnsupportedModelError, match="scaled-cosine attention .* explicit softmax"):
        vl.LoadedModel.from_module(open_clip_tower(scaled_cosine_attn=True), device="cpu")


def coca(kind: object = True) -> nn.Module:
    """A tiny CoCa (open_clip's CoCa class): nn.MultiheadAttention blocks and an attentional pooler. The original
    setup (``True``) with a pooler narrower than the tokens (its separate key projection); open_clip 3.3's
    'parallel' and 'cascade' setups run only with a pooler as wide as the tokens (their ln_post has its width)."""
    import open_clip

    torch.manual_seed(0)
    return open_clip.CoCa(
        embed_dim=16 if kind is True else 32, vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2, head_width=16, mlp_ratio=2.0,
                                      attentional_pool=kind, attn_pooler_heads=2, attn_pooler_queries=4,
                                      output_tokens=True),
        text_cfg=dict(context_length=8, vocab_size=64, width=16, heads=2, layers=1, embed_cls=True,
                      output_tokens=True),
        multimodal_cfg=dict(context_length=8, vocab_size=64, width=16, heads=2, layers=1)).eval()


@pytest.mark.parametrize("kind", [True, "parallel"])
def test_coca_blocks_are_read_and_its_pooler_is_the_pool_attention(kind):
    from vitlens.families.pooling import capture_pool_attention

    model = coca(kind)
    visual = model.visual
    pool = visual.attn_pool if kind is True else visual.attn_pool_contrastive
    x = images()
    seen: list[tuple] = []
    pool.attn.register_forward_pre_hook(lambda _m, args: seen.append(args))
    m = vl.LoadedModel.from_module(model, name="coca", device="cpu")
    assert m.spec.family == "openclip-vit" and m.spec.num_prefix_tokens == 1
    with torch.no_grad():
        plain = m.logits(x)
        with capture_pool_attention(m) as cap, vl.capture_attention(m) as blocks:
            out = m.logits(x)
        assert torch.equal(out, plain)
        query, key, value = seen[-1][:3]
        _, want = pool.attn(query, key, value, need_weights=True, average_attn_weights=False)
    queries = 4 if kind is True else 1
    assert cap.maps[0].shape == (2, 2, queries, 17) and (cap.maps[0] - want).abs().max().item() < TOL
    assert len(blocks.maps) == 2
    rollout = vl.attention_rollout(m, x, source="pool")
    assert rollout.maps.shape == (2, 4, 4) and rollout.source_token == "attention pool"


def test_coca_cascade_pool_is_refused_as_a_pool_but_its_blocks_are_read():
    from vitlens.errors import ViewNotAvailableError
    from vitlens.families.pooling import capture_pool_attention

    m = vl.LoadedModel.from_module(coca("cascade"), device="cpu")
    with pytest.raises(ViewNotAvailableError, match="cascade .* not the image's tokens"):
        with capture_pool_attention(m):
            pass
    with torch.no_grad(), vl.capture_attention(m) as cap:
        m.logits(images())
    assert len(cap.maps) == 2


# ---------------------------------------------------------------------------------------------- token geometry


def test_tokens_out_of_the_prefix_then_row_major_order_are_refused():
    # the token count fits (1 class + 16 patches), the order does not: the class token comes last
    from timm.models.vision_transformer import Attention, VisionTransformer

    class Renamed(Attention):  # an attention class no family names: the generic capture reads it
        pass

    class ClassLast(VisionTransformer):
        def _pos_embed(self, x: torch.Tensor) -> torch.Tensor:
            x = super()._pos_embed(x)
            return torch.cat([x[:, 1:], x[:, :1]], dim=1)

    for cls in (VisionTransformer, ClassLast):
        torch.manual_seed(0)
        model = cls(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3).eval()
        for block in model.blocks:
            block.attn.__class__ = Renamed
        if cls is VisionTransformer:
            assert vl.LoadedModel.from_module(model, device="cpu").spec.family == "generic"
        else:
            with pytest.raises(vl.UnsupportedModelError, match=r"patch \(row 0, column 3\) changed token\(s\) \[3\].*"
                                                                "not token 4.*wrong grid cells"):
                vl.LoadedModel.from_module(model, device="cpu")
