"""AttnLRP's rules (Achtibat et al., ICML 2024) as functions with modified backward passes, one per operation
kind, for ``vitlens.attribution.lrp``'s mode to put in place of the model's own calls.

Every function here computes the same forward values as the operation it replaces (to float rounding) and
has the backward that the paper's rule implies in gradient x input form:

- ``uniform_attention``: scaled dot-product attention written out, with the uniform rule (Eq. 7 / Prop. 3.3)
  on both bilinear matmuls: q, k, the probabilities and v each get half of their gradient; a float mask or
  bias is added to the scores (an additive constant, which absorbs its share), a boolean mask fills -inf;
  the softmax keeps its own gradient, which is the paper's softmax rule (Prop. 3.1) in this form.
- ``multi_head_attention``: ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``) as in-projection,
  ``uniform_attention`` per head and out-projection.
- ``layer_norm_rule`` / ``rms_norm_rule``: the identity rule on the normalisation (Eq. 9 / Prop. 3.4): the
  standard deviation (root mean square) is detached.
- ``identity_rule``: an elementwise activation ``fn`` with backward fn(x) / x (Eq. 9).
- ``gated_product``: the elementwise product of two activations (a gated MLP's unit) with the uniform rule,
  half of the gradient to each factor, as lxt treats gated units.
- ``cp_attention``: CP-LRP inside attention (Ali et al., "XAI for Transformers: Better Explanations through
  Conservative Propagation", ICML 2022, the AH-rule): the attention probabilities are constants, so q and k get no
  relevance and A v passes all of its relevance on to v (lxt's ``cp_multi_head_attention_forward`` stops the gradient
  at q and k the same way).
- ``gamma_linear`` / ``gamma_conv2d``: the generalised γ-rule (Montavon et al. 2019, for signed inputs as zennit's
  ``Gamma``) in a linear or convolution layer, the rule AttnLRP's ViT experiments use in the linear layers.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.nn.grad

from ..errors import ViewNotAvailableError


#: on this thread, while ``lrp_ledger`` draws up a ledger: ``pairs``, a list of every attention's (scores,
#: probabilities)
SOFTMAX_RECORD = threading.local()


class _HalfGradient(torch.autograd.Function):
    """Identity forward, half the gradient backward: the uniform rule on one operand of a bilinear product."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 0.5


