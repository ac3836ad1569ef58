"""A MAP head behind register tokens (timm's own vit_so150m_patch16_reg4_map_256 too, as the README's pool
example uses it), and inputs of another size than the model's (timm and Hugging Face towers).

The pool map is compared with the pool computed by hand from its own modules (q_norm(q(latent)),
k_norm(kv(x)) of the tokens it reads, softmax(q * scale @ k^T)) within 1e-5 (float32 probabilities
in [0, 1] over 16 keys, the same products summed in another order)."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import vitlens as vl
from view_references import max_diff, mean_distance, set_attention
from vitlens.errors import InvalidParameterError
from vitlens.families.pooling import capture_pool_attention

TOL = 1e-5


def reg_map_vit():
    """vit_so150m_patch16_reg4_map_256's structure at small width: no class token, 4 registers, MAP head."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    return VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, class_token=False,
                             reg_tokens=4, global_pool="map", no_embed_class=True, num_classes=5).eval()


def pool_by_hand(model, x):
    """The MAP head's probabilities from its own modules, over the tokens it reads (patch tokens only)."""
    pool = model.attn_pool
    with torch.no_grad():
        seen = model.forward_features(x)[:, model.num_prefix_tokens:]  # forward_features ends with the norm
        assert pool.pos_embed is None
        b, n, c = seen.shape
        q = pool.q(pool.latent.expand(b, -1, -1)).reshape(b, -1, pool.num_heads, pool.head_dim).transpose(1, 2)
        k = pool.kv(seen).reshape(b, n, 2, pool.num_heads, pool.head_dim).permute(2, 0, 3, 1, 4)[0]
        q, k = pool.q_norm(q), pool.k_norm(k)
        return ((q * pool.scale) @ k.transpose(-2, -1)).softmax(-1)


def test_map_pool_behind_registers_has_every_token():
    model = reg_map_vit()
    assert model.num_prefix_tokens == 4 and not model.pool_include_prefix
    m = vl.LoadedModel.from_module(model, name="reg4-map", device="cpu")
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        plain = m.logits(x)
    with capture_pool_attention(m) as pool:
        out = m.logits(x)
    assert torch.equal(out, plain)  # side capture: the output untouched
    probs = pool.maps[0]
    t = m.spec.num_prefix_tokens + m.spec.grid[0] * m.spec.grid[1]
    assert probs.shape == (2, 2, 1, t)  # T key columns, as the README says
    assert probs[..., :4].abs().max().item() == 0.0  # the registers are not read by the pool
    assert (probs[..., 4:] - pool_by_hand(model, x)).abs().max().item() <= TOL
    grid = pool.patch_maps(m.spec)  # the README's example (raised RuntimeError: shape '[2, 4, 1, 4, 4]' ...)
    assert grid.shape == (2, 2, 1, 4, 4)
    assert (grid.sum((-1, -2)) - 1).abs().max().item() <= TOL


def test_views_over_a_register_map_pool():
    m = vl.LoadedModel.from_module(reg_map_vit(), name="reg4-map", device="cpu")
    x = torch.randn(2, 3, 32, 32)
    maps = vl.attention_maps(m, x[:1])
    assert maps.pool_attention(0).shape == (2, 4, 4)
    rollout = vl.attention_rollout(m, x, source="pool")
    assert rollout.source_token == "attention pool" and rollout.maps.shape == (2, 4, 4)
    assert np.allclose(np.asarray(rollout.maps).max(axis=(1, 2)), 1.0)  # each map divided by its maximum


def test_timm_refuses_a_size_it_cannot_take_in_one_line():
    import timm

    model = timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32, patch_size=8, embed_dim=32,
                              depth=1, num_heads=2, num_classes=5)
    m = vl.LoadedModel.from_module(model, name="fixed", device="cpu")
    with pytest.raises(InvalidParameterError, match="takes 32x32 px inputs only") as err:
        m.logits(torch.randn(1, 3, 48, 48))
    assert "\n" not in str(err.value)
    with pytest.raises(InvalidParameterError, match="32x32"):
        m.grid_for((48, 48))
    dyn = vl.LoadedModel.from_module(timm.create_model("vit_small_patch16_224", pretrained=False, img_size=32,
                                                       patch_size=8, embed_dim=32, depth=1, num_heads=2,
                                                       dynamic_img_size=True), name="dyn", device="cpu")
    with pytest.raises(InvalidParameterError, match="whole number of 8x8 px patches"):
        dyn.logits(torch.randn(1, 3, 36, 36))
    assert dyn.logits(torch.randn(1, 3, 48, 48)).shape[0] == 1  # a size it takes runs


