"""Layouts of the generic call-level capture (``vitlens.families.generic``): where a global-attention ViT keeps
its patch embedding, its prefix tokens and its blocks' attention modules, for each kind of module tree.

The capture itself knows nothing of a model but this: one convolution cuts the image into patches (its output's
spatial positions are the patch tokens, its stride the token stride), and every block has one module whose forward
ends in one ``F.scaled_dot_product_attention`` call over the prefix and patch tokens. A ``Layout`` says where those
are in one kind of model, what prefix tokens the model declares (checked against the probe forward's token count),
how to call it, and where its position table, preprocessing and attention pool are:

- ``TimmLayout``: a timm-style ViT, ``patch_embed.proj`` (a convolution) and ``blocks[i].attn``.
- ``HuggingFaceLayout``: a transformers vision model (or a model's ``vision_model``) with one patch convolution in its
  ``embeddings`` and one list of layers, each with one child attention module (DINOv3, AIMv2, Data2Vec-Vision, BEiT,
  ...), run with ``attn_implementation="sdpa"`` (what the capture reads; other implementations are refused in one line).
- ``OpenClipLayout``: open_clip's own ``VisionTransformer`` built with ``CustomResidualAttentionBlock`` (open_clip's
  ``Attention``: qk-norm, head-scale, inner-norm options), ``conv1`` and ``transformer.resblocks[i].attn``.

A new kind of module tree is one more ``Layout`` subclass registered with ``register_layout``; the capture, the token
geometry (grid from the convolution's arithmetic, prefix count from a probe forward) and the refusals are shared.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

from ..core.spec import ModelSpec
from ..core.tokens import PrefixToken, TokenLayout, merge_block_layout, standard_layout
from ..errors import UnsupportedModelError
from .base import CaptureRequest, Handles, refuse_other_size
from .common.patches import PatchEmbedding, patch_embedding


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

    def patch_conv(self, model: nn.Module) -> nn.Conv2d:
        """The convolution that cuts the image into patch tokens (its stride is the token stride)."""
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
        from ..errors import ViewNotAvailableError

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
    if isinstance(getattr(pe, "proj", None), nn.Conv2d):
        return pe.proj
    read = patch_embedding(pe) if isinstance(pe, nn.Module) else None
    return pe if read is not None and read.kind == "linear" else None


class TimmLayout(Layout):
    """A timm-style ViT: ``patch_embed.proj`` (a convolution) or a linear ``patch_embed`` over unfolded patches
    (timm's ``gemma4_vit_*`` encoder) and a sequence ``blocks``, each with ``attn``."""

    name = "timm-style"

    def matches(self, model: nn.Module) -> bool:
        blocks = getattr(model, "blocks", None)
        if _timm_patches(model) is None or not isinstance(blocks, (nn.Sequential, nn.ModuleList)):
            return False
        return len(blocks) > 0 and all(isinstance(getattr(b, "attn", None), nn.Module) for b in blocks)

    def check(self, model: nn.Module, name: str) -> None:
        if isinstance(getattr(model.patch_embed, "backbone", None), nn.Module):
            raise UnsupportedModelError(
                f"{name!r} embeds patches through a CNN backbone ({type(model.patch_embed).__name__}), whose pixel "
                "stride vitlens's generic call-level capture does not read from the projection; it reads a patch "
                "embedding that is one convolution of the pixels.")

    def patch_conv(self, model: nn.Module) -> nn.Module:
        return _timm_patches(model)

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return [block.attn for block in model.blocks]

    def declared_prefix(self, model: nn.Module) -> int | None:
        n = getattr(model, "num_prefix_tokens", None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
        found = [getattr(model, a, None) for a in ("cls_token", "dist_token", "reg_token")]
        if not any(isinstance(t, torch.Tensor) for t in found):
            return None
        return sum(int(t.shape[1]) for t in found if isinstance(t, torch.Tensor) and t.dim() == 3)

    def prefix_parts(self, model: nn.Module) -> tuple[bool, bool, int]:
        cls = isinstance(getattr(model, "cls_token", None), torch.Tensor)
        dist = isinstance(getattr(model, "dist_token", None), torch.Tensor)
        reg = getattr(model, "reg_token", None)
        registers = int(reg.shape[1]) if isinstance(reg, torch.Tensor) and reg.dim() == 3 else \
            int(getattr(model, "num_reg_tokens", 0) or 0)
        return cls, dist, registers

    def declared_grid(self, model: nn.Module) -> tuple[int, int] | None:
        grid = getattr(model.patch_embed, "grid_size", None)
        return (int(grid[0]), int(grid[1])) if grid is not None else None

    def image_size(self, model: nn.Module, name: str, input_size: Sequence[int] | None) -> tuple[int, int]:
        built = getattr(model.patch_embed, "img_size", None)
        if built is not None and not getattr(model, "dynamic_img_size", False):
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
        return bool(getattr(model, "dynamic_img_size", False))

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x)

    def position_rows(self, model: nn.Module) -> torch.Tensor | None:
        pos = getattr(model, "pos_embed", None)
        return pos if isinstance(pos, torch.Tensor) and pos.dim() == 3 else None

    def embed_dim(self, model: nn.Module) -> int:
        return int(getattr(model, "embed_dim", self.patch_embedding(model).out_channels))

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


# ------------------------------------------------------------------------------------------------ Hugging Face


#: ``name``: where a transformers model's list of layers may be, most usual first
_HF_LAYER_LISTS = ("encoder.layer", "encoder.layers", "model.layer", "model.layers", "transformer.layers", "layer",
                   "layers", "encoder.blocks", "blocks")


def _hf_tower(model: nn.Module) -> nn.Module:
    """The module with the vision embeddings: the model itself, or its ``vision_model`` / ``vit`` (``hf.vision_tower``),
    or its base model (a classifier's ``beit``, ``data2vec_vision``: ``PreTrainedModel.base_model``), or the ``model``
    it wraps (Kosmos-2's vision model)."""
    from .common.hf import vision_tower

    tower = vision_tower(model)
    for attr in ("base_model", "model"):
        if hasattr(tower, "embeddings"):
            break
        inner = getattr(tower, attr, None)
        if isinstance(inner, nn.Module) and inner is not tower and hasattr(inner, "embeddings"):
            tower = inner
    return tower


def _hf_patches(tower: nn.Module) -> nn.Module | None:
    """A transformers tower's patch embedding: the one convolution in ``embeddings`` whose kernel is its stride (a
    hybrid's projection after its CNN stem), or, for a tower without ``embeddings``, its ``patch_embedding`` that is
    a linear layer over unfolded patches (Llama 4's ``Llama4UnfoldConvolution``); None otherwise."""
    emb = getattr(tower, "embeddings", None)
    if not isinstance(emb, nn.Module):
        flat = getattr(tower, "patch_embed", None)  # Qwen3-VL's Conv3d over flattened temporal patches
        read = patch_embedding(flat) if isinstance(flat, nn.Module) else None
        if read is not None and read.kind == "conv3d" and read.one_pixel_per_token:
            return flat
        conv = getattr(tower, "patch_conv", None)  # Pixtral's
        if isinstance(conv, nn.Conv2d) and tuple(conv.kernel_size) == tuple(conv.stride) and conv.groups == 1:
            return conv
        found = getattr(tower, "patch_embedding", None)
        read = patch_embedding(found) if isinstance(found, nn.Module) else None
        return found if read is not None and read.kind == "linear" else None
    stem, projection = getattr(emb, "backbone", None), getattr(emb, "projection", None)
    if isinstance(stem, nn.Module) and isinstance(projection, nn.Conv2d):  # a hybrid (DPT-hybrid's BiT stem)
        convs = [projection]
    else:
        convs = [m for m in emb.modules() if isinstance(m, nn.Conv2d)]
    if len(convs) != 1 or tuple(convs[0].kernel_size) != tuple(convs[0].stride) or convs[0].groups != 1:
        return None
    return convs[0]


def _hf_parts(model: nn.Module) -> tuple[nn.Module, nn.Module, Sequence[nn.Module], list[nn.Module]] | None:
    """(vision tower, patch embedding, layers, each layer's attention module) of a transformers vision model, or
    None when it does not have that shape: one patch embedding (``_hf_patches``), one list of ``num_hidden_layers``
    layers of one class, each with exactly one direct child whose class name has "Attention"."""
    tower = _hf_tower(model)
    cfg = getattr(tower, "config", None)
    patches = _hf_patches(tower) if cfg is not None else None
    if patches is None:
        return None
    depth = getattr(cfg, "num_hidden_layers", None)
    modules = dict(tower.named_modules())
    layers = next((modules[n] for n in _HF_LAYER_LISTS if isinstance(modules.get(n), nn.ModuleList)
                   and len(modules[n]) == depth and depth), None)
    if layers is None or len({type(layer) for layer in layers}) != 1:
        return None
    attns = []
    for layer in layers:
        found = [child for child in layer.children() if "Attention" in type(child).__name__]
        if len(found) != 1:
            return None
        attns.append(found[0])
    return tower, patches, layers, attns


def _hf_inputs(model: nn.Module, x: torch.Tensor, fn: Any) -> dict[str, Any]:
    """The keyword inputs of a preprocessed batch for a transformers model the layout reads: the pixels, and
    ``interpolate_pos_encoding`` at another size where ``fn`` takes it (``common.hf.resize_inputs``)."""
    from .common.hf import resize_inputs

    return {"pixel_values": x, **resize_inputs(model, x, fn)}


class HuggingFaceLayout(Layout):
    """A transformers vision model the ``hf-vit`` family does not name (DINOv3, AIMv2, Data2Vec-Vision, BEiT, ...),
    read at its attention modules' one ``scaled_dot_product_attention`` call (``attn_implementation="sdpa"``)."""

    name = "Hugging Face"
    fused_hint = ("load it with attn_implementation='sdpa' (vitlens's hf: names do), the implementation whose "
                  "scaled_dot_product_attention call the generic capture reads")

    def matches(self, model: nn.Module) -> bool:
        from .common.hf import is_hf_model

        return is_hf_model(model) and _hf_parts(model) is not None

    def _parts(self, model: nn.Module) -> tuple[nn.Module, nn.Module, Sequence[nn.Module], list[nn.Module]]:
        parts = _hf_parts(model)
        if parts is None:
            raise UnsupportedModelError(f"{type(model).__name__} no longer has the layout the generic capture read.")
        return parts

    def check(self, model: nn.Module, name: str) -> None:
        tower = self._parts(model)[0]
        impl = getattr(tower.config, "_attn_implementation", None)
        eager_only = not getattr(type(model), "_supports_sdpa", True)  # BLIP, GIT: read at their one softmax
        if impl != "sdpa" and not eager_only:
            raise UnsupportedModelError(
                f"{name!r} is a Hugging Face {type(model).__name__} running attn_implementation={impl!r}; vitlens reads "
                "this model at its scaled_dot_product_attention calls (generic call-level capture): "
                f"{self.fused_hint}.")
        if float(getattr(tower.config, "mask_ratio", 0) or 0):
            raise UnsupportedModelError(f"{name!r} drops a random share of its patches (mask_ratio), so its maps "
                                        "would be of a random subset of the image.")

    def patch_conv(self, model: nn.Module) -> nn.Module:
        return self._parts(model)[1]

    def _embeddings(self, model: nn.Module) -> nn.Module:
        """Where the tower keeps its embeddings' tokens and tables: its ``embeddings``, else the tower itself
        (Llama 4 keeps ``class_embedding`` and ``patch_embedding`` on the vision model)."""
        tower = self._parts(model)[0]
        emb = getattr(tower, "embeddings", None)
        return emb if isinstance(emb, nn.Module) else tower

    def _class_last(self, model: nn.Module) -> bool:
        """A class token after the patches: Llama 4's vision model (``class_embedding`` on a tower without
        ``embeddings``, concatenated after the patch tokens; ``verify_patch_order`` checks the cells' places)."""
        tower = self._parts(model)[0]
        return not isinstance(getattr(tower, "embeddings", None), nn.Module) and \
            isinstance(getattr(tower, "class_embedding", None), torch.Tensor)

    def packs(self, model: nn.Module) -> bool:
        """Pixtral's vision model: no ``embeddings``, a ``patch_conv`` and a forward taking ``image_sizes``, whose
        images are packed in one sequence with a block-diagonal mask."""
        import inspect

        tower = self._parts(model)[0]
        return not isinstance(getattr(tower, "embeddings", None), nn.Module) and \
            isinstance(getattr(tower, "patch_conv", None), nn.Conv2d) and \
            "image_sizes" in inspect.signature(tower.forward).parameters

    def _merge(self, model: nn.Module) -> int:
        """Qwen3-VL's vision model (a Conv3d patch embedding fed flattened patches, a ``spatial_merge_size``): the
        merge size (its tokens in merge x merge block order, attended image by image); 0 for any other tower."""
        tower = self._parts(model)[0]
        pe = patch_embedding(self._parts(model)[1])
        merge = getattr(tower, "spatial_merge_size", None)
        return int(merge) if pe is not None and pe.kind == "conv3d" and isinstance(merge, int) else 0

    def calls_per_image(self, model: nn.Module) -> bool:
        return self._merge(model) > 0

    def _flat_inputs(self, model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """A batch [B, C, H, W] as Qwen3-VL's processor hands it: each image's patches flattened (channel, temporal
        frame, row, column), the image repeated over the temporal patch, in merge x merge block order, images in
        order; ``grid_thw`` one (1, rows, columns) per image."""
        tower, merge = self._parts(model)[0], self._merge(model)
        pe = patch_embedding(self._parts(model)[1])
        b, c, h, w = x.shape
        p, t = pe.kernel[0], int(tower.patch_embed.temporal_patch_size)
        gh, gw = h // p, w // p
        if h % (p * merge) or w % (p * merge):
            raise UnsupportedModelError(f"{type(tower).__name__} takes images whose sides are multiples of "
                                        f"{p * merge} px (patch {p} x merge {merge}); got {h}x{w}.")
        patches = x.reshape(b, c, gh // merge, merge, p, gw // merge, merge, p).permute(0, 2, 5, 3, 6, 1, 4, 7)
        flat = patches.unsqueeze(6).expand(-1, -1, -1, -1, -1, -1, t, -1, -1).reshape(b * gh * gw, c * t * p * p)
        grid = torch.tensor([[1, gh, gw]] * b, device=x.device)
        return {"hidden_states": flat, "grid_thw": grid}

    def packed_forward(self, model: nn.Module, images: Sequence[torch.Tensor]) -> Any:
        """The images padded (zeros) to the largest height and width, with their sizes: Pixtral cuts each image's own
        patches from the padded batch (``image_sizes``)."""
        tower = self._parts(model)[0]
        h, w = max(int(i.shape[-2]) for i in images), max(int(i.shape[-1]) for i in images)
        x = images[0].new_zeros(len(images), int(images[0].shape[0]), h, w)
        for b, img in enumerate(images):
            x[b, :, :img.shape[-2], :img.shape[-1]] = img
        sizes = [(int(i.shape[-2]), int(i.shape[-1])) for i in images]
        return tower(pixel_values=x, image_sizes=sizes)

    def stem(self, model: nn.Module) -> nn.Module | None:
        stem = getattr(self._embeddings(model), "backbone", None)
        return stem if isinstance(stem, nn.Module) else None

    def attention_modules(self, model: nn.Module) -> Sequence[nn.Module]:
        return self._parts(model)[3]

    def prefix_parts(self, model: nn.Module) -> tuple[bool, bool, int]:
        emb = self._embeddings(model)
        cls = any(isinstance(getattr(emb, a, None), torch.Tensor) for a in ("cls_token", "class_embedding"))
        dist = isinstance(getattr(emb, "distillation_token", None), torch.Tensor)
        reg = getattr(emb, "register_tokens", None)
        registers = int(reg.shape[1]) if isinstance(reg, torch.Tensor) and reg.dim() == 3 else 0
        return cls, dist, registers

    def declared_prefix(self, model: nn.Module) -> int | None:
        cls, dist, registers = self.prefix_parts(model)
        return int(cls) + int(dist) + registers + self._detection(model)  # none declared is 0

    def _detection(self, model: nn.Module) -> int:
        det = getattr(self._embeddings(model), "detection_tokens", None)  # YOLOS: after the patches
        return int(det.shape[1]) if isinstance(det, torch.Tensor) and det.dim() == 3 else 0

    def token_layout(self, model: nn.Module, grid: tuple[int, int]) -> TokenLayout | None:
        if self._class_last(model):
            return standard_layout(grid, ("class",), prefix_last=True)
        if self._merge(model):
            return merge_block_layout(grid, self._merge(model))
        n = self._detection(model)
        if not n:
            return None
        cls, dist, registers = self.prefix_parts(model)
        names = ("class",) * int(cls) + ("distillation",) * int(dist) + ("register",) * registers
        front = standard_layout(grid, names)
        return TokenLayout(front.tokens + (PrefixToken("detection"),) * n, front.grids)

    def _built_size(self, model: nn.Module) -> tuple[int, int]:
        from .common.hf import config_image_size
        from .common.windows import pair

        return pair(config_image_size(self._parts(model)[0].config))

    def declared_grid(self, model: nn.Module) -> tuple[int, int] | None:
        from .common.windows import pair

        if self._merge(model):
            return None  # (any size: its position table is resampled to each image's grid)
        size, patch = self._built_size(model), pair(self._parts(model)[0].config.patch_size)
        return size[0] // patch[0], size[1] // patch[1]

    def image_size(self, model: nn.Module, name: str, input_size: Sequence[int] | None) -> tuple[int, int]:
        if self._merge(model):  # Qwen3-VL: the size given, else its square position table's
            if input_size is not None:
                return int(input_size[0]), int(input_size[1])
            side = math.isqrt(int(self._parts(model)[0].config.num_position_embeddings))
            return side * self.patch_embedding(model).stride[0], side * self.patch_embedding(model).stride[1]
        built = self._built_size(model)
        refuse_other_size(name, "generic (Hugging Face layout)", built, input_size)
        return built

    def tower(self, model: nn.Module) -> nn.Module:
        return self._parts(model)[0]

    def forward(self, model: nn.Module, x: torch.Tensor) -> Any:
        tower = self._parts(model)[0]
        if self._merge(model):
            return tower(**self._flat_inputs(model, x))
        return tower(**_hf_inputs(tower, x, tower.forward))

    def dynamic(self, model: nn.Module) -> bool:
        return self._merge(model) > 0

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a classifier; else the image embedding: ``get_image_features`` of a contrastive image-text
        model (one with a ``logit_scale``: AIMv2, CLIP-like; its projected embedding), else the tower's own output (a
        VLM's image features feed its language model and may need other inputs: Idefics3 takes images per sample,
        InstructBLIP a Q-Former prompt), read as the pooled output, a backbone's last feature map, or the class token
        (the mean token without one)."""
        if self._merge(model):  # Qwen3-VL: its merged tokens, image by image, averaged
            out = self.forward(model, x).pooler_output
            return out.reshape(x.shape[0], -1, out.shape[-1]).mean(1)
        classifier = "ForImageClassification" in type(model).__name__
        if not classifier and hasattr(model, "get_image_features") and hasattr(model, "logit_scale"):
            out = model.get_image_features(**_hf_inputs(model, x, model.get_image_features))
            return out if isinstance(out, torch.Tensor) else out.pooler_output
        target = model if classifier else self._parts(model)[0]
        out = target(**_hf_inputs(target, x, target.forward))
        if getattr(out, "logits", None) is not None:
            return out.logits
        if getattr(out, "pooler_output", None) is not None:
            return out.pooler_output
        if getattr(out, "feature_maps", None):  # a backbone (VitPose's): its last feature map
            return out.feature_maps[-1]
        hidden = out.last_hidden_state
        if self.packs(model) and hidden.shape[0] == 1 and x.shape[0] > 1:  # one packed sequence: each image's mean
            return hidden.reshape(x.shape[0], -1, hidden.shape[-1]).mean(1)
        first = self.prefix_parts(model)[0] and not self._class_last(model)  # (Llama 4 drops its last class token)
        return hidden[:, 0] if first else hidden.mean(1)

    def position_rows(self, model: nn.Module) -> torch.Tensor | None:
        emb = self._embeddings(model)
        table = getattr(emb, "position_embeddings", None)
        if isinstance(table, torch.Tensor) and table.dim() == 3:
            return table
        table = getattr(emb, "position_embedding", None)
        return table.weight.unsqueeze(0) if isinstance(table, nn.Embedding) else None

    def embed_dim(self, model: nn.Module) -> int:
        return int(self._parts(model)[0].config.hidden_size)

    def num_classes(self, model: nn.Module) -> int:
        return int(model.config.num_labels) if "ForImageClassification" in type(model).__name__ else 0

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        from .common.hf import (IMAGENET_MEAN, IMAGENET_STD, ProcessorDefaults, data_config_of, processor_defaults,
                                tower_type)

        defaults = processor_defaults(tower_type(model)) or ProcessorDefaults("center", 224 / 256, IMAGENET_MEAN,
                                                                              IMAGENET_STD, "bicubic")
        return data_config_of(model, spec, defaults, self.patch_embedding(model).in_channels)

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles, name: str) -> None:
        """An attention-pooling head: a learned probe through one ``nn.MultiheadAttention`` (Phi-4-multimodal's
        head, SigLIP's kind), read from that module's own in-projection (``common.mha.install_probe_pool``); else
        one SDPA call of its queries over the tokens (AIMv2's ``head``), read at that call."""
        from .common.mha import install_probe_pool, probe_attention
        from .common.sdpa_calls import install_pool_call_capture

        tower = self._parts(model)[0]
        head = getattr(tower, "head", None)
        if not isinstance(head, nn.Module) or not getattr(tower, "use_head", True) or \
                "Pool" not in type(head).__name__:
            return super().install_pool(model, capture, handles, name)
        mha = probe_attention(head)
        if mha is not None:
            return install_probe_pool(mha, capture, handles)
        install_pool_call_capture(head, capture, handles, name)


# ---------------------------------------------------------------------------------------------------- OpenCLIP


class OpenClipLayout(Layout):
    """open_clip's own ``VisionTransformer`` whose blocks are ``CustomResidualAttentionBlock`` (open_clip's
    ``Attention``): ``conv1``, a class token, ``transformer.resblocks[i].attn``."""

    name = "OpenCLIP"
    fused_hint = "keep open_clip's fused path (Attention.use_fsdpa=True, its default)"

    @staticmethod
    def _visual(model: nn.Module) -> nn.Module:
        from .common.openclip import visual_of

        return visual_of(model)

    def matches(self, model: nn.Module) -> bool:
        from .common.openclip import is_open_clip

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

    def declared_grid(self, model: nn.Module) -> tuple[int, int] | None:
        grid = self._visual(model).grid_size
        return int(grid[0]), int(grid[1])

    def image_size(self, model: nn.Module, name: str, input_size: Sequence[int] | None) -> tuple[int, int]:
        built = tuple(int(s) for s in self._visual(model).image_size)
        refuse_other_size(name, "OpenCLIP", built, input_size)
        return built[0], built[1]

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        from .common.openclip import encode_image

        return encode_image(model, x)

    def position_rows(self, model: nn.Module) -> torch.Tensor | None:
        from .common.openclip import is_sincos

        visual = self._visual(model)
        if is_sincos(visual, self.declared_grid(model)):
            return None  # a fixed 2-D sin-cos table, not a learned one
        return visual.positional_embedding.unsqueeze(0)

    def embed_dim(self, model: nn.Module) -> int:
        return int(self._visual(model).transformer.width)

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        from .common.openclip import open_clip_data_config

        return open_clip_data_config(model, spec)

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles, name: str) -> None:
        from .common.openclip import install_attentional_pool

        install_attentional_pool(model, capture, handles)


register_layout(TimmLayout())
register_layout(HuggingFaceLayout())
register_layout(OpenClipLayout())


__all__ = ["LAYOUTS", "HuggingFaceLayout", "Layout", "OpenClipLayout", "TimmLayout", "layout_of", "register_layout"]
