"""The linearisations the direct contributions need (docs/definitions.md, "Direct contributions").

A LayerNorm ``LN(x) = gamma * (x - mean(x)) / sigma(x) + beta`` is affine in ``x`` once ``sigma`` is held at the
forward's value: at the forward's own input the held map and the norm agree exactly, so a sum of parts read through
the held map adds up to the output. A readout that is linear after holding is written as one vector per token
(``g[b, q, :]``, the read direction at position q), so that a part ``c`` written to the residual stream contributes
``sum_q g[b, q] . c[b, q]``. Functions here move such read directions back through a held norm.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError


def is_identity(module: nn.Module | None) -> bool:
    """Whether a module is absent or ``nn.Identity``."""
    return module is None or isinstance(module, nn.Identity)


def held_sigma(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """sigma(x) of a LayerNorm at its forward input (``[..., 1]``, float64), the value the linearisation holds."""
    x = x.double()
    var = x.var(dim=-1, unbiased=False, keepdim=True)
    return torch.sqrt(var + float(getattr(norm, "eps", 1e-6)))


def check_norm(norm: nn.Module, where: str) -> None:
    """Refuse a norm the held-scale linearisation does not cover (it covers Identity and LayerNorm)."""
    if is_identity(norm) or isinstance(norm, nn.LayerNorm):
        return
    raise UnsupportedModelError(f"The {where} is a {type(norm).__name__}, not a LayerNorm: direct contributions "
                                f"hold a LayerNorm's scale only; use a model whose {where} is a LayerNorm.")


def _gamma(norm: nn.Module, d: int, like: torch.Tensor) -> torch.Tensor:
    w = getattr(norm, "weight", None)
    return torch.ones(d, dtype=torch.float64, device=like.device) if w is None else w.detach().double()


def norm_bias(norm: nn.Module, d: int, like: torch.Tensor) -> torch.Tensor:
    """beta of a LayerNorm (zeros for Identity or no bias), float64."""
    b = None if is_identity(norm) else getattr(norm, "bias", None)
    return torch.zeros(d, dtype=torch.float64, device=like.device) if b is None else b.detach().double()


def back_through_norm(norm: nn.Module, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The read direction before a held LayerNorm, given the direction ``g`` after it and its input ``x``.

    The held map is ``c -> gamma * (c - mean(c)) / sigma``; its transpose is ``centre(gamma * g) / sigma`` (centring
    is symmetric). Identity passes ``g`` through.

    Args:
        norm: the LayerNorm (or Identity).
        g: [..., D] direction after the norm.
        x: [..., D] the norm's forward input (for sigma).

    Returns:
        [..., D] float64 direction before the norm.
    """
    if is_identity(norm):
        return g
    v = g * _gamma(norm, g.shape[-1], g)
    v = v - v.mean(dim=-1, keepdim=True)
    return v / held_sigma(norm, x)
