"""Mean-ablation (issue 51; docs/definitions.md, "Mean-ablation"): a component whose contribution is the same on
every image changes nothing when ablated; any ablation equals one made by hand with plain forward hooks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import VisionTransformer

import vitlens as vl

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5)


@pytest.fixture(scope="module")
def model() -> VisionTransformer:
    torch.manual_seed(0)
    m = VisionTransformer(**SMALL, init_values=0.5).double().eval()
    with torch.no_grad():
        m.blocks[0].attn.qkv.weight[2 * 32 + 8:2 * 32 + 16] = 0  # head 2 of block 1: values are their bias alone
        m.blocks[1].mlp.fc2.weight.zero_()  # block 2's MLP writes its bias alone
    return m


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(5, 3, 32, 32, dtype=torch.float64)


def test_a_constant_component_changes_nothing(model: VisionTransformer, pixels: torch.Tensor) -> None:
    for parts in ([("head", 0, 1)], [("mlp", 1)], [("head", 0, 1), ("mlp", 1)]):
        r = vl.mean_ablate(model, pixels, parts)
        np.testing.assert_allclose(r.after, r.before, rtol=1e-12, atol=1e-12)
        assert (r.predicted_after == r.predicted_before).all()
    r = vl.mean_ablate(model, pixels, [("head", 0, 0)])  # a head that reads its input does change the output
    assert np.abs(r.after - r.before).max() > 1e-6


def by_hand(m: VisionTransformer, x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Head 4 of block 1 (the projection's input slice), block 1's MLP and block 2 as a whole, their means over
    ``ref`` from a plain run, then put in with plain hooks."""
    kept = {}
    b1, b2 = m.blocks
    hs = [b1.attn.proj.register_forward_pre_hook(lambda mod, a: kept.__setitem__("head", a[0][..., 24:32].mean(0))),
          b1.ls2.register_forward_hook(lambda mod, a, o: kept.__setitem__("mlp", o.mean(0))),
          b2.register_forward_hook(lambda mod, a, o: kept.__setitem__("layer", (o - a[0]).mean(0)))]
    with torch.no_grad():
        m(ref)
    for h in hs:
        h.remove()

    def head(mod, a):  # noqa: ANN001, ANN202
        t = a[0].clone()
        t[..., 24:32] = kept["head"]
        return (t,)
    hs = [b1.attn.proj.register_forward_pre_hook(head),
          b1.ls2.register_forward_hook(lambda mod, a, o: kept["mlp"].expand_as(o)),
          b2.register_forward_hook(lambda mod, a, o: a[0] + kept["layer"])]
    with torch.no_grad():
        out = m(x)
    for h in hs:
        h.remove()
    return out


def test_equals_an_ablation_by_hand(model: VisionTransformer, pixels: torch.Tensor) -> None:
    x, ref = pixels[:3], pixels[1:]
    r = vl.mean_ablate(model, x, [("head", 0, 3), ("mlp", 0), ("layer", 1)], labels=[0, 1, 2], reference=ref)
    want = by_hand(model, x, ref)
    with torch.no_grad():
        plain = model(x)
    np.testing.assert_allclose(r.after, want[np.arange(3), [0, 1, 2]].numpy(), rtol=1e-12)
    np.testing.assert_allclose(r.before, plain[np.arange(3), [0, 1, 2]].numpy(), rtol=1e-12)
    np.testing.assert_array_equal(r.predicted_after, want.argmax(-1).numpy())
    acc = r.accuracy()
    assert acc == ((plain.argmax(-1) == torch.tensor([0, 1, 2])).double().mean().item(),
                   (want.argmax(-1) == torch.tensor([0, 1, 2])).double().mean().item())
    assert r.components == ["head 1.4", "mlp 1", "layer 2"] and r.reference_images == 4
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in model.modules())


