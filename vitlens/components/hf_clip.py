"""Direct contributions on a Hugging Face CLIP vision tower (``CLIPVisionModel``, ``CLIPVisionModelWithProjection``;
docs/definitions.md, "Direct contributions"). The tower is pre-norm: embeddings (class embedding, patch
convolution, position embedding) through ``pre_layrnorm``, blocks ``x + attn(ln1(x))``, ``x + mlp(ln2(x))``, the
class token through ``post_layernorm`` and the projection. Both LayerNorms' scales are held; read at named sites of
the tower's own modules (``vitlens.engine.sites``), in float64.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..engine.sites import HookPoint, record
from ..errors import UnsupportedModelError
from .layout import structure
from .prenorm import head_attention
from .linearise import back_through_norm, check_norm, norm_bias

def is_clip_tower(model: nn.Module) -> bool:
    """Whether the module is a Hugging Face CLIP vision tower this reader covers (``layout.STRUCTURES``)."""
    return structure(model) == "hf-clip"


@dataclass
class Seen:
    """What the hooks saw."""

    patch: torch.Tensor
    embeddings: torch.Tensor
    pooled: torch.Tensor
    features: torch.Tensor
    q: list[torch.Tensor] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    mlp: list[torch.Tensor] = field(default_factory=list)


def refuse_unless_supported(model: nn.Module) -> None:
    """Refuse a CLIP tower whose norms are not LayerNorms."""
    vm = getattr(model, "vision_model", model)
    check_norm(vm.pre_layrnorm, "pre-norm")
    check_norm(vm.post_layernorm, "final norm")
    for layer in vm.encoder.layers:
        if type(layer).__name__ != "CLIPEncoderLayer":
            raise UnsupportedModelError(f"{type(model).__name__}: a {type(layer).__name__} block is not read.")


def capture(model: nn.Module, pixels: torch.Tensor) -> Seen:
    """One forward with the tower's own modules read as named sites (``vitlens.engine.sites``); the forward
    untouched."""
    vm = getattr(model, "vision_model", model)
    layers = list(vm.encoder.layers)
    points = {"hook_embed": HookPoint(vm.embeddings.patch_embedding), "embeddings.hook_out": HookPoint(vm.embeddings),
              "ln_final.hook_in": HookPoint(vm.post_layernorm, "input")}
    for i, layer in enumerate(layers):
        for name in ("q", "k", "v"):
            points[f"blocks.{i}.attn.hook_{name}"] = HookPoint(getattr(layer.self_attn, f"{name}_proj"))
        points[f"blocks.{i}.hook_mlp_out"] = HookPoint(layer.mlp)
    got, out = record(model, points, lambda: model(pixel_values=pixels))
    return Seen(patch=got["hook_embed"], embeddings=got["embeddings.hook_out"], pooled=got["ln_final.hook_in"],
                features=out.image_embeds if hasattr(out, "image_embeds") else out.pooler_output,
                q=[got[f"blocks.{i}.attn.hook_q"] for i in range(len(layers))],
                k=[got[f"blocks.{i}.attn.hook_k"] for i in range(len(layers))],
                v=[got[f"blocks.{i}.attn.hook_v"] for i in range(len(layers))],
                mlp=[got[f"blocks.{i}.hook_mlp_out"] for i in range(len(layers))])


def head_probs(seen: Seen, i: int, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's attention probabilities [B, H, N, N] and values [B, H, N, dh], float64, from its captured q, k, v."""
    attn = layer.self_attn
    return head_attention(seen.q[i], seen.k[i], seen.v[i], attn.num_heads, attn.head_dim, attn.scale)


def pooled_direction(model: nn.Module, u: torch.Tensor) -> torch.Tensor:
    """[B, D] ``u`` [B, F] read back through the projection onto the final norm's output at the class token."""
    proj = getattr(model, "visual_projection", None)
    return u @ proj.weight.detach().double() if proj is not None else u


def contributions(model: nn.Module, seen: Seen, u: torch.Tensor, residual: torch.Tensor | None = None
                  ) -> dict[str, torch.Tensor]:
    """Every part of ``u . features`` (float64), named as ``DecompositionResult``'s fields; with ``residual`` [B, N, D]
    instead, every part read along that direction on the residual after the blocks (no final norm, no readout: the
    ``clip_text_span`` convention reads each part's mean this way, ``conventions``)."""
    vm = getattr(model, "vision_model", model)
    proj = getattr(model, "visual_projection", None)
    u_pool = pooled_direction(model, u)
    readout = (u * proj.bias.detach().double()).sum(-1) if proj is not None and proj.bias is not None else u[:, 0] * 0
    pooled = seen.pooled.double()
    d = pooled.shape[-1]
    readout = readout + (u_pool * norm_bias(vm.post_layernorm, d, u_pool)).sum(-1)
    emb = seen.embeddings.double()
    g = torch.zeros_like(emb)
    if residual is None:
        g[:, 0] = back_through_norm(vm.post_layernorm, u_pool, pooled)
    else:
        g, readout = residual.double(), readout * 0
    g0 = back_through_norm(vm.pre_layrnorm, g, emb)
    pre_bias = (g * norm_bias(vm.pre_layrnorm, d, g)).sum((-1, -2))
    patch = torch.zeros_like(emb)
    patch[:, 1:] = seen.patch.double().flatten(2).transpose(1, 2)
    prefix = torch.zeros_like(emb)
    prefix[:, 0] = vm.embeddings.class_embedding.detach().double()
    heads, attn_bias, mlp = [], [], []
    for i, layer in enumerate(vm.encoder.layers):
        probs, v = head_probs(seen, i, layer)
        out = layer.self_attn.out_proj
        e = (g @ out.weight.detach().double()).reshape(*g.shape[:2], layer.self_attn.num_heads, -1)
        heads.append(torch.einsum("bhqj,bqhd,bhjd->bhj", probs, e, v))
        attn_bias.append((g * out.bias.detach().double()).sum((-1, -2)) if out.bias is not None else pre_bias * 0)
        mlp.append((g * seen.mlp[i].double()).sum(-1))
    return {
        "heads": torch.stack(heads, 1), "attn_bias": torch.stack(attn_bias, 1), "mlp": torch.stack(mlp, 1),
        "embed_patch": (g0 * patch).sum(-1), "embed_position": (g0 * (emb - patch - prefix)).sum(-1),
        "embed_prefix": (g0 * prefix).sum(-1), "pre_norm_bias": pre_bias, "readout_bias": readout,
        "pool_mlp": torch.zeros_like(readout),
    }
