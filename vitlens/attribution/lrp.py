"""AttnLRP (Achtibat et al., "AttnLRP: Attention-Aware Layer-Wise Relevance Propagation for
Transformers", ICML 2024) as one gradient x input pass with modified backward functions.

LRP's rules, written as gradients: when every operation's backward is replaced by the one its LRP
rule implies, ``input * grad`` at the pixels is the relevance the rules propagate from the target
logit. Per operation of a timm ``Block`` (and what the paper calls it):

- linear layers (qkv, proj, fc1, fc2, head, patch embedding): the plain gradient. In gradient x
  input form the epsilon rule (Eq. 8) is exactly backprop with epsilon -> 0: R_x = x * W^T (R_z / z)
  and R_z = z * g_z give R_x = x * W^T g_z. (lxt's efficient mode does the same; epsilon only
  stabilises the explicit form's division.) A bias b absorbs b * g_b of the relevance.
- LayerNorm: the identity rule on the normalisation (Eq. 9 / Prop. 3.4): the standard deviation is
  treated as a constant (detached), so (x - mean(x)) / std is linear in x for the backward pass.
- GELU (and SiLU): the identity rule (Eq. 9): gelu(x) = x * (gelu(x) / x) with the ratio constant;
  the backward multiplies by gelu(x) / x.
- the bilinear matmuls q k^T and A v: the uniform rule (Eq. 7 / Prop. 3.3): each operand gets half
  of the product's relevance, i.e. half of its gradient (so q and k get a quarter in all, as lxt's
  ``wrap_attention_forward`` divides them by 4 and v by 2).
- softmax: the paper's rule (Prop. 3.1, the Taylor decomposition at the input with bias),
  R_s = s * (R_A - A * sum R_A), is in gradient x input form exactly the softmax's own gradient
  (with R_A = A * g_A: s * J^T g_A = s * (A g_A - A <A, g_A>)), so softmax needs no change; its
  bias term absorbs sum(R_A) - sum(R_s) of the relevance.

So the input relevance sums to the target logit less what the biases (including the class token,
registers and position embedding, which enter as additive constants) and each softmax absorb; the
tests check that ledger on hand-built models. The patched mode replaces, per module instance (not
per class), the ``forward`` of timm's ``Attention`` (explicit ops instead of fused SDPA),
``nn.LayerNorm`` and the GELU/SiLU activations for the duration of one call; ``attnlrp_mode``
restores them on exit and on error. The model's outputs are unchanged within float rounding.
Families: timm ``VisionTransformer`` (ViT, DeiT and distilled DeiT, register and GAP models, hybrids);
others are refused by name. LRP is a patented technique, free for personal and scientific use
(lxt's README); this module is our own code following the paper and lxt's rule definitions.
"""
from __future__ import annotations

import types
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..errors import ViewNotAvailableError
from ..families.base import Handles, HookSession
from ..loading.model import LoadedModel

_MISSING = object()


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
    return _HalfGradient.apply(x)