def test_hf_vit_at_another_size_interpolates():
    tr = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
               patch_size=8)
    model = tr.ViTForImageClassification(tr.ViTConfig(num_labels=5, **cfg)).eval()
    m = vl.LoadedModel.from_module(model, name="hf-vit", device="cpu", data_config={"input_size": (3, 48, 48)})
    assert m.spec.grid == (6, 6)
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        expected = model(pixel_values=x, interpolate_pos_encoding=True).logits
        assert torch.equal(m.logits(x), expected)
        x32 = torch.randn(1, 3, 32, 32)  # at the config's size: a plain call, no interpolation asked for
        assert torch.equal(m.logits(x32), model(pixel_values=x32).logits)
    with vl.capture_attention(m) as cap:
        m.logits(x)
    assert cap.maps[0].shape == (2, 2, 37, 37)
    result = vl.attention_distance(m, x)
    assert result.grid == (6, 6) and tuple(result.image_size) == (48, 48) and result.mean_px.shape == (2, 2)
    assert result.n_images == 2 and np.isfinite(np.asarray(result.mean_px)).all()


def test_hf_model_without_interpolation_refuses_another_size(monkeypatch):
    tr = pytest.importorskip("transformers")
    from vitlens.families.common import hf_inputs as hf

    model = tr.ViTModel(tr.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                     image_size=32, patch_size=8)).eval()

    def forward(pixel_values):  # a model whose forward cannot resample its position table
        return tr.ViTModel.forward(model, pixel_values=pixel_values)

    with pytest.raises(InvalidParameterError, match="cannot resample its position table") as err:
        hf.size_inputs(model, torch.randn(1, 3, 48, 48), forward)
    assert "\n" not in str(err.value)
    assert hf.size_inputs(model, torch.randn(1, 3, 32, 32), forward) == {}


# --- the README's pool example on timm's own reg4 MAP architecture; HF towers at another size --------------

def test_readme_pool_example_on_timm_so150m_reg4_map():
    import timm

    from vitlens.families.pooling import capture_pool_attention

    torch.manual_seed(0)
    model = timm.create_model("vit_so150m_patch16_reg4_map_256", pretrained=False, img_size=32, patch_size=8,
                              embed_dim=32, depth=2, num_heads=2, num_classes=5)
    m = vl.load_model(model, device="cpu")
    assert m.spec.num_prefix_tokens == 4 and not m.spec.has_class_token and not model.pool_include_prefix
    x = torch.randn(2, 3, 32, 32)
    seen: list[torch.Tensor] = []
    model.attn_pool.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach().clone()))
    with capture_pool_attention(m) as pool:
        m.logits(x)
    assert seen[-1].shape[1] == 16  # what timm's pool attends: the 16 patch tokens, not the registers
    probs = pool.maps[0]
    assert probs.shape == (2, 2, 1, 20)  # [B, heads, queries, T] as the README says
    assert probs[..., :4].abs().max().item() == 0.0
    grid = pool.patch_maps(m.spec)
    assert grid.shape == (2, 2, 1, 4, 4)
    assert (grid.sum((-1, -2)) - 1).abs().max().item() <= TOL
    maps = vl.attention_maps(m, x[:1])
    assert maps.pool_attention(0).shape == (2, 4, 4)


@pytest.mark.parametrize("name", ["ViTModel", "DeiTModel", "CLIPVisionModel", "SiglipVisionModel", "IJepaModel"])
def test_hf_towers_at_another_size_are_exact(name):
    """48 x 40 px into towers built for 32 x 32: vitlens passes interpolate_pos_encoding=True, and the maps are the
    model's own eager attention of that call (side and inline), the views run on the 6 x 5 grid."""
    tr = pytest.importorskip("transformers")
    cls = getattr(tr, name)
    torch.manual_seed(0)
    model = cls(cls.config_class(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 image_size=32, patch_size=8, attn_implementation="sdpa")).eval()
    m = vl.load_model(model, device="cpu")
    x = torch.randn(2, 3, 48, 40)
    ref = set_attention(copy.deepcopy(model), "eager")
    with torch.no_grad():
        expected = ref(pixel_values=x, interpolate_pos_encoding=True, output_attentions=True)
        plain = model(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state
    for mode in ("side", "inline"):
        with vl.capture_attention(m, mode=mode) as cap, torch.no_grad():
            m.forward(x)
        assert max_diff(cap.maps, list(expected.attentions)) <= TOL
    from vitlens.families.common.hf_inputs import model_inputs

    with torch.no_grad():
        assert torch.equal(model(**model_inputs(model, x)).last_hidden_state, plain)
    assert m.grid_for((48, 40)) == (6, 5)
    result = vl.attention_distance(m, x)  # the views on the 6 x 5 grid read the same maps
    assert result.grid == (6, 5) and result.image_size == (48, 40) and result.n_images == 2
    np.testing.assert_allclose(result.mean_px, mean_distance(list(expected.attentions), (6, 5), (8, 8),
                                                             m.spec.num_prefix_tokens), rtol=0, atol=1e-4)
