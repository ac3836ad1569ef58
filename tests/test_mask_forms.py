"""Masks in every attention class and every form a mask comes in, and packed Siglip2 inputs (what
``test_masks.py`` leaves out).

Both capture modes for the attention classes ``test_masks.py`` does not build (timm's ``ParallelScalingBlock``
and ``AttentionRope``, timm's MAP head given a mask, torchvision's ``nn.MultiheadAttention``), and a Hugging
Face attention handed its mask in each form transformers makes one: boolean [B, 1, T, T] (sdpa), additive
(eager), a [B, T] padding mask (flash attention's form, through an implementation registered here) and an
object that is not a tensor (flex attention's ``BlockMask``: side capture refuses in one line, inline is
exact). Each map is compared with the model's own non-fused / eager attention given the same mask within
1e-5 (float32 probabilities in [0, 1] over at most 20 keys); side capture leaves the output bit for bit,
inline within 1e-5. The views refuse a packed Siglip2 batch whose images have other grids, padding or not,
and read the views' own Siglip2 inputs (one square grid) exactly.
"""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
from torch import nn

import vitlens as vl
from view_references import layer_recorder, max_diff, mean_distance, random_sdpa_masks, set_attention
from vitlens.errors import UnsupportedModelError

TOL = 1e-5


def sdpa_masks(b: int, t: int) -> dict[str, torch.Tensor]:
    return random_sdpa_masks(b, t, seed=7)


# --- timm: ParallelScalingBlock and AttentionRope (SDPA semantics: bool True = attend) ------------------------

