"""AttnLRP: relevance conservation on hand-built bias-free models (exact, float64), the exact bias ledger
when biases are there, the uniform rule's known share on uniform attention, the softmax rule as the
paper writes it, outputs unchanged by the mode and every switch restored, and agreement with a reference
built from lxt's own rule functions where lxt is present. On the other families: Hugging Face and
torchvision copies of a timm ViT get the timm relevance (float64), the rule forms of SDPA and multi-head
attention equal torch's, each family's own modules (gated MLPs, QuickGELU, RmsNorm, relative bias, rotary
attention) pass on a known share of the score, every family of the matrix runs, and what no rule covers
is refused by name."""
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


def assert_half_of_the_attention_branch(model: nn.Module, t: torch.Tensor) -> None:
    """The input relevance is f_skip + f_attn / 2: the logit without the first block's attention output
    (f_skip) plus half of what that output adds (the uniform rule on A v, with uniform attention)."""
    skip = copy.deepcopy(model)
    with torch.no_grad():
        skip.blocks[0].attn.proj.weight.zero_()
    m = load(model)
    x = inputs()
    logit, f_skip = target_logit(m, x, t), target_logit(load(skip), x, t)
    assert np.abs(logit - f_skip).min() > 1e-3  # the attention branch matters
    np.testing.assert_allclose(relevance_sums(m, x, t), f_skip + (logit - f_skip) / 2, rtol=1e-10)


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
    assert_half_of_the_attention_branch(model, torch.tensor([1, 1, 2]))


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


# ---- the same rules on every family: independent checks on copied weights, known answers, the family matrix ----

def timm_token_vit(seed: int = 1) -> nn.Module:
    """A 32 px class-token ViT with every bias, the class token and the position table random, float64."""
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(seed)
    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5,
                              mlp_ratio=2.0, global_pool="token")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name in ("pos_embed", "cls_token"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif p.ndim >= 2:  # unit-scale layers (timm's init makes the head, and so the relevance, tiny)
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
    return model.double().eval()


def hf_vit_copy(model: nn.Module, attn_implementation: str) -> nn.Module:
    """A Hugging Face ViTForImageClassification carrying the timm ViT's weights (transformers 5 names)."""
    import transformers as tr

    blk = model.blocks[0]
    cfg = tr.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=len(model.blocks),
                       num_attention_heads=2, intermediate_size=blk.mlp.fc1.out_features, num_labels=5,
                       layer_norm_eps=blk.norm1.eps, hidden_act="gelu", attn_implementation=attn_implementation)
    hf = tr.ViTForImageClassification(cfg).double().eval()
    sd = {"vit.embeddings.cls_token": model.cls_token, "vit.embeddings.position_embeddings": model.pos_embed,
          "vit.embeddings.patch_embeddings.projection.weight": model.patch_embed.proj.weight,
          "vit.embeddings.patch_embeddings.projection.bias": model.patch_embed.proj.bias,
          "vit.layernorm.weight": model.norm.weight, "vit.layernorm.bias": model.norm.bias,
          "classifier.weight": model.head.weight, "classifier.bias": model.head.bias}
    for i, b in enumerate(model.blocks):
        pre = f"vit.layers.{i}."
        for name, w, bias in zip("qkv", b.attn.qkv.weight.chunk(3), b.attn.qkv.bias.chunk(3)):
            sd.update({pre + f"attention.{name}_proj.weight": w, pre + f"attention.{name}_proj.bias": bias})
        sd.update({pre + "attention.o_proj.weight": b.attn.proj.weight, pre + "attention.o_proj.bias": b.attn.proj.bias,
                   pre + "layernorm_before.weight": b.norm1.weight, pre + "layernorm_before.bias": b.norm1.bias,
                   pre + "layernorm_after.weight": b.norm2.weight, pre + "layernorm_after.bias": b.norm2.bias,
                   pre + "mlp.fc1.weight": b.mlp.fc1.weight, pre + "mlp.fc1.bias": b.mlp.fc1.bias,
                   pre + "mlp.fc2.weight": b.mlp.fc2.weight, pre + "mlp.fc2.bias": b.mlp.fc2.bias})
    hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
    return hf


