"""Direct contributions on the Hugging Face ViT, DINOv2 and SigLIP towers and torchvision's ViT (issue 51;
docs/definitions.md, "Direct contributions"): every part equals a hand computation from the weights in plain torch
(the forward written out, each part read through the held final norm and the family's own readout applied forward),
and the ledger closes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vitlens.components import decompose
from vitlens.errors import UnsupportedModelError

HF = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)


def noisy(m: torch.nn.Module) -> torch.nn.Module:
    """Float64, eval, and non-trivial norms, biases, layer scales and heads, so that every term is tested."""
    torch.manual_seed(0)
    m = m.double().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if any(w in name for w in ("norm", "ln", "lambda", "head", "classifier", "probe")) or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return m


def build(kind: str) -> torch.nn.Module:
    import transformers as tf
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    if kind == "vit-cls":
        return noisy(tf.ViTForImageClassification(tf.ViTConfig(**HF, intermediate_size=64, num_labels=5)))
    if kind == "vit":
        return noisy(tf.ViTModel(tf.ViTConfig(**HF, intermediate_size=64)))
    if kind == "dinov2":
        return noisy(tf.Dinov2Model(tf.Dinov2Config(**HF, mlp_ratio=2, layerscale_value=0.5)))
    if kind == "dinov2-cls":
        return noisy(tf.Dinov2ForImageClassification(tf.Dinov2Config(**HF, mlp_ratio=2, num_labels=5,
                                                                      use_swiglu_ffn=True)))
    if kind == "siglip":
        return noisy(tf.SiglipVisionModel(tf.SiglipVisionConfig(**HF, intermediate_size=64)))
    return noisy(VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64,
                                   num_classes=5))


def weights(m: torch.nn.Module, kind: str) -> dict:
    """The tower's weights by role, read off the model (independently of vitlens's plans)."""
    if kind == "torchvision":
        layers = []
        for l in m.encoder.layers:
            wq, wk, wv = l.self_attention.in_proj_weight.chunk(3)
            bq, bk, bv = l.self_attention.in_proj_bias.chunk(3)
            layers.append(dict(ln1=l.ln_1, q=(wq, bq), k=(wk, bk), v=(wv, bv), o=l.self_attention.out_proj,
                               gamma=None, ln2=l.ln_2, mlp=l.mlp))
        return dict(conv=m.conv_proj, cls=m.class_token[0], pos=m.encoder.pos_embedding[0], layers=layers,
                    norm=m.encoder.ln)
    if kind == "siglip":
        layers = [dict(ln1=l.layer_norm1, q=(l.self_attn.q_proj.weight, l.self_attn.q_proj.bias),
                       k=(l.self_attn.k_proj.weight, l.self_attn.k_proj.bias),
                       v=(l.self_attn.v_proj.weight, l.self_attn.v_proj.bias), o=l.self_attn.out_proj, gamma=None,
                       ln2=l.layer_norm2, mlp=l.mlp) for l in m.encoder.layers]
        return dict(conv=m.embeddings.patch_embedding, cls=None, pos=m.embeddings.position_embedding.weight,
                    layers=layers, norm=m.post_layernorm)
    vm = getattr(m, "vit", None) or getattr(m, "dinov2", None) or m
    dino = kind.startswith("dinov2")
    layers = []
    for l in (vm.encoder.layer if dino else vm.layers):
        a = l.attention
        layers.append(dict(ln1=l.norm1 if dino else l.layernorm_before, q=(a.q_proj.weight, a.q_proj.bias),
                           k=(a.k_proj.weight, a.k_proj.bias), v=(a.v_proj.weight, a.v_proj.bias), o=a.o_proj,
                           gamma=l.layer_scale1.lambda1 if dino else None, ln2=l.norm2 if dino else l.layernorm_after,
                           mlp=(lambda t, l=l: l.layer_scale2(l.mlp(t))) if dino else l.mlp))
    return dict(conv=vm.embeddings.patch_embeddings.projection, cls=vm.embeddings.cls_token[0],
                pos=vm.embeddings.position_embeddings[0], layers=layers, norm=vm.layernorm)


def ln(norm: torch.nn.Module, t: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(t, (t.shape[-1],), norm.weight, norm.bias, norm.eps)


def hand(m: torch.nn.Module, kind: str, x: torch.Tensor, u: torch.Tensor) -> dict[str, torch.Tensor]:
    """The forward written out; each write read forward through the held final norm and the readout: ``R(w)``."""
    w = weights(m, kind)
    b, d, h, dh = x.shape[0], 32, 4, 8
    patch = F.conv2d(x, w["conv"].weight, w["conv"].bias, stride=8).flatten(2).transpose(1, 2)
    p = 0 if w["cls"] is None else 1
    zeros = torch.zeros(b, p, d, dtype=x.dtype)
    pos = w["pos"].expand(b, -1, -1)
    writes = {"patch": torch.cat([zeros, patch], 1), "pos": pos,
              "prefix": torch.cat([w["cls"].expand(b, -1, -1), torch.zeros_like(patch)], 1) if p else 0 * pos}
    z = writes["patch"] + writes["pos"] + writes["prefix"]
    n = z.shape[1]
    for i, lay in enumerate(w["layers"]):
        a_in = ln(lay["ln1"], z)
        q, k, v = ((a_in @ wt.T + bs).reshape(b, n, h, dh).transpose(1, 2) for wt, bs in (lay["q"], lay["k"], lay["v"]))
        att = torch.softmax(q @ k.transpose(-1, -2) / dh ** 0.5, -1)
        gamma = lay["gamma"] if lay["gamma"] is not None else torch.ones(d, dtype=x.dtype)
        per = att[..., None] * torch.einsum("ehc,bhjc->bhje", lay["o"].weight.reshape(d, h, dh), v)[:, :, None]
        per = per * gamma  # [b, h, q, j, d]: head h's write at q from source j
        writes[f"heads{i}"] = per
        writes[f"bias{i}"] = (gamma * lay["o"].bias).expand(b, n, d)
        z = z + per.sum((1, 3)) + gamma * lay["o"].bias
        writes[f"mlp{i}"] = lay["mlp"](ln(lay["ln2"], z))
        z = z + writes[f"mlp{i}"]
    norm = w["norm"]
    zn = ln(norm, z)
    sigma = torch.sqrt(z.var(-1, unbiased=False, keepdim=True) + norm.eps)  # [b, n, 1], held

    def held(t: torch.Tensor) -> torch.Tensor:  # the final norm with sigma held, no beta; t [b, ..., n, d]
        s = sigma.reshape(b, *[1] * (t.dim() - 3), n, 1)
        return (t - t.mean(-1, keepdim=True)) * norm.weight / s

    if kind == "siglip":
        mha = m.head.attention
        wq, wk, wv = mha.in_proj_weight.chunk(3)
        bq, bk, bv = mha.in_proj_bias.chunk(3)
        pq = (m.head.probe[0] @ wq.T + bq).reshape(h, dh)
        kk = (zn @ wk.T + bk).reshape(b, n, h, dh)
        a = torch.softmax(torch.einsum("hc,bjhc->bhj", pq, kk) / dh ** 0.5, -1)  # [b, h, j], held

        def readout(t: torch.Tensor) -> torch.Tensor:  # the pool's output for a write, without biases
            vv = (held(t) @ wv.T).reshape(*t.shape[:-1], h, dh)
            mixed = torch.einsum("bhj,b...jhc->b...hc", a, vv).flatten(-2)
            return mixed @ mha.out_proj.weight.T @ u
        pooled = torch.einsum("bhj,bjhc->bhc", a, (zn @ wv.T + bv).reshape(b, n, h, dh)).flatten(1)
        s = pooled @ mha.out_proj.weight.T + mha.out_proj.bias
        mlp = m.head.mlp(ln(m.head.layernorm, s))
        out = (s + mlp) @ u
        const = (mha.out_proj.bias + (bv.reshape(h, dh)[None] * a.sum(-1)[..., None]).flatten(1)
                 @ mha.out_proj.weight.T) @ u + readout_beta(norm, a, wv, mha, u, b, n)
        extra = {"pool_mlp": mlp @ u}
    else:
        if u.shape[0] == 2 * d:  # DINOv2's classifier: class token and the patch mean
            def readout(t: torch.Tensor) -> torch.Tensor:
                ht = held(t)
                return ht[..., 0, :] @ u[:d] + ht[..., 1:, :].mean(-2) @ u[d:]
            out = zn[:, 0] @ u[:d] + zn[:, 1:].mean(1) @ u[d:]
            const = norm.bias @ u[:d] + norm.bias @ u[d:]
        else:
            def readout(t: torch.Tensor) -> torch.Tensor:
                return held(t)[..., 0, :] @ u
            out = zn[:, 0] @ u
            const = norm.bias @ u
        extra = {"pool_mlp": torch.zeros(b, dtype=x.dtype)}
    got = {"output": out, "readout_bias": const * torch.ones(b, dtype=x.dtype), **extra}
    for key, t in writes.items():
        if key.startswith("heads"):  # [b, h, q, j, d] -> read over q per source j: [b, h, j]
            got[key] = readout(t.transpose(2, 3))
        else:
            got[key] = readout(t)
    return got


def readout_beta(norm: torch.nn.Module, a: torch.Tensor, wv: torch.Tensor, mha: torch.nn.Module, u: torch.Tensor,
                 b: int, n: int) -> torch.Tensor:
    """The final norm's beta through SigLIP's held pool: each token's beta mixed by the attention, projected."""
    vb = (norm.bias @ wv.T).reshape(4, 8)
    return torch.einsum("bhj,hc->bhc", a, vb).flatten(1) @ mha.out_proj.weight.T @ u


