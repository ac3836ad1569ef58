"""A MAP head (timm's ``AttentionPoolLatent``) read with its attention held (docs/definitions.md, "Direct
contributions", MAP heads).

The pool's output is ``y = s + mlp(norm(s))`` with ``s = W_O concat_h(sum_j A_h(l, j) V^h (z_j + p_j)) + b_O``
and ``z_j`` the final norm's output at token j. With ``A`` held at the forward's value, ``s`` is affine in the
``z_j``; the pool's MLP output is one part, whole, as each block's MLP is.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .linearise import back_through_norm, is_identity, norm_bias

HOOKED = ("q", "kv", "mlp")


def refuse_unless_supported(pool: nn.Module, where: str) -> None:
    """Refuse a MAP head whose structure the held-attention reading does not cover."""
    if type(pool).__name__ != "AttentionPoolLatent" or pool.pool not in ("token", "avg") or pool.mlp is None:
        raise UnsupportedModelError(f"{where}'s attention pool is a {type(pool).__name__} (pool "
                                    f"{getattr(pool, 'pool', None)!r}): only timm's AttentionPoolLatent with an MLP "
                                    f"and token or average pooling is read.")


def latent_weights(pool: nn.Module, n_latent: int, like: torch.Tensor) -> torch.Tensor:
    """[latent_len] weight of each latent in the pooled output."""
    w = torch.zeros(n_latent, dtype=torch.float64, device=like.device)
    if pool.pool == "token":
        w[0] = 1.0
    else:
        w[:] = 1.0 / n_latent
    return w


def read(model: nn.Module, seen: dict[str, torch.Tensor], g_pool: torch.Tensor, final_in: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Read directions through a MAP head.

    Args:
        model: the timm VisionTransformer.
        seen: the pool's hooked outputs ("q", "kv", "mlp").
        g_pool: [B, D] the read direction on the pool's output (after the fc norm was read back).
        final_in: [B, N, D] the final norm's input (the residual after the blocks).

    Returns:
        ``(g, const, mlp_part)``: [B, N, D] the direction on the residual, [B] the constants (proj and value biases,
            the pool's position embedding, the final norm's beta), [B] the pool MLP's part.
    """
    pool = model.attn_pool
    b, n, d = final_in.shape
    q, kv = seen["q"], seen["kv"]
    n_lat, h, dh = q.shape[1], pool.num_heads, pool.head_dim
    start = 0 if getattr(model, "pool_include_prefix", False) else model.num_prefix_tokens
    q = q.reshape(b, n_lat, h, dh).transpose(1, 2)
    k, v = kv.reshape(b, n - start, 2, h, dh).permute(2, 0, 3, 1, 4).unbind(0)
    with torch.no_grad():
        q, k = pool.q_norm(q), pool.k_norm(k)
    probs = ((q.double() * pool.scale) @ k.double().transpose(-2, -1)).softmax(-1)  # [B, H, latent, N']
    wl = latent_weights(pool, n_lat, g_pool)
    mlp_part = ((seen["mlp"].double() * wl[None, :, None]).sum(1) * g_pool).sum(-1)
    const = (g_pool * pool.proj.bias.detach().double()).sum(-1) if pool.proj.bias is not None else g_pool[:, 0] * 0
    e = (g_pool @ pool.proj.weight.detach().double()).reshape(b, h, dh)  # W_O^h^T u'
    w_kv = pool.kv.weight.detach().double()
    w_v = w_kv[d:].reshape(h, dh, d)
    if pool.kv.bias is not None:
        const = const + (e * pool.kv.bias.detach().double()[d:].reshape(h, dh)).sum((-1, -2))
    a = (probs * wl[None, None, :, None]).sum(2)  # [B, H, N']: latent-pooled attention
    big_g = torch.einsum("bhj,bhe,hed->bjd", a, e, w_v)  # direction on the pool's input tokens
    if getattr(pool, "pos_embed", None) is not None:
        const = const + (big_g * pool.pos_embed.detach().double()[None]).sum((-1, -2))
    g_after = torch.zeros(b, n, d, dtype=torch.float64, device=final_in.device)
    g_after[:, start:] = big_g
    const = const + (g_after * norm_bias(model.norm, d, g_after)).sum((-1, -2))
    if is_identity(model.norm):
        return g_after, const, mlp_part
    return back_through_norm(model.norm, g_after, final_in.double()), const, mlp_part