def torchvision_vit_copy(model: nn.Module) -> nn.Module:
    """torchvision's VisionTransformer (nn.MultiheadAttention blocks) carrying the timm ViT's weights."""
    from torchvision.models.vision_transformer import VisionTransformer

    tv = VisionTransformer(image_size=32, patch_size=8, num_layers=len(model.blocks), num_heads=2, hidden_dim=32,
                           mlp_dim=model.blocks[0].mlp.fc1.out_features, num_classes=5).double().eval()
    sd = {"conv_proj.weight": model.patch_embed.proj.weight, "conv_proj.bias": model.patch_embed.proj.bias,
          "class_token": model.cls_token, "encoder.pos_embedding": model.pos_embed,
          "encoder.ln.weight": model.norm.weight, "encoder.ln.bias": model.norm.bias,
          "heads.head.weight": model.head.weight, "heads.head.bias": model.head.bias}
    for i, b in enumerate(model.blocks):
        pre = f"encoder.layers.encoder_layer_{i}."
        sd.update({pre + "ln_1.weight": b.norm1.weight, pre + "ln_1.bias": b.norm1.bias,
                   pre + "self_attention.in_proj_weight": b.attn.qkv.weight,
                   pre + "self_attention.in_proj_bias": b.attn.qkv.bias,
                   pre + "self_attention.out_proj.weight": b.attn.proj.weight,
                   pre + "self_attention.out_proj.bias": b.attn.proj.bias,
                   pre + "ln_2.weight": b.norm2.weight, pre + "ln_2.bias": b.norm2.bias,
                   pre + "mlp.0.weight": b.mlp.fc1.weight, pre + "mlp.0.bias": b.mlp.fc1.bias,
                   pre + "mlp.3.weight": b.mlp.fc2.weight, pre + "mlp.3.bias": b.mlp.fc2.bias})
    tv.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=True)
    return tv


def float64_relevance(m: vl.LoadedModel, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return attnlrp_relevance(m, x, t, lambda inp: m.forward(inp))


@pytest.mark.parametrize("copy_as", ["hf-sdpa", "hf-eager", "torchvision"])
def test_the_same_weights_in_hugging_face_and_torchvision_get_the_timm_relevance(copy_as):
    """A timm ViT (every bias, class token and position table random) and its copy in Hugging Face's ViT (on
    sdpa, and on eager, which the mode switches to sdpa) or torchvision's (nn.MultiheadAttention, written out
    by the rule) compute the same function with the same operations, so the rules give the same pixel
    relevance to float64 rounding; the timm relevance is itself pinned by the hand-built tests above."""
    model = timm_token_vit()
    other = {"hf-sdpa": lambda: hf_vit_copy(model, "sdpa"), "hf-eager": lambda: hf_vit_copy(model, "eager"),
             "torchvision": lambda: torchvision_vit_copy(model)}[copy_as]()
    ours, theirs = load(model), vl.LoadedModel.from_module(other, name=copy_as, device="cpu")
    x, t = inputs(2), torch.tensor([1, 4])
    rtol = 1e-6 if copy_as == "hf-eager" else 1e-10  # transformers' eager softmax runs in float32
    with torch.no_grad():
        torch.testing.assert_close(theirs.forward(x), ours.forward(x), rtol=rtol, atol=0)  # the same function
    want = float64_relevance(ours, x, t)
    got = float64_relevance(theirs, x, t)
    assert want.abs().max() > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12 * float(want.abs().max()))
    xi = x.clone().requires_grad_(True)  # and the rules did change something: plain input x gradient differs
    (g,) = torch.autograd.grad(ours.forward(xi)[torch.arange(2), t].sum(), xi)
    assert (xi * g - want).abs().max() > 1e-3 * want.abs().max()


