"""Direct contributions on timm's ``VisionTransformer`` (docs/definitions.md, "Direct contributions").

The forward runs once on the user's model with its named sites read (``vitlens.engine.sites``: the patch embedding,
each block's ``attn.qkv``, ``ls1``, ``ls2``, the final norms, the head); the parts are then read from what the sites
saw, in float64: each head's output split per source token (``a_h(q, j) W_O^h V^h x_j``, the attention recomputed
from the captured queries and keys through the attention's own ``q_norm``/``k_norm``), each MLP's output, the
embeddings and the biases, each read through the held final norm (``linearise``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..engine.sites import HookPoint, record
from ..errors import UnsupportedModelError
from . import map_head
from .layout import Layout
from .refusals import refuse_other_blocks
from .linearise import back_through_norm, check_norm, is_identity, norm_bias

POOLS = ("token", "avg")


@dataclass
class Captured:
    """What the hooks saw in one forward (tensors as the model computed them; every site is read: ``capture``)."""

    patch: torch.Tensor
    pre_in: torch.Tensor
    pre_out: torch.Tensor
    final_in: torch.Tensor
    pooled: torch.Tensor
    features: torch.Tensor
    logits: torch.Tensor
    qkv: list[torch.Tensor] = field(default_factory=list)
    attn_branch: list[torch.Tensor] = field(default_factory=list)
    mlp_branch: list[torch.Tensor] = field(default_factory=list)
    pool: dict[str, torch.Tensor] = field(default_factory=dict)


def refuse_unless_supported(model: nn.Module) -> None:
    """Refuse, by name and in one line, a timm ViT whose structure gives no exact residual sum."""
    name = type(model).__name__
    if name != "VisionTransformer" or not type(model).__module__.startswith("timm"):
        raise UnsupportedModelError(f"{name}: direct contributions read timm's VisionTransformer (a residual "
                                    f"stream through pre-norm blocks); hierarchical, parallel-block and post-norm "
                                    f"models give no residual sum.")
    if getattr(model, "attn_pool", None) is not None:
        map_head.refuse_unless_supported(model.attn_pool, name)
    elif model.global_pool not in POOLS:
        raise UnsupportedModelError(f"{name} pools by {model.global_pool!r}: only {POOLS} pooling is linear.")
    refuse_other_blocks(model)
    for where, norm in (("final norm", model.norm), ("pre-norm", model.norm_pre), ("head's norm", model.fc_norm)):
        check_norm(norm, where)
    if not isinstance(model.head, nn.Linear):
        raise UnsupportedModelError(f"{name}'s head is a {type(model.head).__name__}: give a direction over its "
                                    f"pre-logits features instead of a class.")


def capture(model: nn.Module, pixels: torch.Tensor) -> Captured:
    """One forward of the user's model with its named sites read (``layout``'s, and the embeddings', norms' and
    head's beside them); the forward untouched."""
    sites = Layout(model).points()
    n = len(model.blocks)
    points = {"hook_embed": HookPoint(model.patch_embed), "ln_pre.hook_in": HookPoint(model.norm_pre, "input"),
              "ln_pre.hook_out": HookPoint(model.norm_pre), "ln_final.hook_in": sites["ln_final.hook_in"],
              "fc_norm.hook_in": HookPoint(model.fc_norm, "input"), "head.hook_in": HookPoint(model.head, "input"),
              "head.hook_out": HookPoint(model.head)}
    for i in range(n):
        for key in ("attn.hook_qkv", "hook_attn_out", "hook_mlp_out"):
            points[f"blocks.{i}.{key}"] = sites[f"blocks.{i}.{key}"]
    if getattr(model, "attn_pool", None) is not None:
        for part in map_head.HOOKED:
            points[f"attn_pool.{part}.hook_out"] = HookPoint(getattr(model.attn_pool, part))
    seen, _ = record(model, points, lambda: model(pixels))
    return Captured(
        patch=seen["hook_embed"], pre_in=seen["ln_pre.hook_in"], pre_out=seen["ln_pre.hook_out"],
        qkv=[seen[f"blocks.{i}.attn.hook_qkv"] for i in range(n)],
        attn_branch=[seen[f"blocks.{i}.hook_attn_out"] for i in range(n)],
        mlp_branch=[seen[f"blocks.{i}.hook_mlp_out"] for i in range(n)],
        final_in=seen["ln_final.hook_in"], pooled=seen["fc_norm.hook_in"], features=seen["head.hook_in"],
        logits=seen["head.hook_out"],
        pool={part: seen[f"attn_pool.{part}.hook_out"] for part in map_head.HOOKED
              if f"attn_pool.{part}.hook_out" in seen})


