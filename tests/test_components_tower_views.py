"""The logit lens, token norms and activation patching on CLIP, SigLIP and OpenCLIP vision towers (issue 51;
docs/definitions.md, "Logit lens", "Token norms", "Activation patching"): each depth read by hand from the weights,
the last depth equal to the output, each batched patch equal to a patch by hand with plain hooks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import vitlens as vl

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
             patch_size=8)


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "clip":
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection
        m = CLIPVisionModelWithProjection(CLIPVisionConfig(**SMALL, projection_dim=16))
        with torch.no_grad():  # token norms that differ after the pre-norm
            m.vision_model.pre_layrnorm.weight.add_(torch.randn(32))
    elif kind == "siglip":
        from transformers import SiglipVisionConfig, SiglipVisionModel
        m = SiglipVisionModel(SiglipVisionConfig(**SMALL))
    else:
        from open_clip.transformer import VisionTransformer
        m = VisionTransformer(image_size=32, patch_size=8, width=32, layers=2, heads=4, mlp_ratio=2.0, output_dim=16,
                              ls_init_value=0.5)
    return m.double().eval()


@pytest.fixture(scope="module")
def towers() -> dict[str, torch.nn.Module]:
    return {k: build(k) for k in ("clip", "siglip", "openclip")}


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 32, 32, dtype=torch.float64)


def prompts(kind: str) -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(3, 32 if kind == "siglip" else 16, dtype=torch.float64)


def embed(m: torch.nn.Module, kind: str, x: torch.Tensor) -> torch.Tensor:
    return m(x) if kind == "openclip" else (m(pixel_values=x).image_embeds if kind == "clip"
                                              else m(pixel_values=x).pooler_output)


def clip_depths(m: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """CLIP's residual at each depth, the layers called one by one."""
    vm = m.vision_model
    z = vm.pre_layrnorm(vm.embeddings(x))
    out = [z]
    for layer in vm.encoder.layers:
        z = layer(z, None)
        z = z[0] if isinstance(z, tuple) else z
        out.append(z)
    return out


@pytest.mark.parametrize("kind", ["clip", "siglip", "openclip"])
def test_lens_last_depth_is_the_output(towers: dict, pixels: torch.Tensor, kind: str) -> None:
    m, t = towers[kind], prompts(kind)
    r = vl.logit_lens(m, pixels, direction=t, top_k=2)
    with torch.no_grad():
        scores = (embed(m, kind, pixels) @ t.T).numpy()
    np.testing.assert_array_equal(r.target, scores.argmax(-1))
    np.testing.assert_array_equal(r.pooled[:, -1], scores[np.arange(2), r.target])  # the last depth is the output
    np.testing.assert_array_equal(r.output, scores[np.arange(2), r.target])
    assert r.pooled.shape == (2, 3) and r.top_classes.shape == (2, 3, 2)
    assert r.tokens.shape == (2, 3, 16 if kind == "siglip" else 17)


def test_clip_lens_reads_each_depth_by_hand(towers: dict, pixels: torch.Tensor) -> None:
    m, t = towers["clip"], prompts("clip")
    r = vl.logit_lens(m, pixels, direction=t[1])  # one direction: K = 1
    vm, proj = m.vision_model, m.visual_projection.weight
    norm = vm.post_layernorm
    with torch.no_grad():
        depths = clip_depths(m, pixels)
        ln = [F.layer_norm(z, (32,), norm.weight, norm.bias, norm.eps) @ proj.T @ t[1] for z in depths]
    np.testing.assert_allclose(r.pooled, np.stack([v[:, 0].numpy() for v in ln], 1), rtol=1e-12)
    np.testing.assert_allclose(r.tokens, np.stack([v.numpy() for v in ln], 1), rtol=1e-12)
    assert (r.target == 0).all()


def test_tower_token_norms_and_attention(towers: dict, pixels: torch.Tensor) -> None:
    m, x = towers["clip"], pixels
    r = vl.token_norms(m, x, factor=1.02)  # a low bar, so that some tokens are flagged at every depth
    with torch.no_grad():
        depths = clip_depths(m, x)
        norms = torch.stack([z.norm(dim=-1) for z in depths], 1).numpy()
        np.testing.assert_allclose(r.norms, norms, rtol=1e-12)
        med = np.median(norms[:, :, 1:], axis=-1, keepdims=True)
        np.testing.assert_array_equal(r.outliers[..., 1:], norms[..., 1:] > 1.02 * med)
        assert r.outliers[:, 0].any(-1).all() and not r.outliers[..., 0].any()
        lay = m.vision_model.encoder.layers[0]
        h = F.layer_norm(depths[0], (32,), lay.layer_norm1.weight, lay.layer_norm1.bias, lay.layer_norm1.eps)
        q, k = ((h @ p.weight.T + p.bias).reshape(2, -1, 4, 8).transpose(1, 2)
                for p in (lay.self_attn.q_proj, lay.self_attn.k_proj))
        att = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1).mean(1)
        mask = torch.as_tensor(r.outliers[:, 0], dtype=torch.float64)
        np.testing.assert_allclose(r.class_attention[:, 0], (att[:, 0] * mask).sum(-1).numpy(), rtol=1e-12)
        assert (r.class_attention[:, 0] > 0).all()
    assert np.isnan(r.register_attention).all() and r.num_prefix_tokens == 1
    s = vl.token_norms(towers["siglip"], pixels)  # no class token: no class attention
    assert s.num_prefix_tokens == 0 and np.isnan(s.class_attention).all() and s.norms.shape == (2, 3, 16)


