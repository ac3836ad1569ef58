"""Direct contributions (issue 51; docs/definitions.md, "Direct contributions"): each part equals a hand
computation from the weights in plain torch, the ledger closes on the reference pair and on register, GAP and MAP
models, structures without a residual sum are refused by name."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from timm.models.vision_transformer import ParallelScalingBlock, ResPostBlock, VisionTransformer

import vitlens as vl
from vitlens.components import LEDGER_RTOL, DecompositionResult, decompose
from vitlens.errors import UnsupportedModelError

SMALL = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4, num_classes=5)


def tiny(**kw: object) -> VisionTransformer:
    torch.manual_seed(0)
    m = VisionTransformer(**{**SMALL, **kw}).double().eval()
    with torch.no_grad():  # non-trivial norms and biases, so that every term is tested
        for name, p in m.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
    return m


@pytest.fixture(scope="module")
def pixels() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 32, 32, dtype=torch.float64)


@pytest.fixture(scope="module")
def cls_model() -> VisionTransformer:
    return tiny()


def hand(m: VisionTransformer, x: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
    """The class-token ViT's forward written from its weights, each part read through the final LayerNorm with its
    scale held (docs/definitions.md): u . gamma * (c - mean(c)) / sigma."""
    b, d, h = x.shape[0], m.embed_dim, m.blocks[0].attn.num_heads
    dh = d // h
    patch = F.conv2d(x, m.patch_embed.proj.weight, m.patch_embed.proj.bias, stride=8).flatten(2).transpose(1, 2)
    cls = m.cls_token.expand(b, -1, -1)
    pos = m.pos_embed.expand(b, -1, -1)
    z = torch.cat([cls, patch], 1) + pos
    n = z.shape[1]
    writes = {"patch": torch.cat([torch.zeros_like(cls), patch], 1), "pos": pos,
              "prefix": torch.cat([cls, torch.zeros_like(patch)], 1)}
    for li, blk in enumerate(m.blocks):
        a_in = F.layer_norm(z, (d,), blk.norm1.weight, blk.norm1.bias, blk.norm1.eps)
        qkv = a_in @ blk.attn.qkv.weight.T + blk.attn.qkv.bias
        q, kk, v = [t.reshape(b, n, h, dh).transpose(1, 2) for t in qkv.split(d, -1)]
        att = torch.softmax(q @ kk.transpose(-1, -2) / dh ** 0.5, -1)  # [b, h, n, n]
        w_o = blk.attn.proj.weight.reshape(d, h, dh)
        # per head and source token: a_h(q, j) W_O^h V^h x_j, [b, h, q, j, d]
        per = att[..., None] * torch.einsum("ehc,bhjc->bhje", w_o, v)[:, :, None]
        writes[f"heads{li}"] = per
        writes[f"bias{li}"] = blk.attn.proj.bias.expand(b, n, d)
        z = z + per.sum(3).sum(1) + blk.attn.proj.bias
        m_in = F.layer_norm(z, (d,), blk.norm2.weight, blk.norm2.bias, blk.norm2.eps)
        mlp = F.gelu(m_in @ blk.mlp.fc1.weight.T + blk.mlp.fc1.bias) @ blk.mlp.fc2.weight.T + blk.mlp.fc2.bias
        writes[f"mlp{li}"] = mlp
        z = z + mlp
    c = z[:, 0]
    sigma = torch.sqrt(c.var(-1, unbiased=False) + m.norm.eps)[:, None]
    u = m.head.weight[k]

    def read(w: torch.Tensor) -> torch.Tensor:  # the class token's write, read through the held norm
        return ((w - w.mean(-1, keepdim=True)) * m.norm.weight / sigma.reshape(-1, *[1] * (w.dim() - 1)) * u).sum(-1)

    out = {"logit": (F.layer_norm(c, (d,), m.norm.weight, m.norm.bias, m.norm.eps) @ m.head.weight.T
                     + m.head.bias)[:, k]}
    for key, w in writes.items():
        out[key] = read(w[:, :, 0] if key.startswith("heads") else w[:, 0])
    out["readout_bias"] = m.norm.bias @ u + m.head.bias[k]
    return out


def test_each_part_equals_a_hand_computation(cls_model: VisionTransformer, pixels: torch.Tensor) -> None:
    k = 3
    r = decompose(cls_model, pixels, target=k)
    with torch.no_grad():
        ref = {key: v.numpy() for key, v in hand(cls_model, pixels, k).items()}
    tol = dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(r.output, ref["logit"], **tol)
    np.testing.assert_allclose(r.embed_patch.sum(-1), ref["patch"], **tol)
    np.testing.assert_allclose(r.embed_position.sum(-1), ref["pos"], **tol)
    np.testing.assert_allclose(r.embed_prefix.sum(-1), ref["prefix"], **tol)
    for li in range(2):
        np.testing.assert_allclose(r.heads[:, li], ref[f"heads{li}"], **tol)  # [b, h, j]: per head, per source
        np.testing.assert_allclose(r.attn_bias[:, li], ref[f"bias{li}"], **tol)
        np.testing.assert_allclose(r.mlp[:, li].sum(-1), ref[f"mlp{li}"], **tol)
    np.testing.assert_allclose(r.readout_bias, np.full(2, float(ref["readout_bias"])), **tol)
    assert r.closes() and r.ledger().max() < 1e-12
    assert (r.target == k).all()


def test_capture_leaves_the_output_alone(cls_model: VisionTransformer, pixels: torch.Tensor) -> None:
    with torch.no_grad():
        before = cls_model(pixels)
    r = decompose(cls_model, pixels)
    with torch.no_grad():
        after = cls_model(pixels)
    assert torch.equal(before, after)
    assert not any(m._forward_hooks for m in cls_model.modules())
    np.testing.assert_array_equal(r.target, before.argmax(-1).numpy())
    np.testing.assert_allclose(r.output, before.max(-1).values.numpy(), rtol=1e-12)


@pytest.mark.parametrize("kw", [
    dict(reg_tokens=2),
    dict(global_pool="avg", class_token=False, fc_norm=True),
    dict(global_pool="avg", reg_tokens=1, init_values=0.1, pre_norm=True),
    dict(global_pool="map", reg_tokens=2, class_token=False),
    dict(global_pool="map", class_token=True, no_embed_class=True, reg_tokens=1),
], ids=["registers", "gap", "gap-layerscale-prenorm", "map-registers", "map-cls"])
def test_ledger_closes_on_timm_variants(kw: dict, pixels: torch.Tensor) -> None:
    r = decompose(tiny(**kw), pixels)
    assert r.closes(), r.ledger()
    assert r.ledger().max() < 1e-12  # float64: the held linearisation is exact, only rounding is left
    if kw.get("global_pool") == "map":
        assert np.abs(r.pool_mlp).min() > 0  # the pool's MLP is a part of its own


def test_a_direction_is_read(cls_model: VisionTransformer, pixels: torch.Tensor) -> None:
    torch.manual_seed(2)
    d = torch.randn(32, dtype=torch.float64)
    r = decompose(cls_model, pixels, direction=d)
    with torch.no_grad():
        feats = cls_model.forward_head(cls_model.forward_features(pixels), pre_logits=True)
    np.testing.assert_allclose(r.output, (feats @ d).numpy(), rtol=1e-12)
    assert r.closes() and (r.target == -1).all() and r.direction == "direction"


@pytest.mark.parametrize("name", ["ref-vit", "ref-hybrid"])
def test_ledger_closes_on_the_reference_pair(name: str) -> None:
    m = vl.load_model(name)
    model = copy.deepcopy(m.model).double()
    torch.manual_seed(3)
    x = torch.randn(1, 3, *m.data_config["input_size"][1:], dtype=torch.float64)
    r = decompose(model, x)
    assert r.closes(LEDGER_RTOL), r.ledger()
    assert r.heads.shape[1:3] == (m.spec.num_layers, m.spec.num_heads)
    r32 = decompose(m, x)  # the LoadedModel as loaded (float32): the ledger closes to float32's precision
    assert r32.model_name == name and r32.closes(LEDGER_RTOL), r32.ledger()


def test_result_tables_and_files(cls_model: VisionTransformer, pixels: torch.Tensor, tmp_path) -> None:
    r = decompose(cls_model, pixels, target=1)
    table = r.head_table(1)
    assert table.shape == (2, 4)
    l, h, v = r.top_heads(1, image=1)[0]
    assert v == table.max() == table[l, h]
    assert r.head_map(0, 0).shape == (4, 4)
    np.testing.assert_allclose(r.head_table(None), (r.head_table(0) + r.head_table(1)) / 2)
    assert r.top_heads(8, image=None)[0][2] == r.head_table(None).max()
    frame = r.to_pandas()
    one = frame[frame.image == 0]
    np.testing.assert_allclose(one.value.sum(), r.output[0], rtol=1e-9)  # the rows are the ledger's entries
    assert "ledger" in r.summary() and "closes" in r.summary()
    back = DecompositionResult.load(r.save(tmp_path / "d.npz"))
    assert back.equals(r)


def test_structures_without_a_residual_sum_are_refused(pixels: torch.Tensor) -> None:
    for block_fn, word in ((ResPostBlock, "ResPostBlock"), (ParallelScalingBlock, "ParallelScalingBlock")):
        with pytest.raises(UnsupportedModelError, match=word):
            decompose(tiny(block_fn=block_fn), pixels)
    with pytest.raises(UnsupportedModelError, match="'max'"):
        decompose(tiny(global_pool="max", class_token=False), pixels)
    with pytest.raises(UnsupportedModelError, match="Sequential"):
        decompose(torch.nn.Sequential(torch.nn.Flatten()), pixels)


def test_figures_are_registered_and_drawn(cls_model: VisionTransformer, pixels: torch.Tensor) -> None:
    from vitlens import figures

    r = decompose(cls_model, pixels)
    fig = figures.figure_for(r)
    np.testing.assert_allclose(np.asarray(fig.data[0].z), r.head_table(0))
    assert "ledger" in fig.layout.title.text
    head = figures.head_contribution_figure(r, 1, 2)
    np.testing.assert_allclose(np.asarray(head.data[0].z), r.heads[0, 1, 2, 1:].reshape(4, 4))


@pytest.fixture(scope="module")
def clip_tower() -> torch.nn.Module:
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    cfg = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, projection_dim=16)
    torch.manual_seed(0)
    return CLIPVisionModelWithProjection(cfg).double().eval()


def test_clip_tower_with_projection_against_a_hand_computation(clip_tower: torch.nn.Module,
                                                                pixels: torch.Tensor) -> None:
    torch.manual_seed(4)
    d = torch.randn(16, dtype=torch.float64)  # a text embedding's stand-in
    r = decompose(clip_tower, pixels, direction=d)
    assert r.closes() and r.ledger().max() < 1e-12
    vm, proj = clip_tower.vision_model, clip_tower.visual_projection
    with torch.no_grad():
        out = clip_tower(pixel_values=pixels)
        np.testing.assert_allclose(r.output, (out.image_embeds @ d).numpy(), rtol=1e-12)
        # layer 1's heads by hand: each head's write at the class token per source, read through the held
        # post_layernorm and the projection
        emb = vm.embeddings(pixels)
        x = vm.pre_layrnorm(emb)
        lay = vm.encoder.layers[0]
        h = F.layer_norm(x, (32,), lay.layer_norm1.weight, lay.layer_norm1.bias, lay.layer_norm1.eps)
        q, k, v = ((h @ p.weight.T + p.bias).reshape(2, -1, 4, 8).transpose(1, 2)
                   for p in (lay.self_attn.q_proj, lay.self_attn.k_proj, lay.self_attn.v_proj))
        att = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1)
        w_o = lay.self_attn.out_proj.weight.reshape(32, 4, 8)
        write = att[:, :, 0, :, None] * torch.einsum("ehc,bhjc->bhje", w_o, v)  # [b, h, j, 32] at the class token
        final = out.last_hidden_state[:, 0]
        sigma = torch.sqrt(final.var(-1, unbiased=False) + vm.post_layernorm.eps)[:, None, None, None]
        u = d @ proj.weight
        read = ((write - write.mean(-1, keepdim=True)) * vm.post_layernorm.weight / sigma * u).sum(-1)
    np.testing.assert_allclose(r.heads[:, 0], read.numpy(), rtol=1e-10, atol=1e-12)


def test_clip_tower_needs_a_direction(clip_tower: torch.nn.Module, pixels: torch.Tensor) -> None:
    with pytest.raises(vl.InvalidParameterError, match="direction"):
        decompose(clip_tower, pixels)
    r = decompose(clip_tower, pixels, target=3)  # one coordinate of the embedding
    with torch.no_grad():
        np.testing.assert_allclose(r.output, clip_tower(pixel_values=pixels).image_embeds[:, 3].numpy(), rtol=1e-12)
    assert r.closes()


@pytest.mark.parametrize("kw", [dict(), dict(pool_type="avg"), dict(final_ln_after_pool=True, ls_init_value=0.3)],
                         ids=["token", "avg", "ln-after-pool-layerscale"])
def test_ledger_closes_on_an_openclip_tower(kw: dict, pixels: torch.Tensor) -> None:
    from open_clip.transformer import VisionTransformer as OpenCLIPViT

    torch.manual_seed(0)
    m = OpenCLIPViT(image_size=32, patch_size=8, width=32, layers=2, heads=4, mlp_ratio=2.0, output_dim=16,
                    **kw).double().eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "ln" in name or name.endswith("bias"):
                p.add_(0.3 * torch.randn_like(p))
        d = torch.randn(16, dtype=torch.float64)
        r = decompose(m, pixels, direction=d)
        np.testing.assert_allclose(r.output, (m(pixels) @ d).numpy(), rtol=1e-12)
    assert r.closes() and r.ledger().max() < 1e-12
    assert r.heads.shape == (2, 2, 4, 17) and r.grid == (4, 4)
    with pytest.raises(vl.InvalidParameterError, match="direction"):
        vl.logit_lens(m, pixels)  # a tower has no classes: the lens asks for a direction (prompt embeddings)
