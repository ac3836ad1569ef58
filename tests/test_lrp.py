"""AttnLRP: relevance conservation on hand-built bias-free models (exact, float64), the exact bias ledger
when biases are there, the uniform rule's known share on uniform attention, the softmax rule as the
paper writes it, outputs unchanged by the patched mode and the modules' own forward restored, refusals,
and agreement with a reference built from lxt's own rule functions where lxt is present."""
from __future__ import annotations

import copy
import importlib.util
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import vitlens as vl
from conftest import get_model
from vitlens.attribution import attribute
from vitlens.attribution.lrp import attnlrp_mode, attnlrp_relevance


def small_vit(norm_layer: type = nn.LayerNorm, depth: int = 2, class_token: bool = False, biases: bool = False,
              seed: int = 0) -> nn.Module:
    """A 32 px ViT of 4x4 patches, D=16, two heads, float64; without a class token (mean pool) and, unless
    ``biases``, with every bias and the position embedding zero (they would absorb relevance)."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=16, depth=depth, num_heads=2, num_classes=3,
                              class_token=class_token, global_pool="token" if class_token else "avg", qkv_bias=True,
                              norm_layer=norm_layer, mlp_ratio=2.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name in ("pos_embed", "cls_token"):
                p.copy_(torch.randn_like(p) * 0.5 if biases else torch.zeros_like(p))
            elif name.endswith("weight") and p.ndim == 1:  # norm gains away from 1, so they matter
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model.double()


def load(model: nn.Module) -> vl.LoadedModel:
    return vl.LoadedModel.from_module(model, name="hand-built", device="cpu", source="hand-built")


def inputs(n: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def target_logit(m: vl.LoadedModel, x: torch.Tensor, t: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return m.model(x)[torch.arange(len(t)), t].numpy()


def relevance_sums(m: vl.LoadedModel, x: torch.Tensor, t: torch.Tensor) -> np.ndarray:
    score = lambda inp: m.model(inp)  # noqa: E731 (float64 throughout)
    return attnlrp_relevance(m, x, t, score).sum(dim=(1, 2, 3)).numpy()


def test_without_biases_or_attention_the_relevance_sums_to_the_logit_exactly():
    """With no biases, no position table, no class token and the attention's output projection at zero, every
    remaining operation is linear under the rules (LayerNorm with its std constant, GELU as x times a constant
    ratio), so the input relevance is the logit to float64 rounding; plain input x gradient is not."""
    model = small_vit()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.proj.weight.zero_()
    m = load(model)
    x, t = inputs(), torch.tensor([0, 1, 2])
    logit = target_logit(m, x, t)
    np.testing.assert_allclose(relevance_sums(m, x, t), logit, rtol=1e-10, atol=1e-12)
    xi = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(m.model(xi)[torch.arange(3), t].sum(), xi)
    assert np.abs((xi * g).sum(dim=(1, 2, 3)).detach().numpy() - logit).max() > 1e-3 * np.abs(logit).max()
    maps = attribute(m, x, method="attnlrp", target=t.tolist()).maps  # the method, on the patch grid
    np.testing.assert_allclose(maps.sum(axis=(1, 2)), logit, rtol=1e-6)  # its score is the logit in float32


def test_the_bias_ledger_closes_exactly():
    """With biases, a class token and a position table (attention output still at zero), input relevance plus
    each additive constant's own value x gradient (biases, cls_token, pos_embed) is the logit."""
    model = small_vit(class_token=True, biases=True)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.proj.weight.zero_()
    m = load(model)
    constants = [p for name, p in m.model.named_parameters()
                 if name.endswith("bias") or name in ("pos_embed", "cls_token")]
    for p in constants:
        p.requires_grad_(True)  # this test's own model: the ledger needs their gradients
    x, t = inputs(), torch.tensor([2, 0, 1])
    xi = x.clone().requires_grad_(True)
    with attnlrp_mode(m):
        grads = torch.autograd.grad(m.model(xi)[torch.arange(3), t].sum(), [xi, *constants])
    per_image = (xi * grads[0]).sum(dim=(1, 2, 3)).detach()
    absorbed = sum(float((p * g).sum().detach()) for p, g in zip(constants, grads[1:]))  # summed over the batch
    assert abs(absorbed) > 1e-2  # the constants do take a share
    np.testing.assert_allclose(float(per_image.sum()) + absorbed, target_logit(m, x, t).sum(), rtol=1e-10)


