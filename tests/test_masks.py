"""Attention masks in both capture modes, for every family whose attention takes one (issue 31 §1).

A boolean mask means "attend" where True for SDPA, timm and transformers' sdpa masks, and "masked"
where True for ``nn.MultiheadAttention`` (torchvision, OpenCLIP, SigLIP's MAP head); an additive
mask is added to the scores. Each capture is compared with the model's own non-fused / eager
attention given the same mask (within 1e-5: float32 probabilities in [0, 1] of 16-token rows, the
same products summed in another order), and the model's output with side capture is bit-identical
to a run without it (inline: within 1e-5 of it)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import vitlens as vl
from vitlens.errors import UnsupportedModelError
from view_references import layer_recorder, random_sdpa_masks

TOL = 1e-5


def sdpa_masks(b: int, t: int) -> dict[str, torch.Tensor]:
    return random_sdpa_masks(b, t, seed=1)


def close(maps: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    assert len(maps) == len(ref) > 0
    for a, r in zip(maps, ref):
        assert a.shape == r.shape
        assert (a - r).abs().max().item() <= TOL


# --- timm (SDPA semantics: bool True = attend) ---------------------------------------------------------------

def timm_model(kind: str) -> nn.Module:
    import timm

    torch.manual_seed(0)
    if kind == "vit":
        return timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                                 depth=2, num_heads=2, num_classes=5).eval()
    return timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=28, depth=2, num_classes=5).eval()


def timm_eager_maps(model: nn.Module, x: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """timm's own non-fused path with the mask: the probabilities as they enter attn_drop."""
    ref = copy.deepcopy(model)
    maps: list[torch.Tensor] = []
    for block in ref.blocks:
        block.attn.fused_attn = False
        block.attn.attn_drop.register_forward_pre_hook(lambda _m, a: maps.append(a[0].detach().clone()))
    with torch.no_grad():
        ref.forward_features(x, attn_mask=mask)
    return maps


@pytest.mark.parametrize("kind", ["vit", "eva"])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
@pytest.mark.parametrize("mode,rows", [("side", None), ("side", 5), ("inline", None), ("inline", 5)])
def test_timm_masks(kind, mask_kind, mode, rows):
    model = timm_model(kind)
    if kind == "eva" and mode == "inline" and rows:
        pytest.skip("EVA's inline capture makes whole maps (query_rows is for timm's standard Attention)")
    x = torch.randn(2, 3, *model.patch_embed.img_size)
    t = model.num_prefix_tokens + model.patch_embed.num_patches
    mask = sdpa_masks(2, t)[mask_kind]
    with torch.no_grad():
        plain = model.forward_features(x, attn_mask=mask)
    with vl.capture_attention(model, mode=mode, query_rows=rows) as cap, torch.no_grad():
        out = model.forward_features(x, attn_mask=mask)
    close(cap.maps, timm_eager_maps(model, x, mask))
    assert torch.equal(out, plain) if mode == "side" else (out - plain).abs().max().item() <= TOL
    # the mask is honoured: masked keys get exactly zero
    assert all(bool((m[~mask.expand_as(m)] == 0).all()) for m in cap.maps) if mask_kind == "bool" else True


# --- nn.MultiheadAttention (torchvision, OpenCLIP): bool True = masked -------------------------------------

def mha_masks(t: int, b: int, heads: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(2)
    masked = (torch.rand(t, t, generator=g) > 0.6) & ~torch.eye(t, dtype=torch.bool)
    additive = torch.randn(b * heads, t, t, generator=g)
    padding = torch.zeros(b, t, dtype=torch.bool)
    padding[1, -3:] = True
    return {"bool": {"attn_mask": masked}, "additive": {"attn_mask": additive},
            "key_padding": {"key_padding_mask": padding}, "both": {"attn_mask": masked, "key_padding_mask": padding}}


def mha_need_weights(blocks: nn.Module, h: torch.Tensor, masks: dict) -> list[torch.Tensor]:
    """Each block's nn.MultiheadAttention weights (need_weights=True, per head) given the masks."""
    maps = []
    with torch.no_grad():
        for block in blocks:
            y = block.ln_1(h)
            maps.append(block.attn(y, y, y, need_weights=True, average_attn_weights=False, **masks)[1])
            h = _block(block, h, masks)
    return maps


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "key_padding", "both"])
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_open_clip_masks(mask_kind, mode):
    open_clip = pytest.importorskip("open_clip")
    torch.manual_seed(0)
    model = open_clip.model.CLIP(embed_dim=16, vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=2,
                                                               head_width=16),
                                 text_cfg=dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        h = model.visual._embeds(x)
    masks = mha_masks(h.shape[1], 2, 2)[mask_kind]
    ref = mha_need_weights(model.visual.transformer.resblocks, h, masks)
    transformer = model.visual.transformer
    with torch.no_grad():
        plain = _run_blocks(transformer, h, masks)
    with vl.capture_attention(model, mode=mode) as cap, torch.no_grad():
        out = _run_blocks(transformer, h, masks)
    close(cap.maps, ref)
    assert torch.equal(out, plain) if mode == "side" else (out - plain).abs().max().item() <= TOL


