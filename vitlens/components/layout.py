"""The site map of every model the component analyses read (docs/definitions.md, "Named sites"): which of the
model's own modules is each block, its attention and MLP branches and its heads' projection, and how the residual
after the blocks is read out. ``decompose``, ``logit_lens``, ``token_norms``, ``patch_activations`` and
``mean_ablate`` all read a model through one ``Layout`` and its named sites (``vitlens.engine.sites``), so each reads
the same models and refuses the same others, in one line (``refuse``).

Read: timm's ``VisionTransformer``; Hugging Face ``ViTModel`` / ``ViTForImageClassification``, ``Dinov2Model`` /
``Dinov2ForImageClassification``, CLIP vision towers and ``SiglipVisionModel``; OpenCLIP's vision transformer;
torchvision's ``VisionTransformer``. A model with classes is followed by class (its logits); a tower without them
by a direction over its embedding (a text embedding, a chosen vector) or a matrix of prompt embeddings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, cast

import numpy as np
import torch
from torch import nn

from ..engine.sites import HookPoint, hook_points, record
from ..errors import InvalidParameterError, UnsupportedModelError, VitlensError
from ..families import family_of
from .refusals import refuse_other_blocks, refuse_other_openclip
from .prenorm import head_attention, mha_qkv

#: the structures read, by (module prefix, class names); the first that matches names the model's structure
STRUCTURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "timm-vit": ("timm", ("VisionTransformer",)),
    "hf-vit": ("transformers", ("ViTModel", "ViTForImageClassification")),
    "dinov2": ("transformers", ("Dinov2Model", "Dinov2ForImageClassification")),
    "hf-clip": ("transformers", ("CLIPVisionModel", "CLIPVisionModelWithProjection")),
    "siglip": ("transformers", ("SiglipVisionModel",)),
    "openclip": ("open_clip", ("VisionTransformer",)),
    "torchvision-vit": ("torchvision", ("VisionTransformer",)),
}

#: the models read, in words (every refusal says it)
READ = ("timm VisionTransformer, Hugging Face CLIP / SigLIP vision towers, ViTModel / ViTForImageClassification, "
        "Dinov2Model / Dinov2ForImageClassification, OpenCLIP vision towers, torchvision VisionTransformer")


def structure(model: nn.Module) -> str | None:
    """The structure of ``model`` in ``STRUCTURES``, or None."""
    name, where = type(model).__name__, type(model).__module__
    for key, (prefix, names) in STRUCTURES.items():
        if where.startswith(prefix) and name in names:
            return key
    return None


def refuse(module: nn.Module, name: str) -> str:
    """Refuse, in one line and by name, a model no site map knows (the same refusal for every component analysis);
    the structure of one it knows."""
    kind = structure(module)
    if kind is None:
        raise UnsupportedModelError(
            f"{name} ({type(module).__name__}): the component analyses (direct contributions, logit lens, token "
            f"norms, patching, mean-ablation) read {READ}; {type(module).__name__}'s blocks are not among them: "
            f"{_why_not(module)}.")
    return kind


def _why_not(module: nn.Module) -> str:
    """Why a model no site map knows gives no residual sum, by how vitlens reads its attention (its family)."""
    try:
        family = family_of(module)
    except VitlensError:
        family = None
    if family is not None and family.windows is not None:
        return ("they attend in windows over hierarchical stages joined by patch merging, so no one residual stream "
                "runs through them")
    if family is not None and family.name == "generic":
        return ("the generic call-level capture reads their attention calls, not their norms, branches and scales, "
                "which a residual sum needs")
    return "their norms, branches and scales are not known to give a residual sum"


@dataclass
class BlockSites:
    """One block's modules.

    Attributes:
        block: the block (its input and output are the residual stream).
        attn: the module whose output is the attention branch as written to the stream.
        mlp: the module whose output is the MLP branch as written to the stream.
        out_proj: the attention's output projection, whose input is the heads side by side (None where an
            ``nn.MultiheadAttention`` fuses it: ``mha``).
        heads, head_dim, scale: the attention's heads, their width and the logits' scale.
        q, k: modules whose outputs are the queries and keys; ``qkv``: one whose output packs them (timm);
            ``norm1`` with ``mha``: the packed in-projection applied to ``norm1``'s output.
        qk_norm: timm's ``(q_norm, k_norm)``, applied to the heads' queries and keys.
    """

    block: nn.Module
    attn: nn.Module
    mlp: nn.Module
    out_proj: nn.Module | None
    heads: int
    head_dim: int
    scale: float
    q: nn.Module | None = None
    k: nn.Module | None = None
    qkv: nn.Module | None = None
    qk_norm: tuple[nn.Module, nn.Module] | None = None
    norm1: nn.Module | None = None
    mha: nn.MultiheadAttention | None = None


def _hf_sites(layer: nn.Module, attn: nn.Module, branch: nn.Module, mlp: nn.Module) -> BlockSites:
    heads = int(getattr(attn, "num_attention_heads", getattr(attn, "num_heads", 0)))
    dh = int(attn.head_dim)
    scale = float(getattr(attn, "scale", getattr(attn, "scaling", dh ** -0.5)))
    return BlockSites(layer, branch, mlp, attn.o_proj if hasattr(attn, "o_proj") else attn.out_proj, heads, dh, scale,
                      q=attn.q_proj, k=attn.k_proj)


class Layout:
    """A model's blocks, their sites, its prefix tokens and its readout from the residual after the blocks."""

    def __init__(self, model: nn.Module, name: str = "") -> None:
        kind = refuse(model, name or type(model).__name__)
        self.model, self.kind = model, kind
        self.classifier: nn.Module | None = None
        self.num_registers = 0
        if kind == "timm-vit":
            refuse_other_blocks(model)
            self.blocks = list(model.blocks)
            self.sites = [BlockSites(b, b.ls1, b.ls2, b.attn.proj, b.attn.num_heads, b.attn.head_dim,
                                     float(b.attn.scale), qkv=b.attn.qkv, qk_norm=(b.attn.q_norm, b.attn.k_norm))
                          for b in self.blocks]
            self.num_prefix = int(model.num_prefix_tokens)
            self.has_class_token = getattr(model, "cls_token", None) is not None
            reg = getattr(model, "reg_token", None)
            self.num_registers = int(reg.shape[1]) if reg is not None else 0
            self.classifier = model.head
            self.final_norm = model.norm
        elif kind == "openclip":
            refuse_other_openclip(model)
            self.blocks = list(model.transformer.resblocks)
            self.sites = [BlockSites(b, b.ls_1, b.ls_2, None, b.attn.num_heads, b.attn.head_dim,
                                     b.attn.head_dim ** -0.5, norm1=b.ln_1, mha=b.attn) for b in self.blocks]
            self.num_prefix, self.has_class_token = 1, True
            self.final_norm = model.ln_post
        elif kind == "torchvision-vit":
            self.blocks = list(model.encoder.layers)
            self.sites = [BlockSites(l, l.self_attention, l.mlp, None, l.num_heads, l.self_attention.head_dim,
                                     l.self_attention.head_dim ** -0.5, norm1=l.ln_1, mha=l.self_attention)
                          for l in self.blocks]
            self.num_prefix, self.has_class_token = 1, True
            self.classifier = model.heads
            self.final_norm = model.encoder.ln
        else:
            vm = {"hf-vit": "vit", "dinov2": "dinov2", "hf-clip": "vision_model"}.get(kind)
            self.vm = getattr(model, vm, model) if vm else model
            if kind == "dinov2":
                self.blocks = list(self.vm.encoder.layer)
                self.sites = [_hf_sites(l, l.attention, l.layer_scale1, l.layer_scale2) for l in self.blocks]
            elif kind == "hf-vit":
                self.blocks = list(self.vm.layers)
                self.sites = [_hf_sites(l, l.attention, l.attention, l.mlp) for l in self.blocks]
            else:
                self.blocks = list(self.vm.encoder.layers)
                self.sites = [_hf_sites(l, l.self_attn, l.self_attn, l.mlp) for l in self.blocks]
            self.num_prefix = 0 if kind == "siglip" else 1
            self.has_class_token = kind != "siglip"
            self.classifier = getattr(model, "classifier", None) if kind in ("hf-vit", "dinov2") else None
            self.final_norm = self.vm.layernorm if kind in ("hf-vit", "dinov2") else self.vm.post_layernorm

    @property
    def classes(self) -> bool:
        """Whether the model has classes (its output is logits) rather than an embedding read along directions."""
        return self.classifier is not None

    def points(self) -> dict[str, HookPoint]:
        """The named sites of the model (``vitlens.engine.sites``), registered ones included."""
        points: dict[str, HookPoint] = {}
        for i, s in enumerate(self.sites):
            points[f"blocks.{i}.hook_resid_pre"] = HookPoint(s.block, "input")
            points[f"blocks.{i}.hook_resid_post"] = HookPoint(s.block)
            points[f"blocks.{i}.hook_attn_out"] = HookPoint(s.attn)
            points[f"blocks.{i}.hook_mlp_out"] = HookPoint(s.mlp)
            if s.out_proj is not None:
                points[f"blocks.{i}.attn.hook_z"] = HookPoint(s.out_proj, "input")
            if s.mha is not None:
                # the layouts that set mha set norm1 beside it (BlockSites)
                points[f"blocks.{i}.ln1.hook_normalized"] = HookPoint(cast(nn.Module, s.norm1))
            elif s.qkv is not None:
                points[f"blocks.{i}.attn.hook_qkv"] = HookPoint(s.qkv)
            else:
                # neither mha nor qkv: the layout gave q and k (_hf_sites)
                points[f"blocks.{i}.attn.hook_q"] = HookPoint(cast(nn.Module, s.q))
                points[f"blocks.{i}.attn.hook_k"] = HookPoint(cast(nn.Module, s.k))
        points["ln_final.hook_in"] = HookPoint(self.final_norm, "input")
        return hook_points(self.model, points)

    def probs(self, i: int, seen: dict[str, torch.Tensor]) -> torch.Tensor:
        """Block i's attention probabilities [B, H, N, N], float64, recomputed from the queries and keys its sites
        saw (``softmax(q k^T * scale)``; timm's through its ``q_norm`` / ``k_norm``)."""
        s = self.sites[i]
        if s.mha is not None:
            q, k, _ = mha_qkv(s.mha, seen[f"blocks.{i}.ln1.hook_normalized"])
        elif s.qkv is not None:
            qkv = seen[f"blocks.{i}.attn.hook_qkv"]
            b, n, _ = qkv.shape
            q, k, _ = qkv.reshape(b, n, 3, s.heads, s.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
            q_norm, k_norm = cast(tuple[nn.Module, nn.Module], s.qk_norm)  # timm's layout sets it beside qkv
            with torch.no_grad():
                q, k = q_norm(q), k_norm(k)
            return ((q.double() * s.scale) @ k.double().transpose(-2, -1)).softmax(dim=-1)
        else:
            q, k = seen[f"blocks.{i}.attn.hook_q"], seen[f"blocks.{i}.attn.hook_k"]
        return head_attention(q, k, None, s.heads, s.head_dim, s.scale)[0]

    def run(self, pixels: torch.Tensor) -> torch.Tensor:
        """The model's output from one forward of the user's model: logits [B, C] where it has classes, else its
        image embedding [B, F]."""
        m, kind = self.model, self.kind
        if kind in ("timm-vit", "torchvision-vit"):
            return m(pixels)
        if kind == "openclip":
            out = m(pixels)
            return out[0] if isinstance(out, tuple) else out
        out = m(pixel_values=pixels)
        if self.classifier is not None:
            return out.logits
        if kind in ("hf-vit", "dinov2"):  # the class token after the final norm (ViTModel's tanh pooler not read)
            return out.last_hidden_state[:, 0]
        return out.image_embeds if getattr(out, "image_embeds", None) is not None else out.pooler_output

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The output read from a residual ``x`` [B, N, D] by the model's own final norm, pooling and head (logits
        or embedding; at the last depth: the output)."""
        m, kind = self.model, self.kind
        if kind == "timm-vit":
            return m.forward_head(m.norm(x))
        if kind == "openclip":
            pooled = m._pool(x)[0]
            return pooled @ m.proj if m.proj is not None else pooled
        if kind == "torchvision-vit":
            return m.heads(m.encoder.ln(x)[:, 0])
        if kind == "siglip":
            return self.vm.head(self.vm.post_layernorm(x))
        if kind == "hf-clip":
            pooled = self.final_norm(x[:, 0])
            proj = getattr(m, "visual_projection", None)
            return proj(pooled) if proj is not None else pooled
        z = self.final_norm(x)
        if kind == "dinov2" and self.classifier is not None:
            return self.classifier(torch.cat([z[:, 0], z[:, 1:].mean(1)], dim=-1))
        return self.classifier(z[:, 0]) if self.classifier is not None else z[:, 0]

    def token_features(self, x: torch.Tensor) -> torch.Tensor:
        """[B, N, F] each token's residual read alone as if it were the pooled feature (through the final norm and
        the head without the pooling; SigLIP: the MAP head on a one-token sequence; DINOv2's classifier: the token
        as both the class token and the patch mean)."""
        m, kind = self.model, self.kind
        if kind == "timm-vit":
            return m.head(m.fc_norm(m.norm(x)))
        if kind == "openclip":
            t = m.ln_post(x)
            return t @ m.proj if m.proj is not None else t
        if kind == "siglip":
            b, n, d = x.shape
            return self.vm.head(self.vm.post_layernorm(x).reshape(b * n, 1, d)).reshape(b, n, -1)
        z = self.final_norm(x)
        if kind == "dinov2" and self.classifier is not None:
            return self.classifier(torch.cat([z, z], dim=-1))
        if kind == "hf-clip":
            proj = getattr(m, "visual_projection", None)
            return proj(z) if proj is not None else z
        return self.classifier(z) if self.classifier is not None else z

    def scorer(self, direction: object) -> Callable[[torch.Tensor], torch.Tensor]:
        """The scores a forward yields: logits where the model has classes, else the embedding against the prompt
        embeddings (``direction``, required)."""
        if self.classes:
            if direction is not None:
                raise InvalidParameterError("direction= is for models without classes (CLIP, SigLIP, OpenCLIP "
                                            "towers, ViTModel, Dinov2Model); a classifier follows a class (target=).")
            return self.run
        held: dict[str, torch.Tensor] = {}

        def run(x: torch.Tensor) -> torch.Tensor:
            out = self.run(x).double()
            if "t" not in held:
                held["t"] = prompts(direction, out.shape[-1], out)
            return out @ held["t"].T
        return run


def residual_stream(layout: Layout, pixels: torch.Tensor, with_probs: bool = False
                    ) -> tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor]]:
    """``(stream, output, probs)``: the residual entering block 1 and leaving each block (L + 1 entries, depth 0 the
    embeddings; ``blocks.{i}.hook_resid_pre`` / ``hook_resid_post``), the model's output (``Layout.run``) and, with
    ``with_probs``, each block's attention probabilities [B, H, N, N] in float64 (``Layout.probs``)."""
    points = layout.points()
    n = len(layout.blocks)
    names = ["blocks.0.hook_resid_pre"] + [f"blocks.{i}.hook_resid_post" for i in range(n)]
    if with_probs:
        names += [k for k in points if k.startswith("blocks.") and k.split(".", 2)[2] in
                  ("ln1.hook_normalized", "attn.hook_qkv", "attn.hook_q", "attn.hook_k")]
    seen, out = record(layout.model, {k: points[k] for k in names}, lambda: layout.run(pixels))
    probs = [layout.probs(i, seen) for i in range(n)] if with_probs else []
    return [seen[k] for k in names[:n + 1]], out, probs


