"""Each attention head's direct contribution to a CLIP / SigLIP / OpenCLIP tower's image embedding, as a vector
(docs/definitions.md, "TextSpan"): the head's writes to the residual stream, summed over source tokens, read forward
through the tower's held final norm, pooling (SigLIP: its MAP head with the attention held) and projection. Read
along a direction ``u`` it is ``decompose``'s head part summed over tokens (tested).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from ..errors import InvalidParameterError, UnsupportedModelError
from . import hf_clip, openclip, prenorm, towers
from .layout import structure
from .linearise import held_sigma, is_identity

Readout = Callable[[torch.Tensor], torch.Tensor]
#: one layer's (attention probabilities, values, output projection weight, layer scale or None)
HeadLayer = tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]


def _held(norm: nn.Module, t: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A LayerNorm with its scale held and no beta: ``gamma * centre(t) / sigma`` (Identity: ``t``)."""
    if is_identity(norm):
        return t
    w = norm.weight.detach().double() if getattr(norm, "weight", None) is not None else 1.0
    return (t - t.mean(-1, keepdim=True)) * w / sigma


def _writes(probs: torch.Tensor, v: torch.Tensor, w_o: torch.Tensor, gamma: torch.Tensor | None,
            queries: slice) -> torch.Tensor:
    """[B, H, Nq, D] each head's write at the query tokens: ``sum_j a_h(q, j) W_O^h v_j`` (times a LayerScale)."""
    d = w_o.shape[0]
    h, dh = v.shape[1], v.shape[-1]
    vo = torch.einsum("bhjc,ehc->bhje", v, w_o.detach().double().reshape(d, h, dh))
    out = probs[:, :, queries] @ vo
    return out * gamma.detach().double() if gamma is not None else out


def _clip(model: nn.Module, pixels: torch.Tensor) -> tuple[list[HeadLayer], Readout, bool]:
    vm = getattr(model, "vision_model", model)
    hf_clip.refuse_unless_supported(model)
    seen = hf_clip.capture(model, pixels)
    layers: list[HeadLayer] = [(*hf_clip.head_probs(seen, i, l), l.self_attn.out_proj.weight, None)
              for i, l in enumerate(vm.encoder.layers)]
    sigma = held_sigma(vm.post_layernorm, seen.pooled)[:, None, :]
    proj = getattr(model, "visual_projection", None)

    def read(w: torch.Tensor) -> torch.Tensor:  # w [B, H, 1, D]: the class token's write
        t = _held(vm.post_layernorm, w[:, :, 0], sigma)
        return t @ proj.weight.detach().double().T if proj is not None else t
    return layers, read, False


def _openclip(model: nn.Module, pixels: torch.Tensor) -> tuple[list[HeadLayer], Readout, bool]:
    openclip.refuse_unless_supported(model)
    seen = openclip.capture(model, pixels)
    layers: list[HeadLayer] = []
    for block, h_in in zip(model.transformer.resblocks, seen.attn_in):
        a = block.attn
        q, k, v = (t.reshape(*t.shape[:2], a.num_heads, a.head_dim).transpose(1, 2)
                   for t in prenorm.mha_qkv(a, h_in))
        probs = ((q * a.head_dim ** -0.5) @ k.transpose(-2, -1)).softmax(-1)
        layers.append((probs, v, a.out_proj.weight, getattr(block.ls_1, "gamma", None)))
    post = seen.post_in.double()
    tok = model.pool_type == "tok"

    def pool(t: torch.Tensor) -> torch.Tensor:  # [B, H, N, D] -> [B, H, D]
        return t[:, :, 0] if tok else t[:, :, 1:].mean(2)

    def read(w: torch.Tensor) -> torch.Tensor:
        if post.dim() == 2:  # the norm after the pooling
            t = _held(model.ln_post, pool(w), held_sigma(model.ln_post, post)[:, None, :])
        else:
            t = pool(_held(model.ln_post, w, held_sigma(model.ln_post, post)[:, None, :w.shape[2]]))
        return t @ model.proj.detach().double() if model.proj is not None else t
    return layers, read, not tok


def _siglip(model: nn.Module, pixels: torch.Tensor) -> tuple[list[HeadLayer], Readout, bool]:
    plan, seen = towers.read(model, pixels)
    layers = [(*prenorm.attention(b, seen, i), b.w_o, b.gamma1) for i, b in enumerate(plan.blocks)]
    z, x = seen.final_out.double(), seen.final_in.double()
    mha = model.head.attention
    b, n, d = z.shape
    h = mha.num_heads
    dh = d // h
    q = prenorm.mha_qkv(mha, model.head.probe.detach().expand(b, -1, -1))[0].reshape(b, 1, h, dh).transpose(1, 2)
    k = prenorm.mha_qkv(mha, z)[1].reshape(b, n, h, dh).transpose(1, 2)
    att = ((q * dh ** -0.5) @ k.transpose(-2, -1)).softmax(-1)[:, :, 0]  # [B, H', N], held
    w_v = mha.in_proj_weight.detach().double()[2 * d:].reshape(h, dh, d)
    sigma = held_sigma(plan.final_norm, x)[:, None]  # [B, 1, N, 1]

    def read(w: torch.Tensor) -> torch.Tensor:  # w [B, H, N, D]
        vv = torch.einsum("bxjd,hcd->bxjhc", _held(plan.final_norm, w, sigma), w_v)
        mixed = torch.einsum("bhj,bxjhc->bxhc", att, vv).flatten(-2)
        return mixed @ mha.out_proj.weight.detach().double().T
    return layers, read, True


def resolve_layers(n: int, layers: Sequence[int] | str | None) -> list[int]:
    """The blocks ``layers`` names among ``n`` (0-based): None the last four, "all" every one, else indices (negative
    counts from the end); a refusal naming the range otherwise."""
    if layers == "all":
        return list(range(n))
    if isinstance(layers, str):
        raise InvalidParameterError(f"layers must be block indices, None (the last four) or 'all'; got {layers!r}.")
    chosen = list(range(max(0, n - 4), n)) if layers is None else [int(l) % n if -n <= int(l) < n else -1
                                                                    for l in layers]
    if any(l < 0 for l in chosen) or not chosen:
        raise InvalidParameterError(f"layers must be block indices in [0, {n}) (negative counts from the end).")
    return chosen


def head_vectors(model: nn.Module, pixels: torch.Tensor, layers: Sequence[int] | str | None = None
                 ) -> tuple[torch.Tensor, list[int]]:
    """``([B, L', H, F] each head's contribution vector, the layers read (0-based))`` for a CLIP, SigLIP or OpenCLIP
    vision tower, float64, from one forward of the user's model (``layers``: block indices, None for the last four,
    "all" for every block)."""
    if hf_clip.is_clip_tower(model):
        per_layer, read, all_q = _clip(model, pixels)
    elif openclip.is_openclip_tower(model):
        per_layer, read, all_q = _openclip(model, pixels)
    elif structure(model) == "siglip":
        per_layer, read, all_q = _siglip(model, pixels)
    else:
        raise UnsupportedModelError(f"{type(model).__name__}: TextSpan reads CLIP, SigLIP and OpenCLIP vision towers "
                                    f"(an image embedding that texts describe).")
    chosen = resolve_layers(len(per_layer), layers)
    out = []
    for l in chosen:
        probs, v, w_o, gamma = per_layer[l]
        out.append(read(_writes(probs, v, w_o, gamma, slice(None) if all_q else slice(0, 1))))
    return torch.stack(out, 1), chosen