def _block(block: nn.Module, h: torch.Tensor, masks: dict) -> torch.Tensor:
    """An open_clip block with the masks handed to its nn.MultiheadAttention as they are (the block's own
    forward casts a boolean attn_mask to float and takes no key_padding_mask)."""
    y = block.ln_1(h)
    h = h + block.ls_1(block.attn(y, y, y, need_weights=False, **masks)[0])
    return h + block.ls_2(block.mlp(block.ln_2(h)))


def _run_blocks(transformer: nn.Module, h: torch.Tensor, masks: dict) -> torch.Tensor:
    for block in transformer.resblocks:
        h = _block(block, h, masks)
    return h


# --- Hugging Face Siglip2, NaFlex packing with padding (sdpa: a boolean mask; eager: additive) ----------------

def siglip2(attn: str) -> nn.Module:
    import transformers as tr

    torch.manual_seed(0)
    cfg = tr.Siglip2VisionConfig(num_patches=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=64, patch_size=8, attn_implementation=attn)
    return tr.Siglip2VisionModel(cfg).eval()


def packed(b: int = 2) -> dict[str, torch.Tensor]:
    """Two images packed to 16 patches: a 4 x 4 grid, and a 3 x 4 grid with 4 padding patches."""
    torch.manual_seed(3)
    mask = torch.ones(b, 16, dtype=torch.long)
    mask[1, 12:] = 0
    return {"pixel_values": torch.randn(b, 16, 8 * 8 * 3), "pixel_attention_mask": mask,
            "spatial_shapes": torch.tensor([[4, 4], [3, 4]])}


def eager_attentions(model: nn.Module, inputs: dict) -> list[torch.Tensor]:
    ref = copy.deepcopy(model)
    for mod in ref.modules():
        if getattr(mod, "config", None) is not None:
            mod.config._attn_implementation = "eager"
    with torch.no_grad():
        return list(ref(**inputs, output_attentions=True).attentions)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["side", "inline"])
def test_siglip2_padding_is_masked(attn, mode):
    pytest.importorskip("transformers")
    model, inputs = siglip2(attn), packed()
    with torch.no_grad():
        plain = model(**inputs).last_hidden_state
    with vl.capture_attention(model, mode=mode) as cap, torch.no_grad():
        out = model(**inputs).last_hidden_state
    ref = eager_attentions(model, inputs)
    close(cap.maps, ref)
    for probs in cap.maps:  # no query puts any weight on the second image's padding keys, as in the model
        assert probs[1, :, :, 12:].abs().max().item() == 0.0
        assert probs[1, :, :, :12].sum(-1).sub(1).abs().max().item() <= TOL
    assert torch.equal(out, plain) if mode == "side" else (out - plain).abs().max().item() <= TOL


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_siglip2_pool_padding_is_masked(attn):
    """SigLIP2's MAP head gets the padding as nn.MultiheadAttention's additive attn_mask: the pool map matches
    the module's own need_weights=True weights given the same arguments."""
    pytest.importorskip("transformers")
    from vitlens.families.pooling import capture_pool_attention

    model, inputs = siglip2(attn), packed()
    seen: list[torch.Tensor] = []

    def reference(mod, args, kwargs, _out):
        kw = {k: v for k, v in kwargs.items() if k not in ("need_weights", "average_attn_weights")}
        with torch.no_grad():
            seen.append(nn.MultiheadAttention.forward(mod, *args, **kw, need_weights=True,
                                                      average_attn_weights=False)[1])

    handle = model.head.attention.register_forward_hook(reference, with_kwargs=True)
    try:
        with capture_pool_attention(model) as pool, torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    close(pool.maps, seen)
    assert pool.maps[0][1, ..., 12:].abs().max().item() == 0.0


def test_views_refuse_packed_padding_in_one_line():
    """A view reads every token as a patch of one grid: fed padded packing it refuses; one grid unpadded, it runs."""
    pytest.importorskip("transformers")
    model = siglip2("sdpa")
    m = vl.LoadedModel.from_module(model, name="siglip2", device="cpu")
    inputs = packed()
    acc = layer_recorder()
    with pytest.raises(UnsupportedModelError, match="packed Siglip2") as err:
        with vl.capture_attention(m, store=False, consumers=[acc]), torch.no_grad():
            model(**inputs)
    assert "\n" not in str(err.value) and acc.layers == []
    inputs["pixel_attention_mask"][:] = 1  # no padding and one grid: the views' own case
    inputs["spatial_shapes"][:] = torch.tensor([4, 4])
    with vl.capture_attention(m, store=False, consumers=[acc]), torch.no_grad():
        model(**inputs)
    assert acc.layers == [0, 1]
