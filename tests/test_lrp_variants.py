"""AttnLRP's ViT variants against explicit references: the γ-rule equals a layer-by-layer LRP written with the
contributions on a hand-wired ViT; CP-LRP equals gradient x input with the attention probabilities, the LayerNorm
std and the GELU ratio held constant; both agree with lxt's own rule functions (with zennit's Gamma, patched by
lxt, for the γ-rule) on a timm ViT; each variant's conservation ledger closes; the variants are METHOD_TABLE
entries that the default comparison leaves out."""
from __future__ import annotations

import copy
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vitlens as vl
from conftest import get_model
from test_lrp import _lxt_rules, inputs, load, small_vit
from vitlens.attribution import LRPRules, attribute
from vitlens.attribution.lrp import attnlrp_relevance
from vitlens.attribution.lrp_ledger import attnlrp_ledger, lrp_methods
from vitlens.attribution.methods import METHOD_TABLE, default_methods
from vitlens.errors import InvalidParameterError


def explicit_gamma(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor, gamma: float) -> torch.Tensor:
    """The generalised γ-rule written with contributions: c_jk = x_j w_kj; output k (z_k > 0) shares R_k in proportion
    to c_jk + γ c_jk⁺ among its inputs and b_k + γ b_k⁺ (signs swapped where z_k < 0). x [..., J], r [..., K]."""
    c = x[..., None, :] * w  # [..., K, J]
    up = (c.sum(-1) + b) > 0
    cm = torch.where(up[..., None], c + gamma * c.clamp(min=0), c + gamma * c.clamp(max=0))
    bm = torch.where(up, b + gamma * b.clamp(min=0), b + gamma * b.clamp(max=0))
    return (cm / (cm.sum(-1) + bm)[..., None] * r[..., None]).sum(-2)


def share(part: torch.Tensor, whole: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """A sum's relevance passed to one of its terms in proportion to its value (an addition, a mean)."""
    return part / whole * r


def test_the_gamma_rule_equals_an_explicit_layer_by_layer_lrp_on_a_hand_wired_vit():
    """One block, norms as identities, the attention output's weight at zero (its bias stays, an additive constant),
    every bias and the position table random: the model is head(mean(E x + pos + b_proj + fc2(gelu(fc1(.))))). The
    explicit LRP runs backwards through it with the γ-rule in the patch embedding, fc1, fc2 and the head, the identity
    rule on GELU and the proportional split on sums; the relevance of every pixel equals attnlrp_gamma's."""
    model = small_vit(norm_layer=nn.Identity, depth=1, biases=True)
    blk = model.blocks[0]
    with torch.no_grad():
        blk.attn.proj.weight.zero_()
    m = load(model)
    x, t = inputs(2), torch.tensor([1, 2])
    gamma, conv_gamma = 0.3, 0.7
    pe = model.patch_embed.proj
    with torch.no_grad():
        patches = F.unfold(x, pe.kernel_size, stride=pe.stride).transpose(1, 2)  # [B, N, C*p*p]
        z0 = patches @ pe.weight.reshape(pe.out_channels, -1).T + pe.bias
        h0 = z0 + model.pos_embed
        h1 = h0 + blk.attn.proj.bias
        u = blk.mlp.fc1(h1)
        v = blk.mlp.fc2(F.gelu(u))
        h2 = h1 + v
        pooled = h2.mean(1)
        logits = model.head(pooled)
        torch.testing.assert_close(logits, model(x), rtol=1e-10, atol=1e-12)  # the hand-wired model is the model
        r_out = torch.zeros_like(logits)
        r_out[torch.arange(2), t] = logits[torch.arange(2), t]
        r_pooled = explicit_gamma(pooled, model.head.weight, model.head.bias, r_out, gamma)
        r_h2 = share(h2 / h2.shape[1], pooled[:, None], r_pooled[:, None])
        r_v = share(v, h2, r_h2)
        r_u = explicit_gamma(F.gelu(u), blk.mlp.fc2.weight, blk.mlp.fc2.bias, r_v, gamma)  # GELU: identity rule
        r_h1 = share(h1, h2, r_h2) + explicit_gamma(h1, blk.mlp.fc1.weight, blk.mlp.fc1.bias, r_u, gamma)
        r_z0 = share(z0, h1, r_h1)  # h1 = z0 + (pos + b_proj): the constants keep their part
        r_patches = explicit_gamma(patches, pe.weight.reshape(pe.out_channels, -1), pe.bias, r_z0, conv_gamma)
        want = F.fold(r_patches.transpose(1, 2), x.shape[-2:], pe.kernel_size, stride=pe.stride)
    ours = attnlrp_relevance(m, x, t, lambda inp: m.model(inp), LRPRules(gamma=gamma, conv_gamma=conv_gamma))
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-12)
    plain = attnlrp_relevance(m, x, t, lambda inp: m.model(inp))
    assert (ours - plain).abs().max() > 0.05 * plain.abs().max()  # γ does change the map
    zero = attnlrp_relevance(m, x, t, lambda inp: m.model(inp), LRPRules(gamma=0.0, conv_gamma=0.0))
    torch.testing.assert_close(zero, plain, rtol=0, atol=0)  # γ = 0 is the epsilon rule