@pytest.mark.parametrize("case", ["batch-first", "sequence-first", "masks", "kdim", "unbatched"])
def test_the_written_out_multi_head_attention_equals_nn_multihead_attention(case):
    """The rule form of F.multi_head_attention_forward has the module's own outputs and per-head or averaged
    weights, float64, with bool / float attention masks and key padding, separate k/v sizes, unbatched input."""
    from vitlens.attribution.lrp import _RuleMode

    torch.manual_seed(4)
    kw = {"kdim": 6, "vdim": 10} if case == "kdim" else {}
    mha = nn.MultiheadAttention(8, 2, batch_first=case != "sequence-first", **kw).double().eval()
    g = torch.Generator().manual_seed(9)
    shape = (5, 8) if case == "unbatched" else (3, 5, 8)
    q = torch.randn(*shape, generator=g, dtype=torch.float64)
    k = torch.randn(*shape[:-1], kw.get("kdim", 8), generator=g, dtype=torch.float64)
    v = torch.randn(*shape[:-1], kw.get("vdim", 8), generator=g, dtype=torch.float64)
    extra = {}
    if case == "masks":
        padding = torch.tensor([[False] * 5, [False, True, False, False, True], [True] + [False] * 4])
        extra = {"attn_mask": torch.rand(5, 5, generator=g, dtype=torch.float64),
                 "key_padding_mask": torch.zeros(3, 5, dtype=torch.float64).masked_fill(padding, float("-inf"))}
    for average in (True, False):
        want = mha(q, k, v, need_weights=True, average_attn_weights=average, **extra)
        with _RuleMode() as mode:
            got = mha(q, k, v, need_weights=True, average_attn_weights=average, **extra)
        assert mode.attention_calls == 1
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-13)
    if case == "masks":  # a boolean attention mask (True = not allowed) as well
        causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
        want = mha(q, k, v, attn_mask=causal, need_weights=False)[0]
        with _RuleMode():
            torch.testing.assert_close(mha(q, k, v, attn_mask=causal, need_weights=False)[0], want, rtol=1e-12,
                                       atol=1e-13)


def test_scaled_dot_product_attention_in_rule_form_equals_torchs():
    """uniform_attention has SDPA's value with a float bias, a boolean mask, is_causal, a scale and grouped
    key/value heads (enable_gqa)."""
    from vitlens.attribution.lrp_rules import uniform_attention

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    bias = torch.randn(4, 6, 7, generator=g, dtype=torch.float64)
    allowed = torch.rand(6, 7, generator=g) > 0.3
    allowed[:, 0] = True  # no row without a key
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for kw in ({"attn_mask": bias}, {"attn_mask": allowed}, {"is_causal": True}, {"scale": 0.3}, {}):
        want = sdpa(q, k, v, enable_gqa=True, **kw)
        torch.testing.assert_close(uniform_attention(q, k, v, enable_gqa=True, **kw), want, rtol=1e-12, atol=1e-13)


#: parameters that enter as additive constants (they absorb relevance), the attention output projections, and
#: the query and key projections (zero: every attention row is uniform)
CONSTANTS = ("bias", "pos_embed", "position_embed", "positional_embedding", "pos_embedding", "cls_token",
             "class_token", "class_embedding", "reg_token", "register_tokens", "mask_token")
ATTENTION_OUT = ("attn.proj.weight", "attn_out_proj.weight", "o_proj.weight", "out_proj.weight")
QUERY_KEY = ("q_proj.weight", "k_proj.weight")


def one_block_model(family: str) -> nn.Module:
    """A one-block model of the family that pools its class token (Hugging Face CLIP with QuickGELU, ViT with
    the tanh GELU formula, DINOv2 with its gated SwiGLUFFN, open_clip, torchvision)."""
    import transformers as tr

    torch.manual_seed(0)
    common = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=32,
                  patch_size=8)
    if family == "hf-clip":
        return tr.CLIPVisionModel(tr.CLIPVisionConfig(**common))
    if family == "hf-vit-gelu-new":  # transformers' tanh GELU formula (NewGELUActivation), elementwise ops
        return tr.ViTForImageClassification(tr.ViTConfig(hidden_act="gelu_new", num_labels=5, **common))
    if family == "hf-dinov2-swiglu":
        return tr.Dinov2Model(tr.Dinov2Config(use_swiglu_ffn=True, **common))
    if family == "openclip":
        import open_clip

        return open_clip.model.CLIP(embed_dim=16, vision_cfg=dict(image_size=32, patch_size=8, width=32, layers=1,
                                                                  head_width=16),
                                    text_cfg=dict(context_length=8, vocab_size=64, width=32, heads=2, layers=1))
    from torchvision.models.vision_transformer import VisionTransformer

    return VisionTransformer(image_size=32, patch_size=8, num_layers=1, num_heads=2, hidden_dim=32, mlp_dim=64,
                             num_classes=5)