def _layer_norm_forward(self: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm over the last dimension with its standard deviation detached (the identity rule)."""
    mean = x.mean(-1, keepdim=True)
    centred = x - mean
    std = (centred.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
    y = centred / std.detach()
    if self.weight is not None:
        y = y * self.weight
    if self.bias is not None:
        y = y + self.bias
    return y


def _attention_forward(self: nn.Module, x: torch.Tensor, attn_mask: torch.Tensor | None = None,
                       is_causal: bool = False) -> torch.Tensor:
    """timm ``Attention.forward`` on explicit ops, with the uniform rule on both matmuls."""
    if attn_mask is not None or is_causal:
        raise ViewNotAvailableError("attnlrp does not take attention masks (a masked or causal timm Attention).")
    b, n, _ = x.shape
    qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    q, k = self.q_norm(q), self.k_norm(k)
    scores = (half_gradient(q) * self.scale) @ half_gradient(k).transpose(-2, -1)
    probs = self.attn_drop(scores.softmax(dim=-1))  # Prop. 3.1 is the softmax's own gradient in this form
    out = half_gradient(probs) @ half_gradient(v)
    out = self.norm(out.transpose(1, 2).reshape(b, n, self.attn_dim))
    return self.proj_drop(self.proj(out))


def _activation_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _IdentityRule.apply(type(self).forward.__get__(self), x)


def _is_activation(mod: nn.Module) -> bool:
    return isinstance(mod, (nn.GELU, nn.SiLU)) or type(mod).__name__ in ("GELU", "GELUTanh", "QuickGELU", "SiLU")


SUPPORTED = ("timm VisionTransformer blocks (ViT, DeiT and distilled DeiT, register and GAP models, hybrids) "
             "with timm's Attention and Mlp")


def check_supported(m: LoadedModel) -> None:
    """Raise ViewNotAvailableError unless every block is one the patched mode covers exactly."""
    from timm.layers import Mlp
    from timm.layers.attention import Attention
    from timm.models.vision_transformer import VisionTransformer

    why = ""
    if not isinstance(m.model, VisionTransformer):
        why = f"it is a {type(m.model).__name__} (family {m.spec.family})"
    elif getattr(m.model, "attn_pool", None) is not None:
        why = "it pools through an attention pool (MAP head), whose fused attention the mode does not cover"
    else:
        for name, block in zip(m.block_names(), m.blocks()):
            if type(getattr(block, "attn", None)) is not Attention or type(getattr(block, "mlp", None)) is not Mlp:
                why = (f"block {name} is a {type(block).__name__} with {type(getattr(block, 'attn', None)).__name__} / "
                       f"{type(getattr(block, 'mlp', None)).__name__}")
                break
            if getattr(block.attn, "gate", None) is not None:
                why = f"block {name} has a gated attention"
                break
    if why:
        raise ViewNotAvailableError(f"attnlrp's rules are implemented for {SUPPORTED}; {m.spec.name} is not one: "
                                    f"{why}. Use grad_rollout, input_x_gradient or a CAM method instead.")


class attnlrp_mode(HookSession):  # noqa: N801 (a context manager, used like a function)
    """``with attnlrp_mode(m):`` the model's Attention, LayerNorm and GELU/SiLU modules run with AttnLRP's
    backward rules; their own ``forward`` is back on exit, by an exception too."""

    def __init__(self, m: LoadedModel) -> None:
        check_supported(m)
        self.m = m

    def install(self, handles: Handles) -> None:
        from timm.layers.attention import Attention

        for mod in self.m.model.modules():
            if type(mod) is Attention:
                _set_forward(mod, _attention_forward, handles)
            elif type(mod).__name__ == "LayerNorm" and isinstance(mod, nn.LayerNorm):  # not LayerNorm2d (channels)
                _set_forward(mod, _layer_norm_forward, handles)
            elif _is_activation(mod):
                _set_forward(mod, _activation_forward, handles)


def _set_forward(mod: nn.Module, fn: Callable[..., torch.Tensor], handles: Handles) -> None:
    previous = mod.__dict__.get("forward", _MISSING)
    mod.forward = types.MethodType(fn, mod)

    def restore(mod: nn.Module = mod, previous: Any = previous) -> None:
        if previous is _MISSING:
            del mod.forward
        else:
            mod.forward = previous

    handles.on_remove(restore)


def attnlrp_relevance(m: LoadedModel, x: torch.Tensor, t: torch.Tensor,
                      score: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Pixel relevance [B, C, H, W] of the target scores ``t`` (one class per image) under AttnLRP's rules."""
    score = score or (lambda inp: m.forward(inp).float())
    xi = x.detach().clone().requires_grad_(True)
    with torch.enable_grad(), attnlrp_mode(m):
        (grad,) = torch.autograd.grad(score(xi).gather(1, t[:, None]).sum(), xi)
    return (xi * grad).detach()


def attnlrp_maps(m: LoadedModel, x: torch.Tensor, t: torch.Tensor, grid: tuple[int, int], params: dict[str, Any],
                 score: Callable[[torch.Tensor], torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """The ``attnlrp`` method: pixel relevance summed over channels and over each token's pixels."""
    from .methods import _pixels_to_grid

    return _pixels_to_grid(attnlrp_relevance(m, x, t, score), grid), t.cpu().numpy()
