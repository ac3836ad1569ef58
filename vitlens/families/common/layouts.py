"""Layouts of the generic call-level capture (``vitlens.families.generic``): where a global-attention ViT keeps
its patch embedding, its prefix tokens and its blocks' attention modules, for each kind of module tree.

The capture itself knows nothing of a model but this: one convolution cuts the image into patches (its output's
spatial positions are the patch tokens, its stride the token stride), and every block has one module whose forward
ends in one ``F.scaled_dot_product_attention`` call over the prefix and patch tokens. A ``Layout`` says where those
are in one kind of model, what prefix tokens the model declares (checked against the probe forward's token count),
how to call it, and where its position table, preprocessing and attention pool are:

- ``TimmLayout``: a timm-style ViT, ``patch_embed.proj`` (a convolution) and ``blocks[i].attn``.
- ``HuggingFaceLayout`` (its own module, ``layouts_hf``): a transformers vision model (or a model's ``vision_model``)
  with one patch embedding (a convolution in its ``embeddings``, or a tower's own) and one list of layers, each with one
  child attention module (DINOv3, AIMv2, Data2Vec-Vision, BEiT,
  ...), run with ``attn_implementation="sdpa"`` (what the capture reads; other implementations are refused in one line).
- ``OpenClipLayout``: open_clip's own ``VisionTransformer`` built with ``CustomResidualAttentionBlock`` (open_clip's
  ``Attention``: qk-norm, head-scale, inner-norm options), ``conv1`` and ``transformer.resblocks[i].attn``.

A new kind of module tree is one more ``Layout`` subclass registered with ``register_layout``; the capture, the token
geometry (grid from the convolution's arithmetic, prefix count from a probe forward) and the refusals are shared.
"""
from __future__ import annotations

from typing import Any, Sequence, cast

import torch
from torch import nn

from ...core.spec import ModelSpec
from ...core.tokens import TokenLayout
from ...errors import UnsupportedModelError, ViewNotAvailableError
from ..base import CaptureRequest, Handles, refuse_other_size
from .patches import PatchEmbedding, patch_embedding
from .openclip import (encode_image, install_attentional_pool, is_open_clip, is_sincos, open_clip_data_config,
                              visual_of)


