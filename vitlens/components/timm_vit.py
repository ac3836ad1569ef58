"""Direct contributions on timm's ``VisionTransformer`` (docs/definitions.md, "Direct contributions").

The forward runs once on the user's model with forward hooks on its own modules (patch embedding, each block's
``norm1``, ``attn.qkv``, ``ls1``, ``ls2``, the final norms, the head); the parts are then read from what the hooks
saw, in float64: each head's output split per source token (``a_h(q, j) W_O^h V^h x_j``, the attention recomputed
from the captured queries and keys through the attention's own ``q_norm``/``k_norm``), each MLP's output, the
embeddings and the biases, each read through the held final norm (``linearise``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from . import map_head
from .linearise import back_through_norm, check_norm, is_identity, norm_bias

POOLS = ("token", "avg")


@dataclass
class Captured:
    """What the hooks saw in one forward (tensors as the model computed them)."""

    patch: torch.Tensor | None = None
    pre_in: torch.Tensor | None = None
    pre_out: torch.Tensor | None = None
    qkv: list[torch.Tensor] = field(default_factory=list)
    attn_branch: list[torch.Tensor] = field(default_factory=list)
    mlp_branch: list[torch.Tensor] = field(default_factory=list)
    final_in: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    features: torch.Tensor | None = None
    logits: torch.Tensor | None = None
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
    for i, block in enumerate(model.blocks):
        kind = type(block).__name__
        if kind != "Block":
            raise UnsupportedModelError(f"{name} block {i} is a {kind} (post-norm or parallel): its output is not "
                                        f"x + attn(norm(x)) + mlp(norm(x)), so it gives no residual sum.")
        attn = block.attn
        if type(attn).__name__ != "Attention" or not is_identity(getattr(attn, "norm", None)) \
                or getattr(attn, "gate", None) is not None:
            raise UnsupportedModelError(f"{name} block {i}'s attention is a {type(attn).__name__} with a norm or "
                                        f"gate before its projection: not a sum over heads.")
        for ls in (block.ls1, block.ls2):
            if not (is_identity(ls) or type(ls).__name__ == "LayerScale"):
                raise UnsupportedModelError(f"{name} block {i} scales its branches by a {type(ls).__name__}.")
    for where, norm in (("final norm", model.norm), ("pre-norm", model.norm_pre), ("head's norm", model.fc_norm)):
        check_norm(norm, where)
    if not isinstance(model.head, nn.Linear):
        raise UnsupportedModelError(f"{name}'s head is a {type(model.head).__name__}: give a direction over its "
                                    f"pre-logits features instead of a class.")


def capture(model: nn.Module, pixels: torch.Tensor) -> Captured:
    """One forward of the user's model with hooks on its own modules; the hooks are removed on exit."""
    cap = Captured()
    handles = []

    def keep(setter: Any, use_input: bool = False) -> Any:
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            setter(inputs[0] if use_input else output)
        return hook

    try:
        handles.append(model.patch_embed.register_forward_hook(keep(lambda t: setattr(cap, "patch", t))))
        handles.append(model.norm_pre.register_forward_hook(keep(lambda t: setattr(cap, "pre_in", t), True)))
        handles.append(model.norm_pre.register_forward_hook(keep(lambda t: setattr(cap, "pre_out", t))))
        for block in model.blocks:
            handles.append(block.attn.qkv.register_forward_hook(keep(cap.qkv.append)))
            handles.append(block.ls1.register_forward_hook(keep(cap.attn_branch.append)))
            handles.append(block.ls2.register_forward_hook(keep(cap.mlp_branch.append)))
        handles.append(model.norm.register_forward_hook(keep(lambda t: setattr(cap, "final_in", t), True)))
        handles.append(model.fc_norm.register_forward_hook(keep(lambda t: setattr(cap, "pooled", t), True)))
        handles.append(model.head.register_forward_hook(keep(lambda t: setattr(cap, "features", t), True)))
        if getattr(model, "attn_pool", None) is not None:
            for part in map_head.HOOKED:
                handles.append(getattr(model.attn_pool, part).register_forward_hook(
                    keep(lambda t, part=part: cap.pool.__setitem__(part, t))))
        handles.append(model.head.register_forward_hook(keep(lambda t: setattr(cap, "logits", t))))
        with torch.no_grad():
            model(pixels)
    finally:
        for h in handles:
            h.remove()
    return cap


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


def attention_probs(block: nn.Module, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's attention probabilities [B, H, N, N] and values [B, H, N, dh] (float64) from its captured qkv
    output, through the attention's own ``q_norm``/``k_norm`` and its ``scale`` (timm's softmax(q k^T * scale))."""
    attn = block.attn
    b, n, _ = qkv.shape
    q, k, v = qkv.reshape(b, n, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    with torch.no_grad():
        q, k = attn.q_norm(q), attn.k_norm(k)
    logits = (q.double() * attn.scale) @ k.double().transpose(-2, -1)
    return logits.softmax(dim=-1), v.double()


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
    for block, qkv, branch_mlp in zip(model.blocks, cap.qkv, cap.mlp_branch):
        probs, v = attention_probs(block, qkv)
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