def by_hand(m: torch.nn.Module, kind: str, clean: torch.Tensor, corrupted: torch.Tensor, module: torch.nn.Module,
            pre: bool, edit, u: torch.Tensor) -> float:  # noqa: ANN001 - edit(clean_value, corrupted_value)
    """Record ``module``'s output (or input) on the clean image and put it into the corrupted run through ``edit``."""
    kept = {}

    def first(o):  # noqa: ANN001, ANN202
        return o[0] if isinstance(o, tuple) else o

    def swap(o, new):  # noqa: ANN001, ANN202
        return (new, *o[1:]) if isinstance(o, tuple) else new

    if pre:
        h = module.register_forward_pre_hook(lambda mod, args: kept.__setitem__("v", args[0]))
    else:
        h = module.register_forward_hook(lambda mod, args, out: kept.__setitem__("v", first(out)))
    with torch.no_grad():
        embed(m, kind, clean)
    h.remove()
    if pre:
        h = module.register_forward_pre_hook(lambda mod, args: (edit(kept["v"], args[0]),))
    else:
        h = module.register_forward_hook(lambda mod, args, out: swap(out, edit(kept["v"], first(out))))
    with torch.no_grad():
        value = float(embed(m, kind, corrupted)[0] @ u)
    h.remove()
    return value


def mha_by_hand(m: torch.nn.Module, mha: torch.nn.MultiheadAttention, clean: torch.Tensor, corrupted: torch.Tensor,
                h: int, u: torch.Tensor) -> float:
    """One head of an ``nn.MultiheadAttention`` patched by replacing the module's output with the attention written
    out from its weights, head h's slice taken from the clean run."""
    def heads(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (F.linear(x, w, b).reshape(1, -1, 4, 8).transpose(1, 2)
                   for w, b in zip(mha.in_proj_weight.chunk(3), mha.in_proj_bias.chunk(3)))
        return (torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v).transpose(1, 2).reshape(1, -1, 32)
    kept = {}
    hook = mha.register_forward_hook(lambda mod, a, o: kept.__setitem__("c", heads(a[0])))
    with torch.no_grad():
        m(clean)
    hook.remove()

    def patched(mod, a, o):  # noqa: ANN001, ANN202
        c = heads(a[0])
        c[..., h * 8:(h + 1) * 8] = kept["c"][..., h * 8:(h + 1) * 8]
        return (F.linear(c, mha.out_proj.weight, mha.out_proj.bias), None)
    hook = mha.register_forward_hook(patched)
    with torch.no_grad():
        value = float(m(corrupted)[0] @ u)
    hook.remove()
    return value


def one_slice(h: int | None = None, q: int | None = None):  # noqa: ANN201
    def edit(c: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        k = k.clone()
        if h is not None:
            k[..., h * 8:(h + 1) * 8] = c[..., h * 8:(h + 1) * 8]
        else:
            k[:, q] = c[:, q]
        return k
    return edit


@pytest.mark.parametrize("kind", ["clip", "siglip", "openclip"])
def test_tower_patches_equal_patches_by_hand(towers: dict, pixels: torch.Tensor, kind: str) -> None:
    m, t = towers[kind], prompts(kind)
    clean, corrupted = pixels[:1], pixels[1:]
    r = vl.patch_activations(m, clean, corrupted, direction=t, target=2, batch_size=13)
    u = t[2]
    with torch.no_grad():
        assert r.clean == pytest.approx(float(embed(m, kind, clean)[0] @ u), rel=1e-12)
        assert r.corrupted == pytest.approx(float(embed(m, kind, corrupted)[0] @ u), rel=1e-12)
    whole = lambda c, k: c  # noqa: E731
    blocks = (m.transformer.resblocks if kind == "openclip" else m.encoder.layers if kind == "siglip"
              else m.vision_model.encoder.layers)
    for l, blk in enumerate(blocks):
        attn, mlp = (blk.ls_1, blk.ls_2) if kind == "openclip" else (blk.self_attn, blk.mlp)
        if l == 0:
            assert r.attn[l] == pytest.approx(by_hand(m, kind, clean, corrupted, attn, False, whole, u), rel=1e-10)
            assert r.resid[l, 5] == pytest.approx(by_hand(m, kind, clean, corrupted, blk, False, one_slice(q=5), u),
                                                  rel=1e-10)
        else:
            assert r.mlp[l] == pytest.approx(by_hand(m, kind, clean, corrupted, mlp, False, whole, u), rel=1e-10)
        if kind != "openclip":
            assert r.heads[l, 3] == pytest.approx(by_hand(m, kind, clean, corrupted, blk.self_attn.out_proj, True,
                                                          one_slice(h=3), u), rel=1e-10)
        else:  # nn.MultiheadAttention fuses its output projection: by hand, the attention written out
            assert r.heads[l, 3] == pytest.approx(mha_by_hand(m, blk.attn, clean, corrupted, 3, u), rel=1e-9)
    if kind != "siglip":  # SigLIP has no class token: its MAP head reads every token
        assert r.resid[-1, 0] == pytest.approx(r.clean, rel=1e-12)  # the class token's last residual is the answer