class Layout:
    """Where a kind of global-attention ViT keeps what the generic call-level capture reads (the module docstring).

    Subclasses fill in ``matches``, ``patch_conv``, ``attention_modules``, ``image_size``, ``forward`` and ``logits``;
    the rest have defaults for a model that declares nothing (no prefix tokens it names, no position table).
    """

    #: short name, in messages
    name = "layout"
    #: how to turn the module's fused (SDPA) path on, for the refusal of a block that makes no SDPA call
    fused_hint = "enable the module's fused path (timm: fused_attn=True) or write a family for it"

    def matches(self, model: nn.Module) -> bool:
        raise NotImplementedError

    def check(self, model: nn.Module, name: str) -> None:
        """Refuse, in one line, what this kind of model can be built with and the capture would read wrong."""

    def patch_conv(self, model: nn.Module) -> nn.Module:
        """The module that cuts the image into patch tokens (a convolution, whose stride is the token stride, or a
        linear layer over unfolded patches: ``patch_embedding`` reads either)."""
        raise NotImplementedError

    def patch_embedding(self, model: nn.Module) -> PatchEmbedding:
        """What cuts the image into patch tokens, read as a convolution of the pixels (``common.patches``): the
        ``patch_conv`` here; a layout whose patch embedding is no convolution (a linear layer over unfolded patches)
        says so by overriding this."""
        found = patch_embedding(self.patch_conv(model))
        if found is None:
            raise UnsupportedModelError(f"{type(model).__name__}: its patch embedding "
                                        f"({type(self.patch_conv(model)).__name__}) is no convolution vitlens reads.")
        return found

    def stem(self, model: nn.Module) -> nn.Module | None:
        """A CNN that runs before the patch convolution (a hybrid), or None: the convolution sees pixels."""
        return None

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        """Each block's module whose forward makes the block's one SDPA call, first block first (a direct child of
        the block, so that its parent is the block: ``LoadedModel.block_names``)."""
        raise NotImplementedError

    def declared_prefix(self, model: nn.Module) -> int | None:
        """The prefix tokens the model declares (None: it declares none; the probe's count is taken as it is)."""
        cls, dist, registers = self.prefix_parts(model)
        return int(cls) + int(dist) + registers if (cls or dist or registers) else None

    def prefix_parts(self, model: nn.Module) -> tuple[bool, bool, int]:
        """(class token, distillation token, register tokens) the model declares, in sequence order."""
        return False, False, 0

    def token_layout(self, model: nn.Module, grid: tuple[int, int]) -> TokenLayout | None:
        """The model's token order when it is not its declared prefix tokens then row-major cells (None: it is)."""
        return None

    def packs(self, model: nn.Module) -> bool:
        """Whether the model packs a batch's images in one sequence with a block-diagonal mask (Pixtral)."""
        return False

    def calls_per_image(self, model: nn.Module) -> bool:
        """Whether each block makes one attention call per image of the batch (Qwen3-VL's vision model: images
        flattened in one sequence, attended image by image); the calls' maps are the batch's, in order."""
        return False

    def packed_forward(self, model: nn.Module, images: Sequence[torch.Tensor]) -> Any:
        """One forward of images [C, H_i, W_i] of different sizes packed as the model packs them."""
        raise NotImplementedError

    def declared_grid(self, model: nn.Module) -> tuple[int, int] | None:
        """The patch grid the model says it was built for (checked against the convolution's), or None."""
        return None

    def image_size(self, model: nn.Module, name: str, input_size: Sequence[int] | None) -> tuple[int, int]:
        """(H, W) the model is read at: ``input_size`` where the model takes it, else the size it was built for."""
        raise NotImplementedError

    def dynamic(self, model: nn.Module) -> bool:
        """Whether the model takes other input sizes (``ModelSpec.dynamic_img_size``)."""
        return False

    def forward(self, model: nn.Module, x: torch.Tensor) -> Any:
        """One forward of a preprocessed batch through the blocks (the probe's)."""
        return self.logits(model, x)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The classifier output (or image embedding) of a preprocessed batch."""
        raise NotImplementedError

    def position_rows(self, model: nn.Module) -> torch.Tensor | None:
        """The learned absolute position table [1, rows, D] as the model stores it (prefix rows included), or None."""
        return None

    def embed_dim(self, model: nn.Module) -> int:
        return int(self.patch_embedding(model).out_channels)

    def num_classes(self, model: nn.Module) -> int:
        return 0

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        """Preprocessing with timm's keys (input_size, interpolation, mean, std, crop_pct, crop_mode)."""
        raise NotImplementedError

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles, name: str) -> None:
        """Side capture of the model's attention pool (``Family.install_pool``)."""
        raise ViewNotAvailableError(f"{name} pools without an attention pool vitlens reads, so there is no pool "
                                    "attention to show.")

    def tower(self, model: nn.Module) -> nn.Module:
        """The submodule whose blocks are read (the model itself, unless a layout reads a whole model's tower)."""
        return model

    def module_name(self, model: nn.Module, module: nn.Module) -> str:
        """``module``'s name in ``model`` (``named_modules``), for descriptions."""
        return next((n for n, mod in model.named_modules() if mod is module), type(module).__name__)


LAYOUTS: list[Layout] = []


def register_layout(layout: Layout) -> Layout:
    """Add ``layout`` to ``LAYOUTS``, the list the generic call-level capture reads (in order: the first that matches
    reads the model).

    Args:
        layout: the layout to add (an instance of a ``Layout`` subclass).

    Returns:
        ``layout``, so that ``register_layout(MyLayout())`` can be a module-level statement.
    """
    LAYOUTS.append(layout)
    return layout


def layout_of(model: nn.Module) -> Layout | None:
    """The first registered layout that matches ``model``, or None."""
    return next((layout for layout in LAYOUTS if layout.matches(model)), None)


# --------------------------------------------------------------------------------------------------- timm-style


def _timm_patches(model: nn.Module) -> nn.Module | None:
    """A timm-style model's patch embedding: ``patch_embed.proj`` (a convolution), or ``patch_embed`` itself when it
    is a linear layer over unfolded patches (timm's Gemma 4 encoder: ``input_proj``); None otherwise."""
    pe = getattr(model, "patch_embed", None)
    proj = getattr(pe, "proj", None)
    if isinstance(proj, nn.Conv2d):
        return proj
    read = patch_embedding(pe) if isinstance(pe, nn.Module) else None
    return pe if read is not None and read.kind == "linear" else None