class _IdentityRule(torch.autograd.Function):
    """``fn(x)`` forward; backward multiplies by fn(x) / x (0 where x == 0): the identity rule."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        y = fn(x)
        ctx.save_for_backward(torch.where(x == 0, torch.zeros_like(y), y / torch.where(x == 0, torch.ones_like(x), x)))
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (ratio,) = ctx.saved_tensors
        return None, grad * ratio


def half_gradient(x: torch.Tensor) -> torch.Tensor:
    """``x`` with half of its gradient passed back (the uniform rule's share of one operand)."""
    return _HalfGradient.apply(x)


def identity_rule(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` whose backward multiplies the gradient by fn(x) / x: the identity rule of an activation."""
    return _IdentityRule.apply(fn, x)


def gated_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a * b`` with the uniform rule: half of the product's gradient x input to each factor."""
    return half_gradient(a) * half_gradient(b)


def layer_norm_rule(x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, eps: float = 1e-5) -> torch.Tensor:
    """``F.layer_norm`` with its standard deviation detached: linear in x for the backward pass."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    centred = x - x.mean(dims, keepdim=True)
    std = (centred.pow(2).mean(dims, keepdim=True) + eps).sqrt()
    y = centred / std.detach()
    if weight is not None:
        y = y * weight
    return y + bias if bias is not None else y


def rms_norm_rule(x: torch.Tensor, normalized_shape: Any, weight: torch.Tensor | None = None,
                  eps: float | None = None) -> torch.Tensor:
    """``F.rms_norm`` (and timm's ``RmsNorm``) with the root mean square detached."""
    dims = tuple(range(-len(tuple(normalized_shape)), 0))
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    y = x / (x.pow(2).mean(dims, keepdim=True) + eps).sqrt().detach()
    return y * weight if weight is not None else y


class _GammaRule(torch.autograd.Function):
    """``fn(x, weight, bias)`` forward (a linear map of x plus a bias); backward: the generalised γ-rule in gradient x
    input form. With contributions c_jk = x_j w_jk of input j to output z_k, output k passes its relevance
    R_k = z_k g_k on in proportion to c_jk + γ c_jk⁺ where z_k > 0 (c_jk + γ c_jk⁻ where z_k < 0); its bias b_k,
    modified the same way (b_k + γ b_k⁺, resp. b_k + γ b_k⁻), keeps its share. The denominators are at least as
    large as |z_k| and of its sign, so no stabiliser is needed; γ = 0 is the plain gradient (the epsilon rule)."""

    @staticmethod
    def forward(ctx: Any, fn: Callable, transpose: Callable, bias_dim: int, gamma: float, x: torch.Tensor,
                weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        z = fn(x, weight, bias)
        ctx.fn, ctx.transpose, ctx.bias_dim, ctx.gamma = fn, transpose, bias_dim, gamma
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, *(() if bias is None else (bias,)), z)
        return z

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        x, weight, *rest = ctx.saved_tensors
        bias, z = (rest[0], rest[1]) if ctx.has_bias else (None, rest[0])
        fn, transpose, gamma = ctx.fn, ctx.transpose, ctx.gamma
        with torch._C.DisableTorchFunction():  # the rule's own ops, never intercepted again by the mode
            w_up, w_down = weight + gamma * weight.clamp(min=0), weight + gamma * weight.clamp(max=0)
            b_up = b_down = None
            if bias is not None:
                b_up, b_down = bias + gamma * bias.clamp(min=0), bias + gamma * bias.clamp(max=0)
            x_pos, x_neg = x.clamp(min=0), x.clamp(max=0)
            pos, neg = z > 0, z < 0
            # denominators: the contributions that share the output's sign, amplified by gamma
            d_pos = fn(x_pos, w_up, b_up) + fn(x_neg, w_down, None)
            d_neg = fn(x_pos, w_down, b_down) + fn(x_neg, w_up, None)
            relevance = grad * z
            s_pos = torch.where(pos, relevance / d_pos.where(pos, torch.ones_like(d_pos)), torch.zeros_like(z))
            s_neg = torch.where(neg, relevance / d_neg.where(neg, torch.ones_like(d_neg)), torch.zeros_like(z))
            grad_x = None
            if ctx.needs_input_grad[4]:
                # R_x / x: a positive x_j contributes with w + γ w⁺ to positive outputs and w + γ w⁻ to negative ones
                on_pos = transpose(s_pos, w_up, x.shape) + transpose(s_neg, w_down, x.shape)
                on_neg = transpose(s_pos, w_down, x.shape) + transpose(s_neg, w_up, x.shape)
                grad_x = torch.where(x > 0, on_pos, torch.where(x < 0, on_neg, torch.zeros_like(x)))
            grad_b = None
            if bias is not None and ctx.needs_input_grad[6]:  # b * grad_b is the share the bias keeps
                dim = ctx.bias_dim % z.dim()
                per = (s_pos * (1 + gamma * (bias > 0)).reshape([-1 if d == dim else 1 for d in range(z.dim())])
                       + s_neg * (1 + gamma * (bias < 0)).reshape([-1 if d == dim else 1 for d in range(z.dim())]))
                grad_b = per.sum(dim=[d for d in range(z.dim()) if d != dim])
        return None, None, None, None, grad_x, None, grad_b


def _linear_transpose(s: torch.Tensor, weight: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    return s @ weight


def gamma_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 gamma: float = 0.25) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose backward is the generalised γ-rule (see ``_GammaRule``)."""
    return _GammaRule.apply(F.linear, _linear_transpose, -1, float(gamma), x, weight, bias)


def gamma_conv2d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: Any = 1,
                 padding: Any = 0, dilation: Any = 1, groups: int = 1, *, gamma: float = 0.25) -> torch.Tensor:
    """``F.conv2d`` with the γ-rule's backward (padding 'valid', 'same' with odd kernels, or numbers)."""
    if padding == "valid":
        padding = 0
    elif padding == "same":
        kernel = weight.shape[-2:]
        dil = (dilation, dilation) if isinstance(dilation, int) else tuple(dilation)
        if any(d * (k - 1) % 2 for d, k in zip(dil, kernel)):
            raise ViewNotAvailableError("the γ-rule's convolution takes 'same' padding only where it is symmetric (odd "
                                        f"kernels); this one has a {tuple(kernel)} kernel. Use conv_gamma=0 (the plain "
                                        "rule) for this model.")
        padding = tuple(d * (k - 1) // 2 for d, k in zip(dil, kernel))

    def fn(inp: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(inp, w, b, stride, padding, dilation, groups)

    def transpose(s: torch.Tensor, w: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return torch.nn.grad.conv2d_input(shape, w, s, stride, padding, dilation, groups)

    return _GammaRule.apply(fn, transpose, 1, float(gamma), x, weight, bias)


def _attention_probs(q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool,
                     scale: float | None) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (half_gradient(q) @ half_gradient(k).transpose(-2, -1)) * scale
    if is_causal:
        allowed = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~allowed, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    probs = scores.softmax(dim=-1)  # Prop. 3.1 is the softmax's own gradient in gradient x input form
    pairs = getattr(SOFTMAX_RECORD, "pairs", None)
    if pairs is not None and scores.requires_grad:  # a conservation ledger is being drawn up (lrp_ledger)
        scores.retain_grad()
        probs.retain_grad()
        pairs.append((scores, probs))
    return probs


def uniform_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                      scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s arguments and value, with the uniform rule on q k^T and A v."""
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)[0]


def cp_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                 scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s arguments and value with CP-LRP's rule: the probabilities are constants
    (computed from detached q and k), so A v hands all of its relevance to v."""
    return _attention(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, constant_probs=True)[0]


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
               dropout_p: float, is_causal: bool, scale: float | None,
               enable_gqa: bool, constant_probs: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if dropout_p:
        raise ViewNotAvailableError(f"attnlrp runs the model in eval mode; this attention has dropout_p={dropout_p} "
                                    "(a model in training mode). Call model.eval() first.")
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        groups = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    if constant_probs:  # CP-LRP: no relevance reaches the scores; all of A v's goes to v
        probs = _attention_probs(query.detach(), key.detach(), attn_mask, is_causal, scale).detach()
        return probs @ value, probs
    probs = _attention_probs(query, key, attn_mask, is_causal, scale)
    return half_gradient(probs) @ half_gradient(value), probs


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """nn.MultiheadAttention's masks (bool True = not allowed, or float added) as one float mask."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


def multi_head_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, embed_dim_to_check: int,
                         num_heads: int, in_proj_weight: torch.Tensor | None, in_proj_bias: torch.Tensor | None,
                         bias_k: torch.Tensor | None, bias_v: torch.Tensor | None, add_zero_attn: bool,
                         dropout_p: float, out_proj_weight: torch.Tensor, out_proj_bias: torch.Tensor | None,
                         training: bool = True, key_padding_mask: torch.Tensor | None = None,
                         need_weights: bool = True, attn_mask: torch.Tensor | None = None,
                         use_separate_proj_weight: bool = False, q_proj_weight: torch.Tensor | None = None,
                         k_proj_weight: torch.Tensor | None = None, v_proj_weight: torch.Tensor | None = None,
                         static_k: torch.Tensor | None = None, static_v: torch.Tensor | None = None,
                         average_attn_weights: bool = True, is_causal: bool = False, *,
                         constant_probs: bool = False,
                         linear: Callable[..., torch.Tensor] = F.linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.multi_head_attention_forward`` written out (sequence-first [L, N, E] or unbatched [L, E]) with the
    uniform rule in every head (CP-LRP's constant probabilities with ``constant_probs``; ``linear`` is the in- and
    out-projection, ``gamma_linear`` under the γ-rule). ``is_causal`` is only a hint there (the causal
    ``attn_mask`` is required), so the mask is what is applied."""
    extras = [name for name, on in (("bias_k/bias_v", bias_k is not None or bias_v is not None),
                                    ("add_zero_attn", add_zero_attn),
                                    ("static_k/static_v", static_k is not None or static_v is not None)) if on]
    if extras:
        raise ViewNotAvailableError(f"attnlrp's nn.MultiheadAttention covers the plain in-projection / heads / "
                                    f"out-projection form; this one uses {', '.join(extras)}. Use grad_rollout, "
                                    "input_x_gradient or a CAM method instead.")
    unbatched = query.dim() == 2
    if unbatched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    (tgt, batch, embed), src = query.shape, key.shape[0]
    if use_separate_proj_weight:
        weights: tuple[torch.Tensor | None, ...] = (q_proj_weight, k_proj_weight, v_proj_weight)
    elif in_proj_weight is None:
        raise ViewNotAvailableError("attnlrp's nn.MultiheadAttention needs in_proj_weight (or q/k/v_proj_weight with "
                                    "use_separate_proj_weight); this call passed neither.")
    else:
        weights = in_proj_weight.chunk(3)
    biases = in_proj_bias.chunk(3) if in_proj_bias is not None else (None, None, None)
    head_dim = embed // num_heads

    # [L, N, E] -> [N, H, L, hd]
    def heads(t: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        return linear(t, w, b).reshape(t.shape[0], batch * num_heads, head_dim).transpose(0, 1).reshape(
            batch, num_heads, t.shape[0], head_dim)

    q, k, v = (heads(t, w, b) for t, w, b in zip((query, key, value), weights, biases))
    mask = _additive_mask(attn_mask, q.dtype)
    if mask is not None:
        mask = mask.reshape(batch, num_heads, tgt, src) if mask.dim() == 3 else mask
    padding = _additive_mask(key_padding_mask, q.dtype)
    if padding is not None:
        padding = padding.reshape(batch, 1, 1, src)
        mask = padding if mask is None else mask + padding
    out, probs = _attention(q, k, v, mask, dropout_p if training else 0.0, False, None, False, constant_probs)
    out = linear(out.permute(2, 0, 1, 3).reshape(tgt, batch, embed), out_proj_weight, out_proj_bias)
    weights_out = None
    if need_weights:
        weights_out = probs.mean(dim=1) if average_attn_weights else probs
        weights_out = weights_out.squeeze(0) if unbatched else weights_out
    return (out.squeeze(1) if unbatched else out), weights_out