@functools.lru_cache(maxsize=None)
def timm_model(kind: str) -> nn.Module:
    """Built once per session (no test changes it: references are deep copies)."""
    import timm
    from timm.models.vision_transformer import ParallelScalingBlock, VisionTransformer

    torch.manual_seed(0)
    if kind == "parallel":
        return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                                 block_fn=ParallelScalingBlock).eval()
    return timm.create_model("vit_small_patch16_rope_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                             depth=2, num_heads=2, num_classes=5).eval()


def timm_eager_maps(model: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """The probabilities of timm's own non-fused path given the mask, as they enter attn_drop."""
    ref = copy.deepcopy(model)
    maps: list[torch.Tensor] = []
    for block in ref.blocks:
        owner = block.attn if hasattr(block, "attn") else block  # a parallel block computes its attention itself
        owner.fused_attn = False
        owner.attn_drop.register_forward_pre_hook(lambda _m, a: maps.append(a[0].detach().clone()))
    with torch.no_grad():
        ref.forward_features(x, attn_mask=mask)
    return maps


@pytest.mark.parametrize("kind", ["parallel", "rope"])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("mode,rows", [("side", None), ("side", 7), ("inline", None)])
def test_timm_parallel_and_rope_masks(kind, mask_kind, mode, rows):
    model = timm_model(kind)
    assert type(model.blocks[0].attn if kind == "rope" else model.blocks[0]).__name__ in ("AttentionRope",
                                                                                           "ParallelScalingBlock")
    x = torch.randn(2, 3, 32, 32)
    mask = sdpa_masks(2, model.num_prefix_tokens + model.patch_embed.num_patches)[mask_kind]
    with torch.no_grad():
        plain = model.forward_features(x, attn_mask=mask)
    with vl.capture_attention(model, mode=mode, query_rows=rows) as cap, torch.no_grad():
        out = model.forward_features(x, attn_mask=mask)
    assert max_diff(cap.maps, timm_eager_maps(model, x, mask)) <= TOL
    assert torch.equal(out, plain) if mode == "side" else (out - plain).abs().max().item() <= TOL
    keep = mask if mask_kind == "bool" else torch.isfinite(mask)
    for probs in cap.maps:  # the masked keys get exactly zero
        assert bool((probs[~keep.expand_as(probs)] == 0).all())


# --- timm's MAP head given a mask --------------------------------------------------------------------------

@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("registers", [0, 4])
def test_timm_map_pool_with_a_mask(mask_kind, registers):
    """The pool's map against the pool's own fused SDPA output: the captured probabilities times its values
    are the attention output its ``proj`` receives (timm's non-fused pool path adds a boolean mask as 0/1,
    so SDPA, the path the model runs, is the reference), and against q k^T by hand."""
    from timm.models.vision_transformer import VisionTransformer

    from vitlens.families.pooling import capture_pool_attention

    torch.manual_seed(0)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=5,
                              class_token=False, reg_tokens=registers, global_pool="map", no_embed_class=True).eval()
    pool = model.attn_pool
    assert pool.fused_attn
    n = 16  # the pool reads the patch tokens only (behind registers too)
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(2, 1, 1, n, generator=g) > 0.3
    keep[..., 0] = True
    mask = keep if mask_kind == "bool" else torch.randn(2, 1, 1, n, generator=g)
    tokens = torch.randn(2, n, 32)
    attended: list[torch.Tensor] = []
    pool.proj.register_forward_pre_hook(lambda _m, a: attended.append(a[0].detach().clone()))
    with torch.no_grad():
        plain = pool(tokens, attn_mask=mask)
    with capture_pool_attention(model) as cap, torch.no_grad():
        out = pool(tokens, attn_mask=mask)
    assert torch.equal(out, plain)
    probs = cap.maps[0]
    assert probs.shape == (2, 2, 1, registers + n)
    assert probs[..., :registers].abs().max().item() == 0.0 if registers else True
    probs = probs[..., registers:]
    with torch.no_grad():
        b, h, d = 2, pool.num_heads, pool.head_dim
        q = pool.q_norm(pool.q(pool.latent.expand(b, -1, -1)).reshape(b, -1, h, d).transpose(1, 2))
        k, v = pool.kv(tokens).reshape(b, n, 2, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        k = pool.k_norm(k)
        bias = torch.zeros(mask.shape).masked_fill(~mask, float("-inf")) if mask_kind == "bool" else mask
        by_hand = ((q * pool.scale) @ k.transpose(-2, -1) + bias).softmax(-1)
        assert (probs - by_hand).abs().max().item() <= TOL
        used = (probs @ v).transpose(1, 2).reshape(b, -1, h * d)
    assert (used - attended[-1]).abs().max().item() <= TOL
    if mask_kind == "bool":
        assert bool((probs[~mask.expand_as(probs)] == 0).all())


# --- torchvision: nn.MultiheadAttention (bool True = masked) -----------------------------------------------

@pytest.mark.parametrize("mask_kind", ["bool", "additive", "key_padding"])
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_torchvision_masks(mask_kind, mode):
    tv = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    model = tv.models.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32,
                                        mlp_dim=64, num_classes=5).eval()
    t = 17
    g = torch.Generator().manual_seed(5)
    masks = {"bool": {"attn_mask": (torch.rand(t, t, generator=g) > 0.6) & ~torch.eye(t, dtype=torch.bool)},
             "additive": {"attn_mask": torch.randn(2 * 2, t, t, generator=g)},
             "key_padding": {"key_padding_mask": torch.arange(t).expand(2, t) >= torch.tensor([[t], [t - 5]])}}
    kw = masks[mask_kind]
    y = torch.randn(2, t, 32)
    mhas = [block.self_attention for block in model.encoder.layers]
    with torch.no_grad():
        ref = [mha(y, y, y, need_weights=True, average_attn_weights=False, **kw)[1] for mha in mhas]
        plain = [mha(y, y, y, need_weights=False, **kw)[0] for mha in mhas]
    with vl.capture_attention(model, mode=mode) as cap, torch.no_grad():
        out = [mha(y, y, y, need_weights=False, **kw)[0] for mha in mhas]
    assert max_diff(cap.maps, ref) <= TOL
    for a, b in zip(out, plain):
        assert torch.equal(a, b) if mode == "side" else (a - b).abs().max().item() <= TOL
    if mask_kind == "key_padding":
        assert all(m[1, ..., t - 5:].abs().max().item() == 0.0 for m in cap.maps)


# --- Hugging Face: the mask in each form transformers hands an attention function ---------------------------

FORMS = ("sdpa", "eager", "vitlens_test_padding_2d", "vitlens_test_opaque")


class Opaque:
    """A mask that is no tensor, as flex attention's BlockMask (the real one takes seconds to compile on CPU)."""

    def __init__(self, additive: torch.Tensor) -> None:
        self.additive = additive


def _register_forms() -> None:
    """Two attention implementations for the test: one handed the [B, T] padding mask flash attention gets,
    one handed an object; both compute transformers' eager attention from it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.models.siglip2.modeling_siglip2 import eager_attention_forward

    def padding_2d(module, q, k, v, attention_mask, **kw):
        add = None
        if attention_mask is not None:
            assert attention_mask.dim() == 2  # flash attention's [B, T] (True = a real token)
            add = torch.zeros(attention_mask.shape, dtype=q.dtype).masked_fill(~attention_mask.bool(),
                                                                                torch.finfo(q.dtype).min)
            add = add[:, None, None, :]
        return eager_attention_forward(module, q, k, v, add, **kw)

    def opaque_mask(**kw):
        mask = ALL_MASK_ATTENTION_FUNCTIONS["eager"](**kw)
        return None if mask is None else Opaque(mask)

    def opaque(module, q, k, v, attention_mask, **kw):
        return eager_attention_forward(module, q, k, v, None if attention_mask is None else attention_mask.additive,
                                       **kw)

    AttentionInterface.register("vitlens_test_padding_2d", padding_2d)
    AttentionMaskInterface.register("vitlens_test_padding_2d", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    AttentionInterface.register("vitlens_test_opaque", opaque)
    AttentionMaskInterface.register("vitlens_test_opaque", opaque_mask)




@functools.lru_cache(maxsize=None)
def siglip2(implementation: str) -> nn.Module:
    """Built once per session (no test changes it: references are deep copies)."""
    tr = pytest.importorskip("transformers")
    _register_forms()
    torch.manual_seed(0)
    cfg = tr.Siglip2VisionConfig(num_patches=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, patch_size=8, vision_use_head=False, attn_implementation="eager")
    return set_attention(tr.Siglip2VisionModel(cfg).eval(), implementation)


def packed() -> dict[str, torch.Tensor]:
    """Three images packed to 16 patches: 4 x 4, 3 x 4 (4 padding patches), 2 x 5 (6 padding patches)."""
    torch.manual_seed(3)
    mask = torch.ones(3, 16, dtype=torch.long)
    mask[1, 12:] = 0
    mask[2, 10:] = 0
    return {"pixel_values": torch.randn(3, 16, 8 * 8 * 3), "pixel_attention_mask": mask,
            "spatial_shapes": torch.tensor([[4, 4], [3, 4], [2, 5]])}


def eager_reference(model: nn.Module, inputs: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    ref = set_attention(copy.deepcopy(model), "eager")
    with torch.no_grad():
        out = ref(**inputs, output_attentions=True)
    return list(out.attentions), out.last_hidden_state


def masks_handed(model: nn.Module, inputs: dict) -> list[str]:
    """What each attention module is handed as its mask, in words."""
    seen: list[str] = []

    def pre(_m, args, kwargs):
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        seen.append(type(mask).__name__ if not isinstance(mask, torch.Tensor) else f"{mask.dtype} {mask.dim()}-D")

    handles = [layer.self_attn.register_forward_pre_hook(pre, with_kwargs=True)
               for layer in model.encoder.layers]
    with torch.no_grad():
        model(**inputs)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_hf_masks_in_every_form(form, mode):
    model, inputs = siglip2(form), packed()
    handed = masks_handed(model, inputs)[0]
    assert handed == {"sdpa": "torch.bool 4-D", "eager": "torch.float32 4-D", "vitlens_test_padding_2d": "torch.bool 2-D",
                      "vitlens_test_opaque": "Opaque"}[form]
    ref, ref_out = eager_reference(model, inputs)
    with torch.no_grad():
        plain = model(**inputs).last_hidden_state
    assert (plain - ref_out).abs().max().item() <= TOL  # each form is the same attention
    if form == "vitlens_test_opaque" and mode == "side":
        with pytest.raises(UnsupportedModelError, match="mode='inline'") as err:
            with vl.capture_attention(model, mode=mode), torch.no_grad():
                model(**inputs)
        assert "\n" not in str(err.value)
        return
    with vl.capture_attention(model, mode=mode) as cap, torch.no_grad():
        out = model(**inputs).last_hidden_state
    assert max_diff(cap.maps, ref) <= TOL
    assert torch.equal(out, plain) if mode == "side" else (out - plain).abs().max().item() <= TOL
    for probs in cap.maps:  # padding keys get exactly zero, every query's weight lies on its own image
        assert probs[1, ..., 12:].abs().max().item() == 0.0 and probs[2, ..., 10:].abs().max().item() == 0.0
        assert (probs[2, ..., :10].sum(-1) - 1).abs().max().item() <= TOL


def test_a_boolean_mask_added_as_a_bias_would_be_caught():
    """The regression this guards: sdpa's boolean mask added as 0/1 (the old side capture) puts weight on the
    padding keys, far beyond the tolerance of the comparison above."""
    from vitlens.core.attention import attention_probs

    model, inputs = siglip2("sdpa"), packed()
    ref, _ = eager_reference(model, inputs)
    attn = model.encoder.layers[0].self_attn
    seen: dict[str, torch.Tensor] = {}
    attn.q_proj.register_forward_hook(lambda _m, _i, o: seen.__setitem__("q", o))
    attn.k_proj.register_forward_hook(lambda _m, _i, o: seen.__setitem__("k", o))
    attn.register_forward_pre_hook(lambda _m, a, kw: seen.__setitem__("mask", kw["attention_mask"]), with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
    q, k = (seen[n].view(3, 16, 2, 16).transpose(1, 2) for n in ("q", "k"))
    right = attention_probs(q, k, attn.scale, seen["mask"], scale_after=True)
    as_bias = attention_probs(q, k, attn.scale, seen["mask"].float(), scale_after=True)
    assert (right - ref[0]).abs().max().item() <= TOL
    assert (as_bias - ref[0]).abs().max().item() > 1e-2


# --- the views and packed Siglip2 inputs ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["side", "inline"])
@pytest.mark.parametrize("shapes,padding", [([[4, 4], [2, 8]], False), ([[4, 4], [3, 4]], True),
                                            ([[2, 8], [2, 8]], False)])
def test_views_read_one_unpadded_grid_only(mode, shapes, padding):
    """A view reads every token as a patch of one grid: packed images of other grids (padded or not) are refused
    in one line before any block is read; a batch of one grid and no padding is the views' own case."""
    model = siglip2("sdpa")
    m = vl.LoadedModel.from_module(model, name="siglip2", device="cpu")
    inputs = {k: v[:2].clone() for k, v in packed().items()}
    inputs["spatial_shapes"] = torch.tensor(shapes)
    inputs["pixel_attention_mask"][:] = 1
    if padding:
        inputs["pixel_attention_mask"][1, 12:] = 0
    seen = layer_recorder()
    refused = len({tuple(s) for s in shapes}) > 1 or padding
    if refused:
        with pytest.raises(UnsupportedModelError, match="packed Siglip2") as err:
            with vl.capture_attention(m, store=False, consumers=[seen], mode=mode), torch.no_grad():
                model(**inputs)
        assert "\n" not in str(err.value) and seen.layers == []
    else:
        with vl.capture_attention(m, store=False, consumers=[seen], mode=mode), torch.no_grad():
            model(**inputs)
        assert seen.layers == [0, 1]
    with vl.capture_attention(m, mode=mode) as cap, torch.no_grad():  # capture itself reads any packing, exactly
        model(**inputs)
    assert max_diff(cap.maps, eager_reference(model, inputs)[0]) <= TOL


def test_views_run_siglip2_from_images():
    """The views' own Siglip2 inputs (one square grid, no padding) pass the packing check, and the distance they
    read is that of the model's own eager attention over those inputs (4 x 4 patches of 8 px, no prefix token)."""
    from vitlens.families.hf import model_inputs

    model = siglip2("sdpa")
    m = vl.LoadedModel.from_module(model, name="siglip2", device="cpu")
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(11))
    result = vl.attention_distance(m, x)
    assert result.grid == (4, 4) and result.stride_px == (8, 8) and result.n_images == 2
    ref, _ = eager_reference(model, model_inputs(model, x))
    want = mean_distance(ref, (4, 4), (8, 8), 0)
    assert result.mean_px.shape == want.shape == (2, 2)
    np.testing.assert_allclose(result.mean_px, want, rtol=0, atol=1e-4)  # maps within 1e-5 over 16 keys < 43 px