def _timm_plain(model: nn.Module) -> bool:
    """A timm-style ViT itself: a patch embedding (``_timm_patches``) and a non-empty ``blocks``, each with ``attn``."""
    blocks = getattr(model, "blocks", None)
    if _timm_patches(model) is None or not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
        return False
    return len(blocks) > 0 and all(isinstance(getattr(b, "attn", None), nn.Module) for b in blocks)


def _timm_body(model: nn.Module) -> nn.Module | None:
    """The timm-style ViT a model is, or the one a timm classifier wraps as its ``encoder`` (``Qwen3VitClassifier``,
    ``Gemma4VitClassifier``: an encoder, a norm and a ``head``, run by ``forward_head``): its blocks are read, its
    output is the classifier's logits; None for neither."""
    if _timm_plain(model):
        return model
    encoder = getattr(model, "encoder", None)
    if isinstance(encoder, nn.Module) and _timm_plain(encoder) and callable(getattr(model, "forward_head", None)):
        return encoder
    return None


def _body(model: nn.Module) -> nn.Module:
    body = _timm_body(model)
    if body is None:
        raise UnsupportedModelError(f"{type(model).__name__} no longer has the layout the generic capture read.")
    return body


class TimmLayout(Layout):
    """A timm-style ViT: ``patch_embed.proj`` (a convolution) or a linear ``patch_embed`` over unfolded patches
    (timm's ``gemma4_vit_*`` encoder) and a sequence ``blocks``, each with ``attn``; or a timm classifier wrapping
    one as its ``encoder`` (``_timm_body``), whose logits are the classifier's."""

    name = "timm-style"

    def matches(self, model: nn.Module) -> bool:
        return _timm_body(model) is not None

    def check(self, model: nn.Module, name: str) -> None:
        if isinstance(getattr(_body(model).patch_embed, "backbone", None), nn.Module):
            raise UnsupportedModelError(
                f"{name!r} embeds patches through a CNN backbone ({type(_body(model).patch_embed).__name__}), whose "
                "pixel stride vitlens's generic call-level capture does not read from the projection; it reads a patch "
                "embedding that is one convolution of the pixels.")

    def patch_conv(self, model: nn.Module) -> nn.Module:
        return cast(nn.Module, _timm_patches(_body(model)))  # not None: matches() takes only a model it reads

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.attn for block in _body(model).blocks]

    def declared_prefix(self, model: nn.Module) -> int | None:
        n = getattr(_body(model), "num_prefix_tokens", None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
        found = [getattr(_body(model), a, None) for a in ("cls_token", "dist_token", "reg_token")]
        if not any(isinstance(t, torch.Tensor) for t in found):
            return None
        return sum(int(t.shape[1]) for t in found if isinstance(t, torch.Tensor) and t.dim() == 3)

    def prefix_parts(self, model: nn.Module) -> tuple[bool, bool, int]:
        cls = isinstance(getattr(_body(model), "cls_token", None), torch.Tensor)
        dist = isinstance(getattr(_body(model), "dist_token", None), torch.Tensor)
        reg = getattr(_body(model), "reg_token", None)
        registers = int(reg.shape[1]) if isinstance(reg, torch.Tensor) and reg.dim() == 3 else \
            int(getattr(_body(model), "num_reg_tokens", 0) or 0)
        return cls, dist, registers

    def declared_grid(self, model: nn.Module) -> tuple[int, int] | None:
        grid = getattr(_body(model).patch_embed, "grid_size", None)
        return (int(grid[0]), int(grid[1])) if grid is not None else None

    def image_size(self, model: nn.Module, name: str, input_size: Sequence[int] | None) -> tuple[int, int]:
        built = getattr(_body(model).patch_embed, "img_size", None)
        if built is not None and not getattr(_body(model), "dynamic_img_size", False):
            refuse_other_size(name, "generic", built, input_size)
        size = input_size if input_size is not None else built
        if size is None:  # a model of any size (timm's Gemma 4): the size of its pretrained configuration
            size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size", (None,))[1:] or None
        if size is None:
            raise UnsupportedModelError(
                f"{name!r}: vitlens could not infer the input size (patch_embed has no img_size): pass "
                "data_config={'input_size': (3, H, W)}.")
        return (int(size[0]), int(size[1])) if len(size) >= 2 else (int(size[0]), int(size[0]))

    def dynamic(self, model: nn.Module) -> bool:
        return bool(getattr(_body(model), "dynamic_img_size", False))

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def position_rows(self, model: nn.Module) -> torch.Tensor | None:
        pos = getattr(_body(model), "pos_embed", None)
        return pos if isinstance(pos, torch.Tensor) and pos.dim() == 3 else None

    def embed_dim(self, model: nn.Module) -> int:
        return int(getattr(_body(model), "embed_dim", self.patch_embedding(model).out_channels))

    def num_classes(self, model: nn.Module) -> int:
        return int(getattr(model, "num_classes", 0) or 0)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        from timm.data import resolve_data_config

        cfg = dict(resolve_data_config({}, model=model))
        cfg["input_size"] = (self.patch_embedding(model).in_channels, *spec.image_size)
        names = (getattr(model, "pretrained_cfg", None) or {}).get("label_names")
        if names:
            cfg["label_names"] = list(names)
        return cfg


# ---------------------------------------------------------------------------------------------------- OpenCLIP


class OpenClipLayout(Layout):
    """open_clip's own ``VisionTransformer`` whose blocks are ``CustomResidualAttentionBlock`` (open_clip's
    ``Attention``): ``conv1``, a class token, ``transformer.resblocks[i].attn``."""

    name = "OpenCLIP"
    fused_hint = "keep open_clip's fused path (Attention.use_fsdpa=True, its default)"

    @staticmethod
    def _visual(model: nn.Module) -> nn.Module:
        return visual_of(model)

    def matches(self, model: nn.Module) -> bool:
        if not is_open_clip(model):
            return False
        from open_clip.transformer import VisionTransformer

        visual = self._visual(model)
        return isinstance(visual, VisionTransformer) and len(visual.transformer.resblocks) > 0 and \
            all(isinstance(getattr(b, "attn", None), nn.Module) for b in visual.transformer.resblocks)

    def check(self, model: nn.Module, name: str) -> None:
        for i, block in enumerate(self._visual(model).transformer.resblocks):
            if getattr(block.attn, "logit_scale", None) is not None:
                raise UnsupportedModelError(
                    f"{name!r}: image block {i} uses open_clip's scaled-cosine attention (scaled_cosine_attn), an "
                    "explicit softmax with no scaled_dot_product_attention call for vitlens's generic capture to read "
                    "(and open_clip 3.3's own forward of it fails on 4-D tensors).")
            if isinstance(block.attn, nn.MultiheadAttention) or hasattr(block, "ln_1_kv"):
                raise UnsupportedModelError(
                    f"{name!r}: image block {i} ({type(block).__name__}) mixes nn.MultiheadAttention blocks with "
                    "open_clip's own Attention; vitlens reads towers of one or the other.")

    def tower(self, model: nn.Module) -> nn.Module:
        return self._visual(model)

    def patch_conv(self, model: nn.Module) -> nn.Conv2d:
        return self._visual(model).conv1

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.attn for block in self._visual(model).transformer.resblocks]

    def prefix_parts(self, model: nn.Module) -> tuple[bool, bool, int]:
        return True, False, 0

    def declared_grid(self, model: nn.Module) -> tuple[int, int]:
        grid = self._visual(model).grid_size
        return int(grid[0]), int(grid[1])

    def image_size(self, model: nn.Module, name: str, input_size: Sequence[int] | None) -> tuple[int, int]:
        built = tuple(int(s) for s in self._visual(model).image_size)
        refuse_other_size(name, "OpenCLIP", built, input_size)
        return built[0], built[1]

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return encode_image(model, x)

    def position_rows(self, model: nn.Module) -> torch.Tensor | None:
        visual = self._visual(model)
        if is_sincos(visual, self.declared_grid(model)):
            return None  # a fixed 2-D sin-cos table, not a learned one
        return visual.positional_embedding.unsqueeze(0)

    def embed_dim(self, model: nn.Module) -> int:
        return int(self._visual(model).transformer.width)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        return open_clip_data_config(model, spec)

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles, name: str) -> None:
        install_attentional_pool(model, capture, handles)


register_layout(TimmLayout())
register_layout(OpenClipLayout())  # (the Hugging Face layout registers in layouts_hf, imported by the generic capture)


__all__ = ["LAYOUTS", "Layout", "OpenClipLayout", "TimmLayout", "layout_of", "register_layout"]