KINDS = ["vit-cls", "dinov2", "dinov2-cls", "siglip", "torchvision"]  # ViTModel: the next test


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 32, 32, dtype=torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_each_part_equals_a_hand_computation(kind: str, pixels: torch.Tensor) -> None:
    m = build(kind)
    classes = kind in ("vit-cls", "dinov2-cls", "torchvision")
    torch.manual_seed(2)
    direction = None if classes else torch.randn(32, dtype=torch.float64)
    r = decompose(m, pixels, target=3 if classes else None, direction=direction)
    head = getattr(m, "classifier", None) if kind != "torchvision" else m.heads.head
    u = head.weight[3] if classes else direction
    with torch.no_grad():
        ref = {k: v.numpy() for k, v in hand(m, kind, pixels, u).items()}
        if classes:
            ref["output"] = ref["output"] + float(head.bias[3])
            ref["readout_bias"] = ref["readout_bias"] + float(head.bias[3])
            logits = m(pixels) if kind == "torchvision" else m(pixel_values=pixels).logits
            np.testing.assert_allclose(r.output, logits[:, 3].numpy(), rtol=1e-12)  # the forward's own value
    tol = dict(rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(r.output, ref["output"], **tol)
    np.testing.assert_allclose(r.embed_patch.sum(-1), ref["patch"], **tol)
    np.testing.assert_allclose(r.embed_position.sum(-1), ref["pos"], **tol)
    np.testing.assert_allclose(r.embed_prefix.sum(-1), ref["prefix"], **tol)
    for i in range(2):
        np.testing.assert_allclose(r.heads[:, i], ref[f"heads{i}"], **tol)  # per head and source token
        np.testing.assert_allclose(r.attn_bias[:, i], ref[f"bias{i}"], **tol)
        np.testing.assert_allclose(r.mlp[:, i].sum(-1), ref[f"mlp{i}"], **tol)
    np.testing.assert_allclose(r.readout_bias, ref["readout_bias"], **tol)
    np.testing.assert_allclose(r.pool_mlp, ref["pool_mlp"], **tol)
    assert r.closes() and r.ledger().max() < 1e-12
    assert r.num_prefix_tokens == (0 if kind == "siglip" else 1) and r.grid == (4, 4)
    assert not any(mod._forward_hooks or mod._forward_pre_hooks for mod in m.modules())


def test_towers_without_classes_need_a_direction(pixels: torch.Tensor) -> None:
    m = build("vit")  # ViTModel: the class token after the final norm (its tanh pooler is not read)
    with pytest.raises(Exception, match="direction"):
        decompose(m, pixels)
    r = decompose(m, pixels, target=5)  # one coordinate of the class token's final feature
    with torch.no_grad():
        np.testing.assert_allclose(r.output, m(pixel_values=pixels).last_hidden_state[:, 0, 5].numpy(), rtol=1e-12)
        torch.manual_seed(2)
        u = torch.randn(32, dtype=torch.float64)
        ref = {k: v.numpy() for k, v in hand(m, "vit", pixels, u).items()}
    r = decompose(m, pixels, direction=u)
    np.testing.assert_allclose(r.heads[:, 1], ref["heads1"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(r.mlp[:, 0].sum(-1), ref["mlp0"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(r.output, ref["output"], rtol=1e-9)
    assert r.closes() and r.ledger().max() < 1e-12


def test_other_families_are_refused_by_name(pixels: torch.Tensor) -> None:
    import transformers as tf
    from torchvision.models.vision_transformer import VisionTransformer

    swin = tf.SwinModel(tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                                      window_size=4))
    with pytest.raises(UnsupportedModelError, match="SwinModel.*hierarchical"):
        decompose(swin, pixels.float())
    tv = VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=4, hidden_dim=32, mlp_dim=64,
                           num_classes=5, representation_size=16)
    with pytest.raises(UnsupportedModelError, match="pre-logits"):
        decompose(tv, pixels.float())
    with pytest.raises(UnsupportedModelError, match="generic call-level capture"):  # the generic path, with its reason
        decompose(tf.Data2VecVisionModel(tf.Data2VecVisionConfig(**HF, intermediate_size=64)), pixels.float())
    siglip = tf.SiglipVisionModel(tf.SiglipVisionConfig(**HF, intermediate_size=64, vision_use_head=False))
    with pytest.raises(UnsupportedModelError, match="vision_use_head"):
        decompose(siglip, pixels.float(), target=0)