def test_on_a_clip_tower_with_zero_shot_scores(pixels: torch.Tensor, tmp_path) -> None:
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(0)
    m = CLIPVisionModelWithProjection(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, image_size=32, patch_size=8,
                                                       projection_dim=16)).double().eval()
    texts = torch.randn(3, 16, dtype=torch.float64)
    r = vl.mean_ablate(m, pixels, [("head", 1, 2), ("layer", 0)], direction=texts)
    lay0, lay1 = m.vision_model.encoder.layers
    kept = {}
    keep_head = lambda mod, a: kept.__setitem__("h", a[0][..., 16:24].mean(0))  # noqa: E731
    hs = [lay1.self_attn.out_proj.register_forward_pre_hook(keep_head),
          lay0.register_forward_hook(lambda mod, a, o: kept.__setitem__("l", (o - a[0]).mean(0)))]
    with torch.no_grad():
        plain = m(pixel_values=pixels).image_embeds
    for h in hs:
        h.remove()

    def head(mod, a):  # noqa: ANN001, ANN202
        t = a[0].clone()
        t[..., 16:24] = kept["h"]
        return (t,)
    hs = [lay1.self_attn.out_proj.register_forward_pre_hook(head),
          lay0.register_forward_hook(lambda mod, a, o: a[0] + kept["l"])]
    with torch.no_grad():
        ablated = m(pixel_values=pixels).image_embeds
    for h in hs:
        h.remove()
    unit = torch.nn.functional.normalize
    cos = lambda e: unit(e, dim=-1) @ unit(texts, dim=-1).T  # noqa: E731
    target = cos(plain).argmax(-1)
    np.testing.assert_allclose(r.before, cos(plain)[np.arange(5), target].numpy(), rtol=1e-12)
    np.testing.assert_allclose(r.after, cos(ablated)[np.arange(5), target].numpy(), rtol=1e-12)
    assert r.score == "cosine" and np.isnan(r.accuracy()[0]) and "mean-ablating" in r.summary()
    back = vl.load_result(r.save(tmp_path / "abl.npz"))
    assert type(back) is type(r) and back.equals(r) and len(r.to_rows()) == 5
    np.testing.assert_allclose(r.to_pandas().change.to_numpy(), r.after - r.before)
    from vitlens import figures
    np.testing.assert_allclose(np.asarray(figures.figure_for(r).data[0].y), r.after)


def test_bad_components_are_refused(model: VisionTransformer, pixels: torch.Tensor) -> None:
    for bad in ([("head", 0)], [("mlp", 7)], [("attn", 0)], []):
        with pytest.raises(vl.InvalidParameterError):
            vl.mean_ablate(model, pixels, bad)


def test_an_openclip_head_through_its_fused_attention(pixels: torch.Tensor) -> None:
    from open_clip.transformer import VisionTransformer as OpenCLIPViT
    import torch.nn.functional as F

    torch.manual_seed(0)
    m = OpenCLIPViT(image_size=32, patch_size=8, width=32, layers=2, heads=4, mlp_ratio=2.0, output_dim=16).double()
    m = m.eval()
    texts = torch.randn(3, 16, dtype=torch.float64)
    r = vl.mean_ablate(m, pixels, [("head", 1, 2)], direction=texts)
    mha = m.transformer.resblocks[1].attn

    def heads(x: torch.Tensor) -> torch.Tensor:  # the attention written out from the weights
        q, k, v = (F.linear(x, w, b).reshape(x.shape[0], -1, 4, 8).transpose(1, 2)
                   for w, b in zip(mha.in_proj_weight.chunk(3), mha.in_proj_bias.chunk(3)))
        return (torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v).transpose(1, 2).flatten(2)
    kept = {}
    hook = mha.register_forward_hook(lambda mod, a, o: kept.__setitem__("mean", heads(a[0])[..., 16:24].mean(0)))
    with torch.no_grad():
        m(pixels)
    hook.remove()

    def ablated(mod, a, o):  # noqa: ANN001, ANN202
        c = heads(a[0])
        c[..., 16:24] = kept["mean"]
        return (F.linear(c, mha.out_proj.weight, mha.out_proj.bias), None)
    hook = mha.register_forward_hook(ablated)
    with torch.no_grad():
        emb = m(pixels)
    hook.remove()
    cos = F.normalize(emb, dim=-1) @ F.normalize(texts, dim=-1).T
    np.testing.assert_allclose(r.after, cos[np.arange(5), r.target].numpy(), rtol=1e-9)