def test_on_uniform_attention_the_uniform_rule_gives_half_the_attention_branch():
    """q = k = 0 makes every attention row uniform (the scores are 0, and their relevance s x grad is 0); the
    uniform rule hands half of A v's relevance to A, where it stays, and half to v. Without norms and with
    the MLP at zero the model is linear, logit = f_skip + f_attn with f_skip the logit without the attention
    output, so the input relevance is f_skip + f_attn / 2 (plain input x gradient would give the logit)."""
    model = small_vit(norm_layer=nn.Identity, depth=1)
    with torch.no_grad():
        model.blocks[0].attn.qkv.weight[:32].zero_()  # the query and key rows
        model.blocks[0].attn.qkv.weight[32:].normal_(0, 0.5)  # the values and the output: an attention branch
        model.blocks[0].attn.proj.weight.normal_(0, 0.5)  # as large as the skip path
        model.blocks[0].mlp.fc2.weight.zero_()
    skip = copy.deepcopy(model)
    with torch.no_grad():
        skip.blocks[0].attn.proj.weight.zero_()
    m = load(model)
    x, t = inputs(), torch.tensor([1, 1, 2])
    logit, f_skip = target_logit(m, x, t), target_logit(load(skip), x, t)
    assert np.abs(logit - f_skip).min() > 1e-3  # the attention branch matters
    np.testing.assert_allclose(relevance_sums(m, x, t), f_skip + (logit - f_skip) / 2, rtol=1e-10)


def test_with_real_attention_the_softmax_absorbs_what_its_rule_says():
    """One block, no norms, MLP and biases at zero, q and k not: the model is f = head(mean(X + proj(A v))).
    The input relevance is then f_skip + f_attn / 2 (the v half of A v, passed on linearly) plus what reaches
    the scores s = q k^T: the paper's softmax rule R_s = s * (R_A - A sum R_A), R_A = A * h with h half of
    df/dA (the A half of A v), and the uniform rule passes all of R_s on through q and k. Computed here by hand
    from the weights, with autograd only for df/dA."""
    model = small_vit(norm_layer=nn.Identity, depth=1)
    attn = model.blocks[0].attn
    with torch.no_grad():
        attn.qkv.weight.normal_(0, 0.5)
        attn.proj.weight.normal_(0, 0.5)
        model.blocks[0].mlp.fc2.weight.zero_()
    m = load(model)
    x, t = inputs(), torch.tensor([0, 2, 1])
    with torch.no_grad():
        tokens = model.patch_embed(x)  # [B, 16, D] (the position table is zero)
        b, n, d = tokens.shape
        q, k, v = (tokens @ attn.qkv.weight.T).reshape(b, n, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) * attn.scale
    probs = scores.softmax(-1).requires_grad_(True)
    branch = attn.proj((probs @ v).transpose(1, 2).reshape(b, n, d))
    head = model.head.weight[t]  # [B, D]
    f_attn = (branch.mean(1) * head).sum(-1)
    (df_da,) = torch.autograd.grad(f_attn.sum(), probs)
    f_skip = (tokens.mean(1) * head).sum(-1)
    np.testing.assert_allclose((f_skip + f_attn).detach().numpy(), target_logit(m, x, t), rtol=1e-10)  # the hand model
    r_a = probs.detach() * df_da / 2
    r_s = scores * (r_a - probs.detach() * r_a.sum(-1, keepdim=True))
    want = f_skip + f_attn.detach() / 2 + r_s.sum(dim=(1, 2, 3))
    assert np.abs(r_s.sum(dim=(1, 2, 3)).numpy()).min() > 1e-4  # the scores do carry relevance here
    np.testing.assert_allclose(relevance_sums(m, x, t), want.numpy(), rtol=1e-9)


def test_the_softmax_rule_of_the_paper_is_the_softmax_gradient_times_its_input():
    """Prop. 3.1: R_s = s * (R_A - A sum(R_A)) with R_A = A * g_A equals s * (d softmax / d s)^T g_A."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(4, 7, dtype=torch.float64, generator=g, requires_grad=True)
    upstream = torch.randn(4, 7, dtype=torch.float64, generator=g)
    a = s.softmax(-1)
    (grad,) = torch.autograd.grad(a, s, upstream)
    r_a = a.detach() * upstream
    rule = s.detach() * (r_a - a.detach() * r_a.sum(-1, keepdim=True))
    torch.testing.assert_close(s.detach() * grad, rule, rtol=1e-12, atol=1e-14)


def _rule_state(model: nn.Module) -> list:
    """What the mode switches: per-instance forwards, timm's fused_attn flags, Hugging Face attention choices."""
    return [("forward" in mod.__dict__, getattr(mod, "fused_attn", None),
             getattr(getattr(mod, "config", None), "_attn_implementation", None)) for mod in model.modules()]


