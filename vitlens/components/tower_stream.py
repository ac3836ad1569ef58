"""The residual stream of a CLIP-style vision tower (Hugging Face CLIP and SigLIP, OpenCLIP) read with the tower's own
modules, for the logit lens, token norms, activation patching and mean-ablation on towers (docs/definitions.md,
"Logit lens", "Token norms", "Activation patching": towers).

A tower has no classes: its output is an image embedding, read along a direction (a prompt's text embedding, a
chosen vector) or against a matrix of prompt embeddings (one score per prompt).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import InvalidParameterError
from . import hf_clip, openclip
from .prenorm import mha_qkv

SIGLIP = ("SiglipVisionModel",)


def is_tower(model: nn.Module) -> bool:
    """Whether the module is a CLIP, SigLIP or OpenCLIP vision tower."""
    return (hf_clip.is_clip_tower(model) or openclip.is_openclip_tower(model)
            or (type(model).__name__ in SIGLIP and type(model).__module__.startswith("transformers")))


@dataclass
class Sites:
    """One block's modules: its output is the residual (``block``), ``attn`` / ``mlp`` write the attention and MLP
    branches, ``out_proj``'s input is the heads concatenated (None where the attention fuses its output projection:
    ``nn.MultiheadAttention``), ``q`` / ``k`` give the queries and keys (or ``norm1`` with ``mha``'s packed
    in-projection)."""

    block: nn.Module
    attn: nn.Module
    mlp: nn.Module
    out_proj: nn.Module | None
    heads: int
    head_dim: int
    scale: float
    q: nn.Module | None = None
    k: nn.Module | None = None
    norm1: nn.Module | None = None
    mha: nn.MultiheadAttention | None = None


class Tower:
    """A tower's blocks and its readout from the residual after the blocks, by its own modules."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.openclip = openclip.is_openclip_tower(model)
        self.siglip = type(model).__name__ in SIGLIP
        if self.openclip:
            openclip.refuse_unless_supported(model)
            self.blocks = list(model.transformer.resblocks)
            self.sites = [Sites(b, b.ls_1, b.ls_2, None, b.attn.num_heads, b.attn.head_dim, b.attn.head_dim ** -0.5,
                                norm1=b.ln_1, mha=b.attn) for b in self.blocks]
            self.num_prefix = 1
        else:
            vm = getattr(model, "vision_model", model)
            self.vm = vm
            self.blocks = list(vm.encoder.layers)
            self.sites = [Sites(l, l.self_attn, l.mlp, l.self_attn.out_proj, l.self_attn.num_heads,
                                l.self_attn.head_dim, float(l.self_attn.scale), q=l.self_attn.q_proj,
                                k=l.self_attn.k_proj) for l in self.blocks]
            self.num_prefix = 0 if self.siglip else 1

    def run(self, pixels: torch.Tensor) -> torch.Tensor:
        """The tower's image embedding [B, F] from one forward of the user's model."""
        if self.openclip:
            out = self.model(pixels)
            return out[0] if isinstance(out, tuple) else out
        out = self.model(pixel_values=pixels)
        return out.image_embeds if getattr(out, "image_embeds", None) is not None else out.pooler_output

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """[B, F] the embedding read from a residual ``x`` [B, N, D] by the tower's final norm, pooling, head and
        projection (at the last depth: the output)."""
        m = self.model
        if self.openclip:
            pooled = m._pool(x)[0]
            return pooled @ m.proj if m.proj is not None else pooled
        vm = self.vm
        if self.siglip:
            return vm.head(vm.post_layernorm(x))
        pooled = vm.post_layernorm(x[:, 0])
        proj = getattr(m, "visual_projection", None)
        return proj(pooled) if proj is not None else pooled

    def token_features(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, F] each token's residual read alone as if it were the pooled feature (SigLIP: the MAP head on a
        one-token sequence)."""
        m = self.model
        if self.openclip:
            t = m.ln_post(x)
            return t @ m.proj if m.proj is not None else t
        if self.siglip:
            b, n, d = x.shape
            return self.vm.head(self.vm.post_layernorm(x).reshape(b * n, 1, d)).reshape(b, n, -1)
        t = self.vm.post_layernorm(x)
        proj = getattr(m, "visual_projection", None)
        return proj(t) if proj is not None else t


def first(out: Any) -> torch.Tensor:
    """A module's output tensor (the first element of a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def residuals(tower: Tower, pixels: torch.Tensor, with_qk: bool = False
              ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """``(stream, embedding, probs)``: the residual entering block 1 and leaving each block (L + 1 entries), the
    tower's output, and (``with_qk``) each block's attention probabilities [B, H, N, N] in float64, recomputed from
    the captured queries and keys."""
    stream: list[torch.Tensor] = []
    seen: dict[tuple[int, str], torch.Tensor] = {}
    handles = [tower.blocks[0].register_forward_pre_hook(lambda m, a: stream.append(a[0]))]
    try:
        for i, (block, s) in enumerate(zip(tower.blocks, tower.sites)):
            handles.append(block.register_forward_hook(lambda m, a, o: stream.append(first(o))))
            if with_qk:
                pairs = (("x", s.norm1),) if s.mha is not None else (("q", s.q), ("k", s.k))
                for key, mod in pairs:
                    handles.append(mod.register_forward_hook(
                        lambda m, a, o, i=i, key=key: seen.__setitem__((i, key), first(o))))
        with torch.no_grad():
            out = tower.run(pixels)
    finally:
        for h in handles:
            h.remove()
    probs = []
    if with_qk:
        for i, s in enumerate(tower.sites):
            if s.mha is not None:
                q, k, _ = mha_qkv(s.mha, seen[(i, "x")])
            else:
                q, k = seen[(i, "q")].double(), seen[(i, "k")].double()
            b, n, _ = q.shape
            q, k = (t.reshape(b, n, s.heads, s.head_dim).transpose(1, 2) for t in (q, k))
            probs.append(((q * s.scale) @ k.transpose(-2, -1)).softmax(-1))
    return stream, out, probs


def prompts(direction: object, dim: int, like: torch.Tensor) -> torch.Tensor:
    """[K, F] float64 prompt embeddings (one direction: K = 1) over a tower's F-dimensional embedding."""
    if direction is None:
        raise InvalidParameterError("A vision tower has no classes, so there is no class logit to follow by depth.",
                                    fixes={"python": f"Give direction= a text embedding ([{dim}]) or a matrix of "
                                                     f"prompt embeddings ([K, {dim}]).",
                                           "app": "The lens of a tower follows a direction of its output (a text "
                                                  "embedding), which the app does not ask for: in Python, "
                                                  "vl.logit_lens(m, images, direction=...)."})
    t = (direction.detach() if torch.is_tensor(direction) else torch.as_tensor(np.asarray(direction)))
    t = t.to(dtype=torch.float64, device=like.device)
    t = t[None] if t.dim() == 1 else t
    if t.dim() != 2 or t.shape[1] != dim:
        raise InvalidParameterError(f"direction has shape {tuple(t.shape)}; the tower's embedding has {dim} "
                                    f"dimensions: give [{dim}] or [K, {dim}].")
    return t
