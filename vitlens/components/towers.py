"""Direct contributions on the Hugging Face ViT, DINOv2 and SigLIP vision towers and torchvision's ViT
(docs/definitions.md, "Direct contributions"): each family written as a ``prenorm.Plan`` of its own modules, its
features read by its own readout (the class token; DINOv2's classifier on the class token and the patch mean; SigLIP's
MAP head with its attention held at the forward's value).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .layout import structure
from .linearise import check_norm
from .prenorm import BlockPlan, Plan, Seen, capture, mha_qkv

def _family(model: nn.Module) -> str | None:
    family = structure(model)
    return family if family in ("hf-vit", "dinov2", "siglip", "torchvision-vit") else None


def is_tower(model: nn.Module) -> bool:
    """Whether one of these families reads the module."""
    return _family(model) is not None


def _hf_block(layer: nn.Module, attn: nn.Module, norm1: nn.Module, out: nn.Linear, mlp_out: nn.Module,
              gamma1: torch.Tensor | None = None) -> BlockPlan:
    heads = int(getattr(attn, "num_attention_heads", getattr(attn, "num_heads", 0)))
    dh = int(attn.head_dim)
    return BlockPlan(norm1=norm1, heads=heads, head_dim=dh, scale=float(getattr(attn, "scaling", dh ** -0.5)),
                     w_o=out.weight, b_o=out.bias, mlp_out=mlp_out, q=attn.q_proj, k=attn.k_proj, v=attn.v_proj,
                     gamma1=gamma1)


def _check_layers(layers: Any, kind: str, family: str, norms: tuple[str, ...]) -> None:
    for i, layer in enumerate(layers):
        if type(layer).__name__ != kind:
            raise UnsupportedModelError(f"{family} layer {i} is a {type(layer).__name__}, not a {kind}: its output is "
                                        f"not a pre-norm residual sum this reader knows.")
        for n in norms:
            check_norm(getattr(layer, n), f"layer {i}'s {n}")


def plan(model: nn.Module) -> Plan:
    """The model's plan, or a one-line refusal naming what does not fit."""
    family = _family(model)
    if family == "hf-vit":
        vm = getattr(model, "vit", model)
        _check_layers(vm.layers, "ViTLayer", family, ("layernorm_before",))
        blocks = [_hf_block(l, l.attention, l.layernorm_before, l.attention.o_proj, l.mlp) for l in vm.layers]
        cls = getattr(model, "classifier", None)
        return Plan(family, vm.embeddings.patch_embeddings, vm.embeddings.cls_token[0], blocks, vm.layers[0],
                    vm.layernorm, cls if cls is not None else vm.layernorm, cls is not None,
                    cls if isinstance(cls, nn.Linear) else None)
    if family == "dinov2":
        vm = getattr(model, "dinov2", model)
        layers = vm.encoder.layer
        _check_layers(layers, "Dinov2Layer", family, ("norm1",))
        blocks = [_hf_block(l, l.attention, l.norm1, l.attention.o_proj, l.layer_scale2, l.layer_scale1.lambda1)
                  for l in layers]
        cls = getattr(model, "classifier", None)
        return Plan(family, vm.embeddings.patch_embeddings, vm.embeddings.cls_token[0], blocks, layers[0],
                    vm.layernorm, cls if cls is not None else vm.layernorm, cls is not None,
                    cls if isinstance(cls, nn.Linear) else None)
    if family == "siglip":
        if not getattr(model, "use_head", False):
            raise UnsupportedModelError("SiglipVisionModel without its attention-pooling head (vision_use_head="
                                        "False) has no pooled output: load it with its head.")
        layers = model.encoder.layers
        _check_layers(layers, "SiglipEncoderLayer", family, ("layer_norm1",))
        check_norm(model.head.layernorm, "MAP head's norm")
        blocks = [_hf_block(l, l.self_attn, l.layer_norm1, l.self_attn.out_proj, l.mlp) for l in layers]
        empty = model.embeddings.patch_embedding.weight.new_zeros(0, model.config.hidden_size)
        return Plan(family, model.embeddings.patch_embedding, empty, blocks, layers[0], model.post_layernorm,
                    model.head, False, None, {"pool_mlp": model.head.mlp})
    if family == "torchvision-vit":
        layers = model.encoder.layers
        _check_layers(layers, "EncoderBlock", family, ("ln_1",))
        heads = list(model.heads.named_children())
        if len(heads) != 1 or not isinstance(heads[0][1], nn.Linear):
            raise UnsupportedModelError("torchvision VisionTransformer with a pre-logits layer (representation_size:"
                                        " a tanh before the head) is not linear in the class token: not read.")
        blocks = [BlockPlan(norm1=l.ln_1, heads=l.num_heads, head_dim=l.self_attention.head_dim,
                            scale=l.self_attention.head_dim ** -0.5, w_o=l.self_attention.out_proj.weight,
                            b_o=l.self_attention.out_proj.bias, mlp_out=l.mlp, mha=l.self_attention) for l in layers]
        return Plan(family, model.conv_proj, model.class_token[0], blocks, layers[0], model.encoder.ln,
                    heads[0][1], True, heads[0][1])
    raise UnsupportedModelError(f"{type(model).__name__}: no component reader for this model.")