@pytest.mark.parametrize("name", ["ref-vit", "deit_tiny_distilled_patch16_224", "vit_little_patch16_reg4_gap_256"])
def test_the_mode_leaves_outputs_unchanged_and_restores_every_switch(name):
    m = vl.load_model(name, device="cpu") if name.startswith("ref-") else get_model(name, img_size=64, num_classes=5)
    for b in m.blocks():
        b.attn.fused_attn = False  # the user's setting, which the mode switches to the fused path and back
    state = _rule_state(m.model)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(6))
    before = m.logits(x)
    with attnlrp_mode(m) as mode:
        assert all(b.attn.fused_attn for b in m.blocks())
        torch.testing.assert_close(m.logits(x), before, rtol=1e-5, atol=1e-5)
        assert mode.attention_calls == m.spec.num_layers
    assert _rule_state(m.model) == state
    assert torch.equal(m.logits(x), before)
    with pytest.raises(RuntimeError, match="inside"):
        with attnlrp_mode(m):
            raise RuntimeError("failed inside")
    assert _rule_state(m.model) == state
    assert not torch._C._is_torch_function_mode_enabled()  # the mode is off again on this thread
    a = attribute(m, x, method="attnlrp")
    assert a.maps.shape == (2, *m.spec.grid) and np.isfinite(a.maps).all()
    assert all(p.grad is None and not p.requires_grad for p in m.model.parameters())


def _lxt_rules() -> types.ModuleType:
    """lxt's rule functions (``lxt.efficient.rules``), loaded from their file: importing the package runs
    lxt.efficient's model patches, which need a transformers with ``modeling_attn_mask_utils``."""
    found = importlib.util.find_spec("lxt")  # finds the package without running it
    path = Path(found.origin).parent / "efficient" / "rules.py" if found and found.origin else None
    if path is not None and path.is_file():
        spec = importlib.util.spec_from_file_location("lxt_efficient_rules", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    pytest.skip("lxt is not installed (pip install --no-deps lxt): nothing to compare with")


def test_relevance_agrees_with_a_vit_patched_with_lxts_own_rules():
    """lxt 2.1 has no timm ViT (its efficient ViT is torchvision's, with CP-LRP inside the attention), so the
    reference patches a copy of a timm ViT with lxt's own functions as lxt's AttnLRP patches apply them:
    ``stop_gradient`` on the LayerNorm std, ``identity_rule_implicit`` on GELU, and ``divide_gradient`` by
    4 on q and k and by 2 on v (its ``wrap_attention_forward``)."""
    rules = _lxt_rules()
    m = get_model("vit_tiny_patch16_224", img_size=64)
    ref = copy.deepcopy(m.model)

    def layer_norm(self, x):
        mean = x.mean(dim=-1, keepdim=True)
        std = (((x - mean) ** 2).mean(dim=-1, keepdim=True) + self.eps).sqrt()
        return (x - mean) / rules.stop_gradient(std) * self.weight + self.bias

    def attention(self, x, attn_mask=None, is_causal=False):
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k, v = rules.divide_gradient(q, 4), rules.divide_gradient(k, 4), rules.divide_gradient(v, 2)
        out = ((q * self.scale) @ k.transpose(-2, -1)).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).reshape(b, n, c))

    for mod in ref.modules():
        if isinstance(mod, nn.LayerNorm):
            mod.forward = types.MethodType(layer_norm, mod)
        elif isinstance(mod, nn.GELU):
            mod.forward = types.MethodType(lambda self, x: rules.identity_rule_implicit(nn.GELU.forward.__get__(self), x), mod)
        elif type(mod).__name__ == "Attention":
            mod.forward = types.MethodType(attention, mod)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(11))
    t = torch.tensor([3, 9])
    xi = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ref(xi)[torch.arange(2), t].sum(), xi)
    want = (xi * g).detach()
    ours = attnlrp_relevance(m, x, t)
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-6 * float(want.abs().max()))
