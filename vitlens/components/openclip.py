"""Direct contributions on an OpenCLIP vision tower (``open_clip.transformer.VisionTransformer``; docs/definitions.md,
"Direct contributions"). Pre-norm: class embedding, patch convolution and position embedding through ``ln_pre``,
blocks ``x + ls_1(attn(ln_1(x)))``, ``x + ls_2(mlp(ln_2(x)))`` with ``nn.MultiheadAttention``, ``ln_post`` before
or after the pooling (class token or patch mean), the projection matrix. Every LayerNorm's scale held; read at
named sites of the tower's own modules (``vitlens.engine.sites``), in float64.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..engine.sites import HookPoint, record
from .layout import structure
from .refusals import refuse_other_openclip
from .prenorm import head_attention, mha_qkv
from .linearise import back_through_norm, norm_bias


def is_openclip_tower(model: nn.Module) -> bool:
    """Whether the module is OpenCLIP's vision transformer (``layout.STRUCTURES``)."""
    return structure(model) == "openclip"


@dataclass
class Seen:
    """What the hooks saw."""

    patch: torch.Tensor
    embeddings: torch.Tensor
    post_in: torch.Tensor
    features: torch.Tensor
    attn_in: list[torch.Tensor] = field(default_factory=list)
    mlp: list[torch.Tensor] = field(default_factory=list)


#: the refusal every reader of an OpenCLIP tower calls (``decompose``, ``head_vectors``)
refuse_unless_supported = refuse_other_openclip


def capture(model: nn.Module, pixels: torch.Tensor) -> Seen:
    """One forward with the tower's own modules read as named sites (``vitlens.engine.sites``); the forward
    untouched."""
    blocks = list(model.transformer.resblocks)
    points = {"hook_embed": HookPoint(model.conv1), "ln_pre.hook_in": HookPoint(model.ln_pre, "input"),
              "ln_final.hook_in": HookPoint(model.ln_post, "input")}
    for i, block in enumerate(blocks):
        points[f"blocks.{i}.ln1.hook_normalized"] = HookPoint(block.ln_1)
        points[f"blocks.{i}.hook_mlp_out"] = HookPoint(block.ls_2)
    got, out = record(model, points, lambda: model(pixels))
    return Seen(patch=got["hook_embed"], embeddings=got["ln_pre.hook_in"], post_in=got["ln_final.hook_in"],
                attn_in=[got[f"blocks.{i}.ln1.hook_normalized"] for i in range(len(blocks))],
                mlp=[got[f"blocks.{i}.hook_mlp_out"] for i in range(len(blocks))],
                features=out[0] if isinstance(out, tuple) else out)


def read_directions(model: nn.Module, seen: Seen, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``g`` [B, N, D] on the residual after the blocks and the readout's constant [B] for ``u . features``."""
    u_pool = pooled_direction(model, u)
    post = seen.post_in.double()
    emb = seen.embeddings
    b, n, d = emb.shape
    w = torch.zeros(n, dtype=torch.float64, device=u.device)
    if model.pool_type == "tok":
        w[0] = 1.0
    else:
        w[1:] = 1.0 / (n - 1)
    const = (u_pool * norm_bias(model.ln_post, d, u_pool)).sum(-1)
    if post.dim() == 2:  # final_ln_after_pool: the norm reads the pooled feature
        return w[None, :, None] * back_through_norm(model.ln_post, u_pool, post)[:, None, :], const
    return back_through_norm(model.ln_post, w[None, :, None] * u_pool[:, None, :], post), const


def pooled_direction(model: nn.Module, u: torch.Tensor) -> torch.Tensor:
    """[B, D] ``u`` [B, F] read back through the projection onto the pooled, normed feature."""
    return u @ model.proj.detach().double().T if model.proj is not None else u


def contributions(model: nn.Module, seen: Seen, u: torch.Tensor, residual: torch.Tensor | None = None
                  ) -> dict[str, torch.Tensor]:
    """Every part of ``u . features`` (float64), named as ``DecompositionResult``'s fields; with ``residual`` [B, N, D]
    instead, every part read along that direction on the residual after the blocks (no final norm, no readout: the
    ``clip_text_span`` convention reads each part's mean this way, ``conventions``)."""
    g, readout = read_directions(model, seen, u)
    if residual is not None:
        g, readout = residual.double(), readout * 0
    emb = seen.embeddings.double()
    d = emb.shape[-1]
    g0 = back_through_norm(model.ln_pre, g, emb)
    pre_bias = (g * norm_bias(model.ln_pre, d, g)).sum((-1, -2))
    patch = torch.zeros_like(emb)
    patch[:, 1:] = seen.patch.double().flatten(2).transpose(1, 2)
    prefix = torch.zeros_like(emb)
    prefix[:, 0] = model.class_embedding.detach().double()
    heads, attn_bias, mlp = [], [], []
    for block, h_in, branch in zip(model.transformer.resblocks, seen.attn_in, seen.mlp):
        attn = block.attn
        nh, dh = attn.num_heads, attn.head_dim
        probs, v = head_attention(*mha_qkv(attn, h_in), nh, dh, dh ** -0.5)
        gamma = getattr(block.ls_1, "gamma", None)
        gs = g * (gamma.detach().double() if gamma is not None else 1.0)
        e = (gs @ attn.out_proj.weight.detach().double()).reshape(*g.shape[:2], nh, dh)
        heads.append(torch.einsum("bhqj,bqhd,bhjd->bhj", probs, e, v))
        bias = attn.out_proj.bias
        attn_bias.append((gs * bias.detach().double()).sum((-1, -2)) if bias is not None else pre_bias * 0)
        mlp.append((g * branch.double()).sum(-1))
    return {
        "heads": torch.stack(heads, 1), "attn_bias": torch.stack(attn_bias, 1), "mlp": torch.stack(mlp, 1),
        "embed_patch": (g0 * patch).sum(-1), "embed_position": (g0 * (emb - patch - prefix)).sum(-1),
        "embed_prefix": (g0 * prefix).sum(-1), "pre_norm_bias": pre_bias, "readout_bias": readout,
        "pool_mlp": torch.zeros_like(readout),
    }