def read(model: nn.Module, pixels: torch.Tensor) -> tuple[Plan, Seen]:
    """The plan and one hooked forward of the user's model; ``seen.features`` is what ``u`` is read against
    (the classifier's input, or the tower's pooled feature)."""
    p = plan(model)
    check_norm(p.final_norm, "final norm")
    seen = capture(p, lambda: model(pixels), model)
    if p.family in ("hf-vit", "dinov2") and p.classifier is None:
        seen.features = seen.final_out[:, 0]  # the class token's final feature (ViTModel's tanh pooler not read)
    return p, seen


def readout(model: nn.Module, p: Plan, seen: Seen, u: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(g_after [B, N, D], const [B], pool_mlp [B])``: the read direction on the final norm's output for ``u``
    [B, F] over the features, the constants, and a MAP head's MLP part."""
    z = seen.final_out.double()
    b, n, d = z.shape
    g = torch.zeros_like(z)
    zero = torch.zeros(b, dtype=torch.float64, device=z.device)
    if p.family == "siglip":
        return _map_readout(model.head, seen, u, z)
    if u.shape[-1] == 2 * d:  # DINOv2's classifier: [class token, mean of the patch tokens]
        g[:, 0] = u[:, :d]
        g[:, 1:] = u[:, None, d:] / (n - 1)
    else:
        g[:, 0] = u
    return g, zero, zero


def _map_readout(head: nn.Module, seen: Seen, u: torch.Tensor, z: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SigLIP's pooling head ``y = s + mlp(norm(s))``, ``s = out_proj(attend(probe, z))``, with its attention held:
    each token's direction is ``sum_h A_h(j) W_V^h^T W_O^h^T u``; the value and output biases are constants (the
    attention sums to 1); the head's MLP output is its own part."""
    mha = head.attention
    b, n, d = z.shape
    h = mha.num_heads
    dh = d // h
    q = mha_qkv(mha, head.probe.detach().expand(b, -1, -1))[0]
    _, k, _ = mha_qkv(mha, z)
    q, k = (t.reshape(b, -1, h, dh).transpose(1, 2) for t in (q, k))
    probs = ((q * dh ** -0.5) @ k.transpose(-2, -1)).softmax(-1)[:, :, 0]  # [B, H, N]
    e = (u @ mha.out_proj.weight.detach().double()).reshape(b, h, dh)
    w_v = mha.in_proj_weight.detach().double()[2 * d:].reshape(h, dh, d)
    g = torch.einsum("bhj,bhe,hed->bjd", probs, e, w_v)
    const = (u * mha.out_proj.bias.detach().double()).sum(-1) if mha.out_proj.bias is not None else u[:, 0] * 0
    if mha.in_proj_bias is not None:
        const = const + (e * mha.in_proj_bias.detach().double()[2 * d:].reshape(h, dh)).sum((-1, -2))
    pool_mlp = (u * seen.extra["pool_mlp"][:, 0].double()).sum(-1)
    return g, const, pool_mlp