def cp_reference(model: nn.Module) -> nn.Module:
    """A copy of a timm ViT written with plain torch so that gradient x input is CP-LRP: the attention probabilities
    detached (Ali et al.'s AH-rule), the LayerNorm std detached (their LN-rule), GELU as x times its detached ratio."""
    ref = copy.deepcopy(model)

    def layer_norm(self, x):
        centred = x - x.mean(-1, keepdim=True)
        return centred / (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt().detach() * self.weight + self.bias

    def attention(self, x, attn_mask=None, is_causal=False):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        probs = ((q @ k.transpose(-2, -1)) * self.scale).softmax(-1).detach()
        return self.proj((probs @ v).transpose(1, 2).reshape(b, n, c))

    def gelu(self, x):
        return x * (F.gelu(x) / x).detach()

    for mod in ref.modules():
        if isinstance(mod, nn.LayerNorm):
            mod.forward = types.MethodType(layer_norm, mod)
        elif isinstance(mod, nn.GELU):
            mod.forward = types.MethodType(gelu, mod)
        elif type(mod).__name__ == "Attention":
            mod.forward = types.MethodType(attention, mod)
    return ref


def grad_x_input(model: nn.Module, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    xi = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(model(xi)[torch.arange(len(t)), t].sum(), xi)
    return (xi * g).detach()


def test_cp_lrp_equals_gradient_x_input_with_constant_attention_probabilities():
    """On a class-token ViT with every bias, the class token and the position table random (float64), cp_lrp's pixel
    relevance equals the gradient x input of the copy with detached probabilities, std and GELU ratio; AttnLRP's
    uniform rule differs from it."""
    from test_lrp import timm_token_vit

    model = timm_token_vit()
    m = load(model)
    x, t = inputs(2), torch.tensor([0, 2])
    want = grad_x_input(cp_reference(model), x, t)
    ours = attnlrp_relevance(m, x, t, lambda inp: m.model(inp), LRPRules(attention="cp"))
    torch.testing.assert_close(ours, want, rtol=1e-9, atol=1e-12 * float(want.abs().max()))
    uniform = attnlrp_relevance(m, x, t, lambda inp: m.model(inp))
    assert (uniform - ours).abs().max() > 0.01 * ours.abs().max()
    maps = attribute(m, x, method="cp_lrp", target=t.tolist()).maps  # the method (its score in float32), on the grid
    from vitlens.core.resample import pixels_to_grid

    np.testing.assert_allclose(maps, pixels_to_grid(want, m.spec.grid), rtol=1e-3, atol=1e-4 * float(want.abs().max()))


def _lxt_zennit_gamma(model: nn.Module, gamma: float, conv_gamma: float) -> tuple:
    """zennit's Gamma rule on every nn.Linear and nn.Conv2d, in lxt's gradient x input form (lxt's
    ``monkey_patch_zennit``, loaded from its file with its one import of lxt supplied)."""
    pytest.importorskip("zennit", reason="zennit is not installed (requirements-nodeps.txt): nothing to compare with")
    from zennit.composites import LayerMapComposite
    from zennit.core import BasicHook
    from zennit.rules import Gamma

    found = importlib.util.find_spec("lxt")
    path = Path(found.origin).parent / "efficient" / "zennit_patches.py"
    patches = types.ModuleType("lxt.efficient.patches")  # zennit_patches imports patch_method from it

    def patch_method(fn, owner, method_name):
        setattr(owner, method_name, fn)
        return True

    patches.patch_method = patch_method
    saved = {name: getattr(BasicHook, name) for name in ("forward", "backward")}
    sys.modules.setdefault("lxt.efficient.patches", patches)
    spec = importlib.util.spec_from_file_location("lxt_zennit_patches", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    finally:
        if sys.modules.get("lxt.efficient.patches") is patches:
            del sys.modules["lxt.efficient.patches"]
    module.monkey_patch_zennit()
    composite = LayerMapComposite([(nn.Conv2d, Gamma(conv_gamma)), (nn.Linear, Gamma(gamma))])
    return composite, lambda: [setattr(BasicHook, k, v) for k, v in saved.items()]


@pytest.mark.parametrize("attention", ["uniform", "cp"])
def test_the_variants_agree_with_lxts_rules_and_zennits_gamma_on_a_timm_vit(attention):
    """lxt's ViT recipe on a timm ViT wired by hand: lxt's stop_gradient on the LayerNorm std, its identity rule on
    GELU, inside attention either its uniform rule (divide_gradient by 4 on q, k and 2 on v) or CP-LRP (stop_gradient
    on q and k), and zennit's Gamma (lxt-patched) on every linear and convolution layer."""
    rules = _lxt_rules()
    m = get_model("vit_tiny_patch16_224", img_size=64)
    m = vl.LoadedModel.from_module(copy.deepcopy(m.model).double().eval(), name="tiny", device="cpu")
    ref = copy.deepcopy(m.model)
    gamma, conv_gamma = 0.25, 0.5

    def layer_norm(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        std = (((x - mean) ** 2).mean(dim=-1, keepdim=True) + self.eps).sqrt()
        return (x - mean) / rules.stop_gradient(std) * self.weight + self.bias

    def attn(self, x, attn_mask=None, is_causal=False):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        if attention == "cp":
            q, k = rules.stop_gradient(q), rules.stop_gradient(k)
        else:
            q, k, v = rules.divide_gradient(q, 4), rules.divide_gradient(k, 4), rules.divide_gradient(v, 2)
        out = ((q * self.scale) @ k.transpose(-2, -1)).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))

    for mod in ref.modules():
        if isinstance(mod, nn.LayerNorm):
            mod.forward = types.MethodType(layer_norm, mod)
        elif isinstance(mod, nn.GELU):
            mod.forward = types.MethodType(lambda self, x: rules.identity_rule_implicit(nn.GELU.forward.__get__(self), x), mod)
        elif type(mod).__name__ == "Attention":
            mod.forward = types.MethodType(attn, mod)
    composite, unpatch = _lxt_zennit_gamma(ref, gamma, conv_gamma)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    t = torch.tensor([3, 9])
    try:
        with composite.context(ref):
            want = grad_x_input(ref, x, t)
    finally:
        unpatch()
    ours = attnlrp_relevance(m, x, t, lambda inp: m.model(inp), LRPRules(attention, gamma, conv_gamma))
    assert np.corrcoef(ours.flatten().numpy(), want.flatten().numpy())[0, 1] > 0.9999
    torch.testing.assert_close(ours, want, rtol=1e-3, atol=1e-5 * float(want.abs().max()))
    without_gamma = attnlrp_relevance(m, x, t, lambda inp: m.model(inp), LRPRules(attention))
    assert (without_gamma - want).abs().max() > 0.05 * want.abs().max()  # the comparison sees γ


@pytest.mark.parametrize("method", ["attnlrp_gamma", "cp_lrp"])
def test_each_variants_ledger_closes_to_the_logit(method):
    """The ledger of each variant closes in float64 on a class-token ViT with random biases, class token and position
    table; under CP-LRP no relevance reaches a softmax, under the γ-rule the biases keep more than under epsilon."""
    from test_lrp import timm_token_vit

    m = load(timm_token_vit())
    x = inputs(2)
    led = attnlrp_ledger(m, x, target=[0, 2], method=method, **({"gamma": 0.5} if method == "cp_lrp" else {}))
    assert led.method == method and led.closure().max() < 1e-9
    base = attnlrp_ledger(m, x, target=[0, 2])
    assert np.abs(led.input - base.input).max() > 1e-3 * np.abs(base.score).max()
    if method == "cp_lrp":
        assert np.all(led.softmax == 0) and led.params["gamma"] == 0.5
    with pytest.raises(InvalidParameterError, match="ledger splits an LRP relevance"):
        attnlrp_ledger(m, x, method="saliency")
    with pytest.raises(InvalidParameterError, match="takes gamma, conv_gamma"):
        attnlrp_ledger(m, x, method=method, beta=1.0)


def test_the_variants_are_table_entries_offered_but_not_in_the_default_comparison():
    assert lrp_methods() == ("attnlrp", "attnlrp_gamma", "cp_lrp")
    assert METHOD_TABLE["attnlrp_gamma"].variant_of == "attnlrp" and METHOD_TABLE["cp_lrp"].defaults == {
        "gamma": 0.0, "conv_gamma": 0.0}
    assert "attnlrp" in default_methods() and not {"attnlrp_gamma", "cp_lrp"} & set(default_methods())
    with pytest.raises(InvalidParameterError, match="gamma must be a number >= 0"):
        LRPRules(gamma=-1.0)
    with pytest.raises(InvalidParameterError, match="attention must be one of uniform, cp"):
        LRPRules(attention="softmax")