def rule_linear_model(family: str) -> tuple[nn.Module, float]:
    """A family's model, float64, with every additive constant at zero, made so that the rules give a known
    share of the explained score to the input (returned with it).

    Mean-pooled (EVA02, a parallel-block ViT): the attention output projections at zero; what is left (norms
    with their std constant, activations as x times a constant ratio, gated units whose product's relevance
    is split in halves, linear maps) is linear under the rules: the share is 1. Class-token-pooled (one block):
    the class token reaches the patches only through its attention, made uniform (queries and keys at zero,
    so the scores and their relevance are zero); the uniform rule hands half of A v's relevance to A, where
    it stays, and everything after is linear under the rules: the share is 1/2."""
    import timm

    if family == "timm-eva02":
        model, share = timm.create_model("eva02_tiny_patch14_224", pretrained=False, img_size=28, depth=2,
                                         num_classes=5), 1.0
    elif family == "timm-vit-parallel":
        model, share = timm.create_model("vit_base_patch16_xp_224", pretrained=False, img_size=32, patch_size=8,
                                         depth=2, embed_dim=32, num_heads=2, num_classes=5, class_token=False,
                                         global_pool="avg"), 1.0
    else:
        model, share = one_block_model(family), 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(c in name for c in CONSTANTS) or (share == 1 and name.endswith(ATTENTION_OUT)):
                p.zero_()
            elif share < 1 and (name.endswith(QUERY_KEY) or name.endswith("in_proj_weight")):
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
                if name.endswith("in_proj_weight"):
                    p[: 2 * p.shape[1]].zero_()  # the query and key rows of the fused projection
                else:
                    p.zero_()
            elif p.ndim >= 2 and "rope" not in name:  # unit-scale weights, so the relevance is not tiny
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
    return model.double().eval(), share


@pytest.mark.parametrize("family", ["timm-eva02", "timm-vit-parallel", "hf-clip", "hf-vit-gelu-new",
                                    "hf-dinov2-swiglu", "openclip", "torchvision"])