def prompts(direction: object, dim: int, like: torch.Tensor) -> torch.Tensor:
    """[K, F] float64 prompt embeddings (one direction: K = 1) over a tower's F-dimensional embedding."""
    if direction is None:
        raise InvalidParameterError("This model has no classes, so there is no class logit to follow.",
                                    fixes={"python": f"Give direction= a text embedding ([{dim}]) or a matrix of "
                                                     f"prompt embeddings ([K, {dim}]).",
                                           "app": "The lens of a tower follows a direction of its output (a text "
                                                  "embedding), which the app does not ask for: in Python, "
                                                  "vl.logit_lens(m, images, direction=...)."})
    t = (direction.detach() if torch.is_tensor(direction) else torch.as_tensor(np.asarray(direction)))
    t = t.to(dtype=torch.float64, device=like.device)
    t = t[None] if t.dim() == 1 else t
    if t.dim() != 2 or t.shape[1] != dim:
        raise InvalidParameterError(f"direction has shape {tuple(t.shape)}; the model's embedding has {dim} "
                                    f"dimensions: give [{dim}] or [K, {dim}].")
    return t


def first(out: Any) -> torch.Tensor:
    """A module's output tensor (the first element of a tuple)."""
    return out[0] if isinstance(out, tuple) else out


def read_sites(model: object, pixels: torch.Tensor, names: list[str] | None = None) -> dict[str, Any]:
    """A cache of named sites, asked for by name: one forward of the model with the sites ``names`` read (default
    every site of its map, registered ones included), the forward untouched.

    Args:
        model: a ``LoadedModel`` or a module that ``vl.decompose`` reads (``READ``).
        pixels: [B, 3, H, W] preprocessed images on the model's device and dtype.
        names: the sites wanted (``Layout.points`` lists them).

    Returns:
        Each site's value by name.
    """
    module = getattr(model, "model", model)
    if not isinstance(module, nn.Module):
        raise UnsupportedModelError(f"read_sites reads a LoadedModel or a torch module; got {type(model).__name__}.")
    layout = Layout(module)
    points = layout.points()
    unknown = [n for n in names or [] if n not in points]
    if unknown:
        raise InvalidParameterError(f"{type(module).__name__} has no site {unknown[0]!r}; its sites: "
                                    f"{', '.join(list(points)[:8])}, ...")
    seen, _ = record(module, {n: points[n] for n in names} if names else points, lambda: layout.run(pixels))
    return seen
