"""How the final LayerNorm of a CLIP tower is shared among the parts of ``decompose`` (docs/definitions.md, "Norm
conventions"): ``per_part`` (vitlens's: each part centred by its own mean, the norm's beta a readout term, the output
``u . f``) or ``clip_text_span`` (Gandelsman, Efros, Steinhardt, ICLR 2024, their ``prs_hook.py``, ``PRSLogger``:
the norm's mean and beta shared out in equal shares over the ``2L + 1`` intermediates, an attention intermediate's
share split again over its ``N`` source tokens and ``H`` heads, the output projection's bias spread over tokens and
heads, everything divided by the embedding's norm, so the output is ``u . f / |f|``). Both sums close; they differ
part by part.
"""
from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from ..errors import InvalidParameterError, UnsupportedModelError
from .linearise import held_sigma, norm_bias

#: the conventions ``decompose`` offers, with what each means (the one list the refusal and the docs name)
NORM_CONVENTIONS: dict[str, str] = {
    "per_part": "each part through the held final norm, centred by its own mean; the norm's beta a readout term; "
                "the output u . f",
    "clip_text_span": "Gandelsman et al.'s prs_hook: the norm's mean and beta in equal shares over 2L+1 intermediates "
                      "(an attention layer's share split over tokens x heads, its output bias with it), divided by "
                      "|f|; the output u . f / |f|",
}


def check(norm_convention: str) -> str:
    """``norm_convention`` if it is one of ``NORM_CONVENTIONS``, else a refusal naming them."""
    if norm_convention not in NORM_CONVENTIONS:
        raise InvalidParameterError(f"norm_convention must be one of {', '.join(map(repr, NORM_CONVENTIONS))}; got "
                                    f"{norm_convention!r}.")
    return norm_convention


def refuse_unless_read(module: nn.Module) -> None:
    """Refuse, before any forward, a tower not read by its class token (the authors' convention is stated for that
    readout): an OpenCLIP tower pooling otherwise."""
    if getattr(module, "pool_type", "tok") != "tok":
        raise UnsupportedModelError(f"norm_convention='clip_text_span' reads a tower by its class token (the authors' "
                                    f"prs_hook); this OpenCLIP tower pools by {module.pool_type!r}: use 'per_part'.")


def _final(module: nn.Module, seen: object) -> tuple[nn.Module, torch.Tensor]:
    """The final LayerNorm and its input at the class token [B, D]."""
    if hasattr(seen, "pooled"):  # Hugging Face CLIP: post_layernorm on the class token
        vm = getattr(module, "vision_model", module)
        return vm.post_layernorm, seen.pooled.double()
    refuse_unless_read(module)
    post = seen.post_in.double()  # type: ignore[attr-defined]  # an OpenCLIP reader's record (post_in), not the HF one's
    return module.ln_post, post if post.dim() == 2 else post[:, 0]


def clip_text_span(reader: ModuleType, module: nn.Module, seen: object, u: torch.Tensor, parts: dict[str, torch.Tensor],
                   output: torch.Tensor, features: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The ``per_part`` parts of ``u . f`` re-shared as the authors' ``PRSLogger`` shares them.

    A part ``c`` (a vector written to the stream at the class token) with share ``s`` of the norm is, in the
    authors' convention, ``[gamma * (c - s mu) / sigma + s beta] . P u / |f|``; its ``per_part`` value is
    ``gamma * (c - mean(c)) / sigma . P u``, so the two differ by ``sum(gamma * P u) (mean(c) - s mu) / sigma + s
    beta . P u`` before the division. ``mean(c)`` is each part read along ``1 / D`` on the residual (``reader``'s
    ``contributions`` with ``residual``).

    Args:
        reader: ``hf_clip`` or ``openclip``.
        module: the tower.
        seen: what ``reader.capture`` saw.
        u: [B, F] the direction read.
        parts: the ``per_part`` parts (``reader.contributions``).
        output: [B] ``u . f``.
        features: [B, F] the image embedding ``f``.

    Returns:
        ``(parts, output / |f|)``: the same fields, re-shared; ``attn_bias`` is zero (spread into ``heads``), the
            intermediate the authors take before the blocks (the pre-norm's output at the class token) has its share
            on ``pre_norm_bias``, ``readout_bias`` keeps only what follows the norm (a projection's bias).
    """
    norm, x = _final(module, seen)
    b, d = x.shape
    heads = parts["heads"]
    n_layers, n_heads, n_tokens = heads.shape[1:]
    gamma = norm.weight.detach().double() if getattr(norm, "weight", None) is not None else torch.ones_like(x[0])
    u_pool = reader.pooled_direction(module, u)
    pull = (gamma * u_pool).sum(-1) / held_sigma(norm, x)[:, 0]  # [B]: sum(gamma * P u) / sigma
    mu = x.mean(-1)
    beta = (norm_bias(norm, d, u_pool) * u_pool).sum(-1)
    residual = torch.zeros(b, n_tokens, d, dtype=torch.float64, device=x.device)
    residual[:, 0] = 1.0 / d
    mean = reader.contributions(module, seen, u, residual=residual)
    m = 2 * n_layers + 1
    r = features.double().norm(dim=-1)

    def shared(value: torch.Tensor, mean_c: torch.Tensor, share: float) -> torch.Tensor:
        shape = (b,) + (1,) * (value.dim() - 1)
        return (value + pull.view(shape) * (mean_c - share * mu.view(shape)) + share * beta.view(shape)) / r.view(shape)

    per = float(n_tokens * n_heads)
    new = dict(parts)
    new["heads"] = shared(heads + parts["attn_bias"][:, :, None, None] / per,
                          mean["heads"] + mean["attn_bias"][:, :, None, None] / per, 1.0 / (m * per))
    mlp = parts["mlp"] / r[:, None, None]
    mlp[:, :, 0] = shared(parts["mlp"][:, :, 0], mean["mlp"][:, :, 0], 1.0 / m)
    new["mlp"] = mlp
    before = ("embed_patch", "embed_position", "embed_prefix")
    for name in before:
        new[name] = parts[name] / r[:, None]
    mean0 = sum(mean[name].sum(-1) for name in before) + mean["pre_norm_bias"]
    # the authors' intermediate before the blocks is the pre-norm's whole output: its share of the final norm's mean
    # and beta goes to the pre-norm's own constant, the embeddings keep their per-part values (divided by |f|)
    new["pre_norm_bias"] = shared(parts["pre_norm_bias"], mean0, 1.0 / m)
    new["attn_bias"] = torch.zeros_like(parts["attn_bias"])
    new["readout_bias"] = (parts["readout_bias"] - beta) / r
    new["pool_mlp"] = parts["pool_mlp"] / r
    return new, output / r
