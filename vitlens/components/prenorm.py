"""The direct contributions of any pre-norm global-attention tower once its parts are captured (docs/definitions.md,
"Direct contributions"): one reading shared by the Hugging Face ViT, DINOv2 and SigLIP towers and torchvision's ViT
(``towers``).

A family describes its model as a ``Plan`` (which module writes what into the residual stream); ``capture`` runs one
forward of the user's model with those modules read as named sites and ``contributions`` splits ``u . features``
into the decomposition's parts, given the read direction on the final norm's output (the family's readout).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, overload

import torch
from torch import nn

from ..engine.sites import HookPoint, record
from .linearise import back_through_norm, norm_bias


@dataclass
class BlockPlan:
    """One pre-norm block ``x + ls1 * attn(norm1(x))``, ``x + mlp_out``.

    Attributes:
        q, k, v: the attention's query, key and value projections (Linear modules; their outputs are hooked), or
            None with ``mha``.
        mha: an ``nn.MultiheadAttention`` whose packed in-projection is applied to ``norm1``'s output (hooked).
        norm1: the block's first norm (its output is the attention's input).
        heads, head_dim, scale: the attention's heads, their width and the logits' scale.
        w_o, b_o: the output projection's weight [D, H*dh] and bias (or None).
        gamma1: the attention branch's LayerScale [D] (or None).
        mlp_out: the module whose output is the MLP branch as written to the stream (after its LayerScale).
        attn_out: the module whose output is the attention branch as written to the stream (for patching).
    """

    norm1: nn.Module
    heads: int
    head_dim: int
    scale: float
    w_o: torch.Tensor
    b_o: torch.Tensor | None
    mlp_out: nn.Module
    q: nn.Module | None = None
    k: nn.Module | None = None
    v: nn.Module | None = None
    mha: nn.MultiheadAttention | None = None
    gamma1: torch.Tensor | None = None


@dataclass
class Plan:
    """A tower's structure: the modules the hooks read and how its features are formed.

    Attributes:
        family: the family's name (shown in messages).
        patch: the patch embedding module (its output, [B, Np, D] or [B, D, h, w], is the patch part).
        prefix: [P, D] the learned prefix tokens' values (class token), placed before the patches.
        blocks: the blocks' plans; the stream entering ``first`` is the embeddings.
        first: the first block module (its input is the stream after the embeddings).
        final_norm: the norm on the tokens after the blocks.
        classifier: a Linear head on the features (None: the features are read along a direction).
        features_at: the module whose input (``features_input``) or output is the features read.
        features_input: whether the features are ``features_at``'s input.
        extra: further modules whose outputs are kept, by name (a MAP head's MLP).
    """

    family: str
    patch: nn.Module
    prefix: torch.Tensor
    blocks: list[BlockPlan]
    first: nn.Module
    final_norm: nn.Module
    features_at: nn.Module
    features_input: bool
    classifier: nn.Linear | None = None
    extra: dict[str, nn.Module] = field(default_factory=dict)


@dataclass
class Seen:
    """What the hooks saw in one forward (every site the plan names is read: ``capture``)."""

    patch: torch.Tensor
    stream0: torch.Tensor
    final_in: torch.Tensor
    final_out: torch.Tensor
    features: torch.Tensor
    q: list[torch.Tensor] = field(default_factory=list)
    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)
    attn_in: list[torch.Tensor] = field(default_factory=list)
    mlp: list[torch.Tensor] = field(default_factory=list)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)


def capture(plan: Plan, run: Callable[[], Any], model: nn.Module) -> Seen:
    """Run ``run()`` (one forward of the user's ``model``) with the plan's modules read as named sites
    (``vitlens.engine.sites``, holding the model's lock); the forward untouched."""
    points = {"hook_embed": HookPoint(plan.patch), "blocks.0.hook_resid_pre": HookPoint(plan.first, "input"),
              "ln_final.hook_in": HookPoint(plan.final_norm, "input"), "ln_final.hook_out": HookPoint(plan.final_norm),
              "features": HookPoint(plan.features_at, "input" if plan.features_input else "output")}
    for i, block in enumerate(plan.blocks):
        if block.mha is not None:
            points[f"blocks.{i}.ln1.hook_normalized"] = HookPoint(block.norm1)
        else:
            for name in ("q", "k", "v"):
                points[f"blocks.{i}.attn.hook_{name}"] = HookPoint(getattr(block, name))
        points[f"blocks.{i}.hook_mlp_out"] = HookPoint(block.mlp_out)
    for name, module in plan.extra.items():
        points[f"{name}.hook_out"] = HookPoint(module)
    got, _ = record(model, points, run)
    seen = Seen(patch=got["hook_embed"], stream0=got["blocks.0.hook_resid_pre"], final_in=got["ln_final.hook_in"],
                final_out=got["ln_final.hook_out"], features=got["features"],
                extra={name: got[f"{name}.hook_out"] for name in plan.extra})
    for i, block in enumerate(plan.blocks):
        if block.mha is not None:
            seen.attn_in.append(got[f"blocks.{i}.ln1.hook_normalized"])
        else:
            for name in ("q", "k", "v"):
                getattr(seen, name).append(got[f"blocks.{i}.attn.hook_{name}"])
        seen.mlp.append(got[f"blocks.{i}.hook_mlp_out"])
    return seen


def mha_qkv(mha: nn.MultiheadAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, N, D] (float64) from an ``nn.MultiheadAttention``'s packed in-projection applied to ``x``."""
    qkv = x.double() @ mha.in_proj_weight.detach().double().T
    if mha.in_proj_bias is not None:
        qkv = qkv + mha.in_proj_bias.detach().double()
    q, k, v = qkv.chunk(3, dim=-1)
    return q, k, v


@overload
def head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, head_dim: int, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def head_attention(q: torch.Tensor, k: torch.Tensor, v: None, heads: int, head_dim: int, scale: float
                   ) -> tuple[torch.Tensor, None]: ...
def head_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None, heads: int, head_dim: int, scale: float
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one recomputation of a block's attention from the queries, keys and values its sites saw ([B, N, H * dh]):
    ``(softmax(q k^T * scale) [B, H, N, N], v [B, H, N, dh])`` in float64 (v None where none is given)."""
    b, n, _ = q.shape
    q, k = (t.double().reshape(b, n, heads, head_dim).transpose(1, 2) for t in (q, k))
    if v is not None:
        v = v.double().reshape(b, n, heads, head_dim).transpose(1, 2)
    return ((q * scale) @ k.transpose(-2, -1)).softmax(-1), v


def attention(block: BlockPlan, seen: Seen, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block i's attention probabilities [B, H, N, N] and values [B, H, N, dh], float64, recomputed from the captured
    queries and keys (``head_attention``)."""
    if block.mha is not None:
        q, k, v = mha_qkv(block.mha, seen.attn_in[i])
    else:
        q, k, v = seen.q[i], seen.k[i], seen.v[i]
    return head_attention(q, k, v, block.heads, block.head_dim, block.scale)


def patch_tokens(seen: Seen) -> torch.Tensor:
    """[B, Np, D] the patch embedding's output, flattened row-major."""
    p = seen.patch
    return p.flatten(2).transpose(1, 2) if p.dim() == 4 else p


def contributions(plan: Plan, seen: Seen, g_after: torch.Tensor, const: torch.Tensor, pool_mlp: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """Every part of the read output (float64), named as ``DecompositionResult``'s fields.

    Args:
        plan: the tower's plan.
        seen: what ``capture`` saw.
        g_after: [B, N, D] the read direction on the final norm's output (the readout's transpose).
        const: [B] the readout's constant so far (biases after the final norm).
        pool_mlp: [B] a MAP head's MLP part (zeros without one).
    """
    x = seen.final_in.double()
    d = x.shape[-1]
    g = back_through_norm(plan.final_norm, g_after, x)
    readout = const + (g_after * norm_bias(plan.final_norm, d, g_after)).sum((-1, -2))
    emb = seen.stream0.double()
    p = plan.prefix.shape[0]
    patch = torch.zeros_like(emb)
    patch[:, p:] = patch_tokens(seen).double()
    prefix = torch.zeros_like(emb)
    prefix[:, :p] = plan.prefix.detach().double()
    heads, attn_bias, mlp = [], [], []
    for i, block in enumerate(plan.blocks):
        probs, v = attention(block, seen, i)
        gs = g * block.gamma1.detach().double() if block.gamma1 is not None else g
        e = (gs @ block.w_o.detach().double()).reshape(*g.shape[:2], block.heads, block.head_dim)
        heads.append(torch.einsum("bhqj,bqhd,bhjd->bhj", probs, e, v))
        attn_bias.append((gs * block.b_o.detach().double()).sum((-1, -2)) if block.b_o is not None
                         else torch.zeros_like(readout))
        mlp.append((g * seen.mlp[i].double()).sum(-1))
    return {
        "heads": torch.stack(heads, 1), "attn_bias": torch.stack(attn_bias, 1), "mlp": torch.stack(mlp, 1),
        "embed_patch": (g * patch).sum(-1), "embed_position": (g * (emb - patch - prefix)).sum(-1),
        "embed_prefix": (g * prefix).sum(-1), "pre_norm_bias": torch.zeros_like(readout), "readout_bias": readout,
        "pool_mlp": pool_mlp,
    }
