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

Beyond ``Block``: a gated MLP's unit act(a) * b (timm ``GluMlp`` / ``SwiGLU`` in EVA02, DINOv2's
``SwiGLUFFN``) is a product of two activations and gets the uniform rule, half to each factor (as lxt
treats gated units); QuickGELU, x * sigmoid(1.702 x), gets the identity rule as a whole; RMSNorm the
identity rule with its root mean square detached; rotary q / k (EVA, RoPE, DINOv3, PE-Core) are linear in
q and k and relative-position biases (BEiT) are additive constants in the scores, so neither needs a rule.

Variants (``LRPRules``, the methods ``attnlrp_gamma`` and ``cp_lrp``), as the authors run AttnLRP on ViTs:

- the γ-rule in the linear layers (and ``conv_gamma`` in the convolutions: the patch embedding), which the AttnLRP
  paper's ViT experiments use and lxt applies through zennit's ``Gamma``: output k hands its relevance on in
  proportion to the contributions x_j w_jk amplified by γ where they share z_k's sign (``lrp_rules._GammaRule``); the
  bias keeps its (amplified) share, so conservation is exact as with the epsilon rule;
- CP-LRP inside attention (Ali et al., ICML 2022): the attention probabilities are constants, so the relevance of
  A v goes to v alone and none reaches q, k or the softmax (lxt's recommendation for ViTs, with the γ-rule outside).

So the input relevance sums to the target logit less what the biases (including the class token,
registers and position embedding, which enter as additive constants) and each softmax absorb; the
tests check that ledger on hand-built models.

How: ``attnlrp_mode`` enters a ``torch.overrides.TorchFunctionMode`` (thread-local: the function rules act on
this thread's calls only) for the forward whose gradient is taken. Its switches on the model itself (timm's
``fused_attn``, per-instance ``forward`` rules, Hugging Face configs) are on the shared module, so the mode is
a hook session that holds the model's lock (``LoadedModel.lock``) until they are undone: another thread's
forward or capture of that model waits instead of running under them. It replaces ``F.scaled_dot_product_attention``
(timm modules switched to their fused path, Hugging Face configs to ``sdpa`` for the call),
``F.multi_head_attention_forward`` (``nn.MultiheadAttention``: torchvision, open_clip, SigLIP's MAP probe),
``F.layer_norm``, ``F.rms_norm``, ``F.gelu`` and ``F.silu`` by the rule forms of ``lrp_rules``; per module
instance it sets a rule ``forward`` only where function interception cannot see the operation (QuickGELU
and transformers' GELU formulas, gated MLPs; timm's ``RmsNorm``, which calls F.rms_norm on this torch but
apex's kernel or its own rsqrt form elsewhere). A softmax or an rsqrt that the model computes outside these
(an attention or a normalisation written out by hand) is refused while the model runs, and so is a forward
with fewer attention calls than blocks; a gated attention is refused before. Everything is restored on exit
and on error, and the model's outputs are unchanged within float rounding. LRP is a patented technique, free
for personal and scientific use (lxt's README); this module is our own code following the paper and lxt's
rule definitions.
"""
from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..core.resample import pixels_to_grid
from ..errors import InvalidParameterError, ViewNotAvailableError
from ..families.base import Handles, HookSession
from ..loading.model import LoadedModel
from .lrp_rules import (cp_attention, gamma_conv2d, gamma_linear, gated_product, half_gradient, identity_rule,
                        layer_norm_rule, multi_head_attention, rms_norm_rule, uniform_attention)

__all__ = ["ATTENTION_RULES", "AttnLRPMaps", "LRPRules", "SUPPORTED", "attnlrp_maps", "attnlrp_mode",
           "attnlrp_relevance", "check_supported", "half_gradient"]

_INSTEAD = "Use grad_rollout, input_x_gradient or a CAM method instead."

SUPPORTED = ("attention through F.scaled_dot_product_attention or nn.MultiheadAttention (timm ViT / DeiT / "
             "EVA / BEiT / RoPE / parallel blocks / MAP heads, Hugging Face models on sdpa, torchvision, "
             "open_clip), LayerNorm / RMSNorm, GELU / SiLU / QuickGELU and gated MLPs")

#: the rules inside attention, by name: AttnLRP's uniform rule with the softmax's own gradient (Achtibat et al.
#: 2024), or CP-LRP's constant probabilities (Ali et al. 2022)
ATTENTION_RULES = ("uniform", "cp")


@dataclass(frozen=True)
class LRPRules:
    """Which rule each kind of operation gets: AttnLRP as vitlens's ``attnlrp`` runs it by default, and its ViT
    variants.

    Attributes:
        attention: "uniform" (AttnLRP, Achtibat et al. ICML 2024: the uniform rule on q k^T and A v, the softmax rule
            Prop. 3.1) or "cp" (CP-LRP, Ali et al. ICML 2022 "XAI for Transformers: Better Explanations through
            Conservative Propagation": the attention probabilities are constants, relevance flows through v alone).
        gamma: γ of the generalised γ-rule in every linear layer (``F.linear``: qkv, projections, MLP, head);
            0 is the epsilon rule (the plain gradient).
        conv_gamma: γ in every convolution (``F.conv2d``: the patch embedding, a hybrid's CNN stem); 0 the plain rule.
    """

    attention: str = "uniform"
    gamma: float = 0.0
    conv_gamma: float = 0.0

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_RULES:
            raise InvalidParameterError(f"attention must be one of {', '.join(ATTENTION_RULES)}; "
                                        f"got {self.attention!r}.")
        for name in ("gamma", "conv_gamma"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise InvalidParameterError(f"{name} must be a number >= 0 (0 for the epsilon rule); got {value!r}.")


_NORMS: dict[Callable[..., Any], Callable[..., torch.Tensor]] = {F.layer_norm: layer_norm_rule,
                                                                  F.rms_norm: rms_norm_rule}
#: calls that mean a rule would be bypassed: an attention or a normalisation written out by hand
_BYPASS = {torch.softmax: "a softmax", torch.Tensor.softmax: "a softmax", F.softmax: "a softmax",
           torch.rsqrt: "an rsqrt (a hand-written normalisation)",
           torch.Tensor.rsqrt: "an rsqrt (a hand-written normalisation)"}


class _RuleMode(TorchFunctionMode):
    """Replaces, on this thread only, the functions that have an AttnLRP rule by their rule forms (inside the
    handler the mode is off, so the rule's own ops are not intercepted again) and refuses the calls that
    would bypass a rule."""

    def __init__(self, rules: LRPRules | None = None) -> None:
        super().__init__()
        self.attention_calls = 0
        self.rules = rules or LRPRules()

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.rules.gamma:
            return gamma_linear(x, weight, bias, self.rules.gamma)
        return F.linear(x, weight, bias)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        cp = self.rules.attention == "cp"
        if func is F.scaled_dot_product_attention:
            self.attention_calls += 1
            return (cp_attention if cp else uniform_attention)(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            self.attention_calls += 1
            return multi_head_attention(*args, **kwargs, constant_probs=cp, linear=self._linear)
        if func is F.linear and self.rules.gamma:
            return self._linear(*args, **kwargs)
        if func is F.conv2d and self.rules.conv_gamma:
            return gamma_conv2d(*args, **kwargs, gamma=self.rules.conv_gamma)
        if func in _NORMS:
            return _NORMS[func](*args, **kwargs)
        if func is F.gelu:
            approximate = kwargs.get("approximate", args[1] if len(args) > 1 else "none")
            return identity_rule(lambda t: F.gelu(t, approximate=approximate), args[0])
        if func is F.silu:
            return identity_rule(F.silu, args[0])  # never in place: the rule needs x after fn(x)
        if func in _BYPASS:
            raise ViewNotAvailableError(
                f"attnlrp cannot apply its rules to this model: its forward computes {_BYPASS[func]} outside "
                "scaled_dot_product_attention / LayerNorm, so an attention or a normalisation would get the plain "
                f"gradient instead of its rule (the rules cover {SUPPORTED}). {_INSTEAD}")
        return func(*args, **kwargs)


def _activation_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """An activation written with elementwise ops (QuickGELU's x * sigmoid(1.702 x), transformers' tanh and erf
    GELU formulas): the identity rule on the whole."""
    return identity_rule(type(self).forward.__get__(self), x)


def _glu_mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm ``GluMlp`` (EVA02's SwiGLU, packed): the gated unit's product with the uniform rule."""
    x1, x2 = self.fc1(x).chunk(2, dim=self.chunk_dim)
    x = gated_product(x1, self.act(x2)) if self.gate_last else gated_product(self.act(x1), x2)
    return self.drop2(self.fc2(self.norm(self.drop1(x))))


def _swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm ``SwiGLU``: act(fc1_g(x)) * fc1_x(x) with the uniform rule."""
    x = gated_product(self.act(self.fc1_g(x)), self.fc1_x(x))
    return self.drop2(self.fc2(self.norm(self.drop1(x))))


def _hf_swiglu_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face DINOv2's ``SwiGLUFFN``: down_proj(act(gate_proj(x)) * up_proj(x)) with the uniform rule."""
    return self.down_proj(gated_product(self.act_fn(self.gate_proj(x)), self.up_proj(x)))


def _rms_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """timm ``RmsNorm`` (F.rms_norm, apex's fused kernel or an rsqrt form, by version) with its root mean square
    detached."""
    return rms_norm_rule(x, self.normalized_shape, self.weight, self.eps)


def _rms_norm_fp32_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight.float() if self.weight is not None else None
    return rms_norm_rule(x.float(), self.normalized_shape, weight, self.eps).to(x.dtype)


#: modules whose rule function interception cannot see (elementwise ops, or a product of two activations),
#: by class name and the attributes their rule form reads
_MODULE_RULES: dict[str, tuple[Callable[..., torch.Tensor], tuple[str, ...]]] = {
    **{name: (_activation_forward, ()) for name in (
        "QuickGELU", "QuickGELUActivation", "GELUActivation", "GELUTanh", "NewGELUActivation", "FastGELUActivation",
        "AccurateGELUActivation")},
    "GluMlp": (_glu_mlp_forward, ("fc1", "chunk_dim", "gate_last", "act", "drop1", "norm", "fc2", "drop2")),
    "SwiGLU": (_swiglu_forward, ("fc1_g", "fc1_x", "act", "drop1", "norm", "fc2", "drop2")),
    "Dinov2SwiGLUFFN": (_hf_swiglu_forward, ("gate_proj", "up_proj", "down_proj", "act_fn")),
    "Dinov2WithRegistersSwiGLUFFN": (_hf_swiglu_forward, ("gate_proj", "up_proj", "down_proj", "act_fn")),
    "RmsNorm": (_rms_norm_forward, ("normalized_shape", "weight", "eps")),
    "RmsNormFp32": (_rms_norm_fp32_forward, ("normalized_shape", "weight", "eps")),
}


def check_supported(m: LoadedModel) -> None:
    """Raise ViewNotAvailableError for the parts of a model no AttnLRP rule covers (found before running it;
    an attention or a normalisation computed by hand is found while it runs)."""
    why = ""
    for name, mod in m.model.named_modules():
        kind = type(mod).__name__
        if getattr(mod, "gate", None) is not None and "Attention" in kind:
            why = (f"{name} is a {kind} with a sigmoid gate on its output, a product that is neither an attention "
                   "nor a gated MLP unit in the paper's rules")
        elif kind in _MODULE_RULES and not all(hasattr(mod, a) for a in _MODULE_RULES[kind][1]):
            why = f"{name} is a {kind} whose attributes are not those of the {kind} the rules were written for"
        if why:
            raise ViewNotAvailableError(f"attnlrp's rules cover {SUPPORTED}; {m.spec.name} is not covered: {why}. "
                                        f"{_INSTEAD}")


def _hf_configs(model: nn.Module) -> list[Any]:
    """Every distinct Hugging Face config the modules read their attention implementation from."""
    seen: dict[int, Any] = {}
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


class attnlrp_mode(HookSession):  # noqa: N801 (a context manager, used like a function)
    """``with attnlrp_mode(m):`` the model runs with AttnLRP's backward rules on this thread.

    A ``TorchFunctionMode`` (thread-local, active only inside the block) puts the rule forms in place of
    ``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``, ``F.layer_norm``, ``F.rms_norm``,
    ``F.gelu`` and ``F.silu``; timm modules are switched to their fused (SDPA) attention and Hugging Face
    configs to ``sdpa``; QuickGELU, gated MLPs and timm's RmsNorm get a rule ``forward`` per module
    instance. Everything is back on exit, by an exception too. The switches are on the shared module, so
    the session holds the model's lock (``LoadedModel.lock``) while they are on: other threads' forwards
    and captures of the model wait. ``attention_calls`` counts the attentions that ran under an attention rule.
    ``rules`` (an ``LRPRules``) picks the variant: CP-LRP inside attention, the γ-rule in the linear layers
    (``F.linear``, also inside ``nn.MultiheadAttention``'s projections) and the convolutions (``F.conv2d``).
    """

    def __init__(self, m: LoadedModel, rules: LRPRules | None = None) -> None:
        check_supported(m)
        self.m = m
        self.rules = rules or LRPRules()
        self._mode: _RuleMode | None = None

    @property
    def attention_calls(self) -> int:
        return self._mode.attention_calls if self._mode is not None else 0

    def install(self, handles: Handles) -> None:
        for mod in self.m.model.modules():
            if isinstance(getattr(mod, "fused_attn", None), bool):  # timm: the fused path calls SDPA
                handles.set_attr(mod, "fused_attn", True)
            rule = _MODULE_RULES.get(type(mod).__name__)
            if rule is not None:
                handles.set_attr(mod, "forward", types.MethodType(rule[0], mod))
        for cfg in _hf_configs(self.m.model):
            if cfg._attn_implementation != "sdpa":  # eager would write the softmax out by hand
                handles.set_attr(cfg, "_attn_implementation", "sdpa")
        self._mode = _RuleMode(self.rules)
        self._mode.__enter__()
        mode = self._mode
        handles.on_remove(lambda: mode.__exit__(None, None, None))


def attnlrp_relevance(m: LoadedModel, x: torch.Tensor, t: torch.Tensor,
                      score: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      rules: LRPRules | None = None) -> torch.Tensor:
    """Pixel relevance of the target scores under AttnLRP's rules (or a variant of them).

    Args:
        m: the model.
        x: [B, C, H, W] preprocessed images.
        t: [B] the index of the explained score of each image.
        score: images -> [B, K] scores that ``t`` indexes; None for the model's logits.
        rules: the variant (``LRPRules``); None for AttnLRP with the epsilon rule in the linear layers.

    Returns:
        [B, C, H, W] relevance (x times its gradient under the rules).

    Raises:
        ViewNotAvailableError: when the model has parts no rule covers, or fewer attention calls than blocks.
    """
    score = score or (lambda inp: m.forward(inp).float())
    xi = x.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        with attnlrp_mode(m, rules) as mode:
            out = score(xi).gather(1, t[:, None]).sum()
            if mode.attention_calls < m.spec.num_layers:
                raise ViewNotAvailableError(
                    f"attnlrp saw {mode.attention_calls} attention calls through scaled_dot_product_attention or "
                    f"nn.MultiheadAttention in {m.spec.name}'s forward, fewer than its {m.spec.num_layers} blocks: "
                    f"the others would get the plain gradient (the rules cover {SUPPORTED}). {_INSTEAD}")
        (grad,) = torch.autograd.grad(out, xi)
    return (xi * grad).detach()


@dataclass(frozen=True)
class AttnLRPMaps:
    """The function of an ``attnlrp`` method's ``METHOD_TABLE`` entry (``attnlrp``, ``attnlrp_gamma``, ``cp_lrp``):
    pixel relevance under the entry's rules, summed over channels and over each token's pixels.

    Attributes:
        attention: the rule inside attention, one of ``ATTENTION_RULES``; the entry's ``gamma`` / ``conv_gamma``
            parameters (0 when it takes none: the epsilon rule) complete its ``LRPRules``.
    """

    attention: str = "uniform"

    def rules(self, params: dict[str, Any]) -> LRPRules:
        """The ``LRPRules`` of this entry with the method parameters ``params``."""
        return LRPRules(self.attention, params.get("gamma", 0.0), params.get("conv_gamma", 0.0))

    def __call__(self, m: LoadedModel, x: torch.Tensor, t: torch.Tensor, grid: tuple[int, int],
                 params: dict[str, Any],
                 score: Callable[[torch.Tensor], torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
        relevance = attnlrp_relevance(m, x, t, score, self.rules(params))
        return pixels_to_grid(relevance, grid), t.cpu().numpy()


#: the plain ``attnlrp`` method's function (AttnLRP, epsilon rule in the linear layers)
attnlrp_maps = AttnLRPMaps()