def pool_weights(model: nn.Module, n_tokens: int, like: torch.Tensor) -> torch.Tensor:
    """[N] weight of each token in the pooled feature: one-hot on the class token, or the mean over patches."""
    w = torch.zeros(n_tokens, dtype=torch.float64, device=like.device)
    if model.global_pool == "token":
        w[0] = 1.0
    else:
        start = 0 if getattr(model, "pool_include_prefix", False) else model.num_prefix_tokens
        w[start:] = 1.0 / (n_tokens - start)
    return w


def _scale(ls: nn.Module, d: int, like: torch.Tensor) -> torch.Tensor:
    gamma = getattr(ls, "gamma", None)
    return torch.ones(d, dtype=torch.float64, device=like.device) if gamma is None else gamma.detach().double()


def head_values(block: nn.Module, qkv: torch.Tensor) -> torch.Tensor:
    """The block's values [B, H, N, dh] (float64) from its captured qkv output."""
    attn = block.attn
    b, n, _ = qkv.shape
    return qkv.reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)[2].double()


def read_directions(model: nn.Module, cap: Captured, u: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The read direction per residual token after the blocks, ``g`` [B, N, D], the readout's constant [B] (the
    final norms' betas read through) and a MAP head's MLP part (None without one), for a direction ``u`` [B, D]
    over the pooled (pre-logits) features."""
    x = cap.final_in.double()
    pooled = cap.pooled.double()
    g_pool = back_through_norm(model.fc_norm, u, pooled)
    const = (u * norm_bias(model.fc_norm, u.shape[-1], u)).sum(-1)
    if getattr(model, "attn_pool", None) is not None:
        g, more, mlp_part = map_head.read(model, cap.pool, g_pool, x)
        return g, const + more, mlp_part
    g_after = pool_weights(model, x.shape[1], x)[None, :, None] * g_pool[:, None, :]
    const = const + (g_after * norm_bias(model.norm, x.shape[-1], x)).sum((-1, -2))
    return back_through_norm(model.norm, g_after, x), const, None


def contributions(model: nn.Module, cap: Captured, u: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every part of the read output (float64), named as ``DecompositionResult``'s fields."""
    g, readout_bias, pool_mlp = read_directions(model, cap, u)
    d = g.shape[-1]
    g0, pre_bias = g, torch.zeros_like(readout_bias)
    if not is_identity(model.norm_pre):
        g0 = back_through_norm(model.norm_pre, g, cap.pre_in)
        pre_bias = (g * norm_bias(model.norm_pre, d, g)).sum((-1, -2))
    stream0 = (cap.pre_in if not is_identity(model.norm_pre) else cap.pre_out).double()
    npref = model.num_prefix_tokens
    patch = torch.zeros_like(stream0)
    patch[:, npref:] = cap.patch.double().flatten(1, -2) if cap.patch.dim() == 4 else cap.patch.double()
    prefix = torch.zeros_like(stream0)
    i = 0
    if getattr(model, "cls_token", None) is not None:
        prefix[:, 0] = model.cls_token.detach().double()[0, 0]
        i = 1
    if getattr(model, "reg_token", None) is not None:
        r = model.reg_token.shape[1]
        prefix[:, i:i + r] = model.reg_token.detach().double()[0]
    position = stream0 - patch - prefix
    heads, attn_bias, mlp = [], [], []
    layout = Layout(model)
    for i, (block, qkv, branch_mlp) in enumerate(zip(model.blocks, cap.qkv, cap.mlp_branch)):
        probs, v = layout.probs(i, {f"blocks.{i}.attn.hook_qkv": qkv}), head_values(block, qkv)
        gs = g * _scale(block.ls1, d, g)
        w_o = block.attn.proj.weight.detach().double()
        e = (gs @ w_o).reshape(*gs.shape[:2], block.attn.num_heads, block.attn.head_dim)
        heads.append(torch.einsum("bhqj,bqhd,bhjd->bhj", probs, e, v))
        bias = block.attn.proj.bias
        attn_bias.append((gs * bias.detach().double()).sum((-1, -2)) if bias is not None else
                         torch.zeros_like(readout_bias))
        mlp.append((g * branch_mlp.double()).sum(-1))
    return {
        "heads": torch.stack(heads, 1), "attn_bias": torch.stack(attn_bias, 1), "mlp": torch.stack(mlp, 1),
        "embed_patch": (g0 * patch).sum(-1), "embed_position": (g0 * position).sum(-1),
        "embed_prefix": (g0 * prefix).sum(-1), "pre_norm_bias": pre_bias, "readout_bias": readout_bias,
        "pool_mlp": torch.zeros_like(readout_bias) if pool_mlp is None else pool_mlp,
    }