def test_every_familys_own_modules_pass_on_the_known_share_of_the_score(family):
    """The first and third tests' constructions on the other families' own modules: EVA02's SwiGLU (GluMlp;
    plain backprop counts a product's gradient x input twice, the uniform rule once), the parallel block's
    RmsNorm, CLIP's QuickGELU, DINOv2's SwiGLUFFN, open_clip's and torchvision's nn.MultiheadAttention and
    blocks; the input relevance is the known share of the explained score to float64 rounding."""
    model, share = rule_linear_model(family)
    m = vl.LoadedModel.from_module(model, name=family, device="cpu")
    x = torch.randn(2, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    t = torch.tensor([0, 3])  # a class, or a feature of a feature model
    with torch.no_grad():
        score = m.forward(x)[torch.arange(2), t]
    assert score.abs().min() > 1e-3
    got = float64_relevance(m, x, t).sum(dim=(1, 2, 3))
    torch.testing.assert_close(got, share * score, rtol=1e-10, atol=1e-12)
    xi = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(m.forward(xi)[torch.arange(2), t].sum(), xi)
    assert ((xi * g).sum(dim=(1, 2, 3)) - share * score).abs().max() > 1e-3 * score.abs().max()


@pytest.mark.parametrize("name", ["beit_base_patch16_224", "eva02_tiny_patch14_224",
                                  "vit_small_patch16_rope_mixed_224", "vit_small_patch16_rope_224"])
def test_relative_bias_and_rotary_attention_hand_half_the_attention_branch_to_the_input(name):
    """The uniform-attention test on BEiT's relative-position bias (a random table: the rows are not uniform,
    but constant in x, the bias being added to the scores) and on EVA02's and the RoPE ViTs' rotary q and k
    (rotating q = k = 0 leaves them 0): norms as identities, MLP and constants at zero, so the model is
    linear with f = f_skip + f_attn and the rules give the input f_skip + f_attn / 2."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=32, patch_size=8, depth=1, embed_dim=32, num_heads=2,
                              num_classes=3, norm_layer=nn.Identity)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "relative_position_bias_table" in pname:
                p.normal_(0, 1)
            elif "gamma" in pname:  # layer scale at 1, so the attention branch is as large as the skip
                p.fill_(1.0)
            elif any(c in pname for c in CONSTANTS) or pname.endswith(("mlp.fc2.weight", *QUERY_KEY)):
                p.zero_()
            elif pname.endswith("qkv.weight"):
                p.normal_(0, 0.5)
                p[: 2 * p.shape[1]].zero_()  # the query and key rows
            elif p.ndim >= 2 and "rope" not in pname:
                p.normal_(0, p[0].numel() ** -0.5)
    assert_half_of_the_attention_branch(model.double().eval(), torch.tensor([1, 0, 2]))


def _family_matrix() -> list[str]:
    from test_families import EAGER, FAMILIES

    return FAMILIES + EAGER  # the eager rows: switched to sdpa for the call and back


@pytest.mark.parametrize("family", _family_matrix())
def test_attnlrp_runs_on_every_family_with_its_outputs_unchanged_and_every_switch_restored(family):
    """Every family of the matrix: the mode leaves the output unchanged within float32 rounding (the rule forms
    are the same operations in another order than the fused kernels: each float32 op rounds at ~6e-8 relative,
    a handful per block over two blocks stays far below the 1e-5 of the output's scale allowed here), every
    attention ran under the uniform rule, the maps are finite on the patch grid (a class; a prompt for a text
    tower; a feature for a feature model, whose attribution needs a target it does not have), and every
    switch is back afterwards."""
    from test_families import build
    from test_text_targets import char_tokenizer

    from vitlens.attribution.text import has_text_tower

    module, _ = build(family)
    if family == "torchvision":  # torchvision starts its head at zero, which would make every map zero
        torch.nn.init.normal_(module.heads.head.weight, std=0.5)
    m = vl.LoadedModel.from_module(module, name=family, device="cpu")
    x = torch.randn(2, 3, *m.spec.image_size, generator=torch.Generator().manual_seed(2))
    state = _rule_state(m.model)
    with torch.no_grad():
        before = m.forward(x)
        with attnlrp_mode(m) as mode:
            during = m.forward(x)
    assert mode.attention_calls >= m.spec.num_layers
    torch.testing.assert_close(during, before, rtol=1e-5, atol=1e-5 * float(before.abs().max()))
    if m.spec.num_classes:
        a = attribute(m, x, method="attnlrp")
    elif has_text_tower(m):
        a = attribute(m, x, method="attnlrp", target="a photo", tokenizer=char_tokenizer)
        assert a.target_kind == "text"
    else:  # a tower without classes: the output's norm is explained (issue 63.1); a class is refused
        assert attribute(m, x, method="attnlrp").target_kind == "output"
        with pytest.raises(vl.InvalidParameterError, match="no classifier head"):
            attribute(m, x, method="attnlrp", target=1)
        relevance = attnlrp_relevance(m, x, torch.tensor([0, 1]))  # the rules on the model's features
        from vitlens.core.resample import pixels_to_grid

        a = types.SimpleNamespace(maps=pixels_to_grid(relevance, m.spec.grid))
    assert a.maps.shape == (2, *m.spec.grid) and np.isfinite(a.maps).all() and np.abs(a.maps).max() > 0
    assert _rule_state(m.model) == state
    with torch.no_grad():
        assert torch.equal(m.forward(x), before)


def hand_softmax_attention(self, x, attn_mask=None, is_causal=False):
    """A user's attention written out with its own softmax (timm's non-fused path, by hand)."""
    b, n, c = x.shape
    q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    return self.proj((((q * self.scale) @ k.transpose(-2, -1)).softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))


def test_what_no_rule_covers_is_refused_saying_what_and_what_to_use():
    x, t = inputs(1), torch.tensor([0])
    m = load(small_vit())
    m.model.blocks[1].attn.forward = types.MethodType(hand_softmax_attention, m.model.blocks[1].attn)
    with pytest.raises(vl.ViewNotAvailableError, match="computes a softmax outside scaled_dot_product_attention.*"
                                                       "Use grad_rollout"):
        attnlrp_relevance(m, x, t)
    del m.model.blocks[1].attn.forward
    m.model.blocks[0].attn.gate = nn.Linear(16, 16).double()  # timm's gated attention (sigmoid gate on the output)
    with pytest.raises(vl.ViewNotAvailableError, match="blocks.0.attn is a Attention with a sigmoid gate"):
        attnlrp_relevance(m, x, t)
    m.model.blocks[0].attn.gate = None
    m.model.train()  # dropout on the attention: the rules are for the model as it predicts
    m.model.blocks[0].attn.attn_drop.p = 0.1
    with pytest.raises(vl.ViewNotAvailableError, match="dropout_p=0.1.*model.eval"):
        attnlrp_relevance(m, x, t)
    m.model.eval()
    assert np.isfinite(relevance_sums(m, x, t)).all()  # and the model is fine again
    m.model.blocks[1].attn.forward = lambda x, **_: x * 0  # an attention that is neither SDPA nor a softmax
    with pytest.raises(vl.ViewNotAvailableError, match="saw 1 attention calls .* fewer than its 2 blocks"):
        attnlrp_relevance(m, x, t)
    del m.model.blocks[1].attn.forward
    from test_families import build

    tv = vl.LoadedModel.from_module(build("torchvision")[0], name="torchvision", device="cpu")
    tv.model.encoder.layers[0].self_attention.add_zero_attn = True
    with pytest.raises(vl.ViewNotAvailableError, match="uses add_zero_attn. Use grad_rollout"):
        attribute(tv, torch.randn(1, 3, 32, 32), method="attnlrp", target=0)


def test_the_mode_is_on_only_in_the_thread_that_entered_it():
    """The app serves several users in threads: a torch function mode is per thread, so another thread's
    forward of another model runs its own plain operations meanwhile."""
    import threading

    m = load(small_vit())
    seen = []
    with attnlrp_mode(m):
        worker = threading.Thread(target=lambda: seen.append(torch._C._is_torch_function_mode_enabled()))
        worker.start()
        worker.join()
        assert torch._C._is_torch_function_mode_enabled()
    assert seen == [False]


def map_model(family: str) -> nn.Module:
    """A ViT whose output is its attention pool's (MAP head), float64, bias- and position-free, with every block's
    attention output at zero and the pool's keys at zero: the pool's latent query then attends uniformly."""
    import timm
    import transformers as tr

    torch.manual_seed(0)
    if family == "timm-siglip-map":
        model = timm.create_model("vit_base_patch16_siglip_224", pretrained=False, img_size=32, patch_size=8,
                                  embed_dim=32, depth=2, num_heads=2, num_classes=5)
        pool_keys, key_rows = "attn_pool.kv.weight", slice(0, 32)  # keys, then values
    else:
        model = tr.SiglipVisionModel(tr.SiglipVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                                           intermediate_size=64, image_size=32, patch_size=8))
        pool_keys, key_rows = "head.attention.in_proj_weight", slice(32, 64)  # queries, keys, values
    with torch.no_grad():
        for name, p in model.named_parameters():
            in_pool = name.startswith(("attn_pool.", "head.attention"))
            if any(c in name for c in CONSTANTS) or (not in_pool and name.endswith(ATTENTION_OUT)):
                p.zero_()
            elif p.ndim >= 2:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
                if name == pool_keys:
                    p[key_rows].zero_()
    return model.double().eval()


@pytest.mark.parametrize("family", ["timm-siglip-map", "hf-siglip"])
def test_a_map_head_with_uniform_pool_attention_passes_on_half_of_the_score(family):
    """timm's AttentionPoolLatent (SDPA) and SigLIP's MAP head (nn.MultiheadAttention with a learned probe):
    with the blocks' attention at zero the patch tokens reach the pool through rule-linear operations; the
    pool's scores are zero (no keys), so the uniform rule keeps half of A v's relevance in A and passes half
    on through v; the pool's norm, MLP and head are rule-linear: the input relevance is half the score."""
    m = vl.LoadedModel.from_module(map_model(family), name=family, device="cpu")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    t = torch.tensor([1, 2])
    with torch.no_grad():
        score = m.forward(x)[torch.arange(2), t]
    assert score.abs().min() > 1e-3
    torch.testing.assert_close(float64_relevance(m, x, t).sum(dim=(1, 2, 3)), score / 2, rtol=1e-10, atol=1e-12)
    xi = x.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(m.forward(xi)[torch.arange(2), t].sum(), xi)
    assert ((xi * g).sum(dim=(1, 2, 3)) - score / 2).abs().max() > 1e-3 * score.abs().max()
