"""The generic capture's Hugging Face layout (``vitlens.families.common.layouts``' ``Layout``): a transformers
vision model the ``hf-vit`` family does not name, read at its attention modules' one
``scaled_dot_product_attention`` call
(``attn_implementation="sdpa"``) or, eager-only, at their one softmax.

Its patch embedding is one convolution in ``embeddings``, or a tower's own: Pixtral's ``patch_conv`` (images packed
in one sequence with a block-diagonal mask), Llama 4's ``patch_embedding`` (a linear layer over unfolded patches, its
class token after them), Qwen3-VL's ``patch_embed`` (a Conv3d over flattened temporal patches, its tokens in 2x2
merge-block order, one attention call per image), Gemma 4's ``patch_embedder`` (a linear layer over patches flattened
(row, column, channel), fed with their positions), Molmo2's and Pix2Struct's linear layer over flattened patches
(``common.flat_patches``); ``common.patches`` reads each as a convolution of the pixels. A tower whose blocks call an
``nn.MultiheadAttention`` (BridgeTower's, in its ``visual``, sequence-first) is read from that module's in-projection
(``common.mha``).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch import nn

from ...core.spec import ModelSpec
from ...core.tokens import PrefixToken, TokenLayout, merge_block_layout, standard_layout
from ...errors import UnsupportedModelError
from ..base import CaptureRequest, Handles, refuse_other_size
from .patches import PatchEmbedding, flat_temporal_patches, patch_embedding
from .flat_patches import FlatPatches, flat_patches, flatten_patches
from .packed_towers import (declares_packing, patch_stack, refuse_inputs_it_cannot_know, run_stack, stack_inputs,
                            stack_proj, takes)
from .layouts import Layout, register_layout
from .sdpa_calls import install_pool_call_capture
from .mha import install_probe_pool, probe_attention
from .hf import (IMAGENET_MEAN, IMAGENET_STD, ProcessorDefaults, config_image_size, data_config_of, is_hf_model,
                        processor_defaults, resize_inputs, tower_type, vision_tower)
from .windows import pair


#: ``name``: where a transformers model's list of layers may be, most usual first
_HF_LAYER_LISTS = ("encoder.layer", "encoder.layers", "model.layer", "model.layers", "transformer.layers", "layer",
                   "layers", "encoder.blocks", "blocks", "visual.transformer.resblocks")


def _hf_embeddings(tower: nn.Module) -> nn.Module | None:
    """The tower's ``embeddings``, or those of the CLIP-style transformer it keeps as ``visual`` (BridgeTower's
    vision model); None for a tower without (Pixtral, Llama 4, Qwen3-VL, Gemma 4 keep their patch embedding on the
    tower)."""
    for holder in (tower, getattr(tower, "visual", None)):
        emb = getattr(holder, "embeddings", None)
        if isinstance(emb, nn.Module):
            return emb
    return None


def _image_argument(fn: Any) -> str:
    """The name under which ``fn`` (a tower's forward) takes the image: ``pixel_values``, else its first parameter
    (BridgeTower's ``image``)."""
    import inspect

    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return "pixel_values"
    return "pixel_values" if "pixel_values" in params or not params else params[0]


def _hf_tower(model: nn.Module) -> nn.Module:
    """The module with the vision embeddings: the model itself, or its ``vision_model`` / ``vit`` (``hf.vision_tower``),
    or its base model (a classifier's ``beit``, ``data2vec_vision``: ``PreTrainedModel.base_model``), or the ``model``
    it wraps (Kosmos-2's vision model)."""
    tower = vision_tower(model)
    for attr in ("base_model", "model"):
        if _hf_embeddings(tower) is not None:
            break
        inner = getattr(tower, attr, None)
        if isinstance(inner, nn.Module) and inner is not tower and _hf_embeddings(inner) is not None:
            tower = inner
    return tower


def _hf_patches(tower: nn.Module) -> nn.Module | None:
    """A transformers tower's patch embedding: the one convolution in ``embeddings`` whose kernel is its stride (a
    hybrid's projection after its CNN stem), or, for a tower without ``embeddings``, its ``patch_embedding`` that is
    a linear layer over unfolded patches (Llama 4's ``Llama4UnfoldConvolution``); None otherwise."""
    flat = flat_patches(tower)  # Molmo2's, Pix2Struct's linear layer over flattened patches
    if flat is not None:
        return flat.linear
    packed = patch_stack(tower)  # patches [N, C, p, p] with grid_thw (Kimi K2.5's MoonViT)
    if packed is not None:
        return packed
    packed = getattr(tower, "patch_embed", None)  # a packed tower (forward with grid_thw) declares its patch layout
    read = patch_embedding(packed) if isinstance(packed, nn.Module) and takes(tower, "grid_thw") else None
    if read is not None and read.kind == "conv3d" and read.one_pixel_per_token:  # (GLM-4.1V's, beside embeddings)
        return packed
    emb = _hf_embeddings(tower)
    if emb is None:
        embedder = getattr(tower, "patch_embedder", None)  # Gemma 4's linear layer over flattened patches
        read = patch_embedding(embedder) if isinstance(embedder, nn.Module) else None
        if read is not None and read.kind == "linear" and read.channels_last:
            return embedder
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
    layers = next((modules[n] for n in _HF_LAYER_LISTS  # (MGP-STR's blocks are an nn.Sequential)
                   if isinstance(modules.get(n), (nn.ModuleList, nn.Sequential))
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


#: the side a tower with no position table and no stated size is read at (rounded up to whole merge blocks)
_DEFAULT_SIDE_PX = 224


def _hf_inputs(model: nn.Module, x: torch.Tensor, fn: Any) -> dict[str, Any]:
    """The keyword inputs of a preprocessed batch for a transformers model the layout reads: the pixels, and
    ``interpolate_pos_encoding`` at another size where ``fn`` takes it (``common.hf.resize_inputs``)."""
    return {_image_argument(fn): x, **resize_inputs(model, x, fn)}


class HuggingFaceLayout(Layout):
    """A transformers vision model the ``hf-vit`` family does not name (DINOv3, AIMv2, Data2Vec-Vision, BEiT, ...),
    read at its attention modules' one ``scaled_dot_product_attention`` call (``attn_implementation="sdpa"``)."""

    name = "Hugging Face"
    fused_hint = ("load it with attn_implementation='sdpa' (vitlens's hf: names do), the implementation whose "
                  "scaled_dot_product_attention call the generic capture reads")

    def matches(self, model: nn.Module) -> bool:
        """A transformers model of this shape, or a packed tower of any library that declares its packing
        (``declares_packing``: a user's own tower with ``grid_thw``)."""
        return (is_hf_model(model) or declares_packing(model)) and _hf_parts(model) is not None

    def _parts(self, model: nn.Module) -> tuple[nn.Module, nn.Module, Sequence[nn.Module], list[nn.Module]]:
        parts = _hf_parts(model)
        if parts is None:
            raise UnsupportedModelError(f"{type(model).__name__} no longer has the layout the generic capture read.")
        return parts

    def check(self, model: nn.Module, name: str) -> None:
        tower = self._parts(model)[0]
        impl = getattr(tower.config, "_attn_implementation", None)
        eager_only = not getattr(type(model), "_supports_sdpa", True)  # BLIP, GIT: read at their one softmax
        if impl != "sdpa" and not eager_only and is_hf_model(model):  # (a tower of its own has no such switch)
            raise UnsupportedModelError(
                f"{name!r} is a Hugging Face {type(model).__name__} running attn_implementation={impl!r}; vitlens "
                "reads this model at its scaled_dot_product_attention calls (generic call-level capture): "
                f"{self.fused_hint}.")
        if float(getattr(tower.config, "mask_ratio", 0) or 0):
            raise UnsupportedModelError(f"{name!r} drops a random share of its patches (mask_ratio), so its maps "
                                        "would be of a random subset of the image.")
        refuse_inputs_it_cannot_know(tower, name, bool(self._merge(model) or self._positioned(model)))

    def patch_conv(self, model: nn.Module) -> nn.Module:
        return self._parts(model)[1]

    def _flat(self, model: nn.Module) -> FlatPatches | None:
        """A tower fed flattened patches through one linear layer (Molmo2, Pix2Struct: ``common.flat_patches``)."""
        return flat_patches(self._parts(model)[0])

    def patch_embedding(self, model: nn.Module) -> PatchEmbedding:
        flat = self._flat(model)
        if flat is not None:
            return flat.embedding()
        stack = patch_stack(self._parts(model)[0])
        if stack is not None:  # the convolution, its tokens counted per image by the calls (its output is [N, D])
            proj = stack_proj(stack)
            assert isinstance(proj, nn.Conv2d)
            return PatchEmbedding(stack, proj, int(proj.in_channels), int(proj.out_channels), pair(proj.kernel_size),
                                  pair(proj.stride), (0, 0), "conv2d")
        return super().patch_embedding(model)

    def _embeddings(self, model: nn.Module) -> nn.Module:
        """Where the tower keeps its embeddings' tokens and tables: its ``embeddings``, else the tower itself
        (Llama 4 keeps ``class_embedding`` and ``patch_embedding`` on the vision model)."""
        tower = self._parts(model)[0]
        emb = _hf_embeddings(tower)
        return emb if emb is not None else tower

    def _class_last(self, model: nn.Module) -> bool:
        """A class token after the patches: Llama 4's vision model (``class_embedding`` on a tower without
        ``embeddings``, concatenated after the patch tokens; ``verify_patch_order`` checks the cells' places)."""
        tower = self._parts(model)[0]
        return _hf_embeddings(tower) is None and isinstance(getattr(tower, "class_embedding", None), torch.Tensor)

    def packs(self, model: nn.Module) -> bool:
        """Pixtral's vision model: no ``embeddings``, a ``patch_conv`` and a forward taking ``image_sizes``, whose
        images are packed in one sequence with a block-diagonal mask."""
        import inspect

        tower = self._parts(model)[0]
        return _hf_embeddings(tower) is None and isinstance(getattr(tower, "patch_conv", None), nn.Conv2d) and \
            "image_sizes" in inspect.signature(tower.forward).parameters

    def _merge(self, model: nn.Module) -> int:
        """Qwen3-VL's vision model (a Conv3d patch embedding fed flattened patches, a ``spatial_merge_size``): the
        merge size (its tokens in merge x merge block order, attended image by image); 0 for any other tower."""
        tower = self._parts(model)[0]
        if patch_stack(tower) is not None:
            return 1  # (MoonViT: its tokens row-major, its position ids of merge size 1)
        pe = patch_embedding(self._parts(model)[1])
        merge = getattr(tower, "spatial_merge_size", None)
        return int(merge) if pe is not None and pe.kind == "conv3d" and isinstance(merge, int) else 0

    def calls_per_image(self, model: nn.Module) -> bool:
        return self._merge(model) > 0

    def _positioned(self, model: nn.Module) -> bool:
        """Gemma 4's vision model: patches flattened (row, column, channel) with their (x, y) positions as input."""
        pe = patch_embedding(self._parts(model)[1])
        return pe is not None and pe.channels_last and self._flat(model) is None

    def _positioned_inputs(self, model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """A batch [B, C, H, W] as Gemma 4's processor hands it: each image's patches row-major, each flattened (row,
        column, channel), and their (x, y) = (column, row) positions; no padding."""
        pe = self.patch_embedding(model)
        b = x.shape[0]
        pixels, gh, gw = flatten_patches(x, pe.kernel[0], type(model).__name__)
        rows, cols = torch.meshgrid(torch.arange(gh, device=x.device), torch.arange(gw, device=x.device),
                                    indexing="ij")
        positions = torch.stack([cols.flatten(), rows.flatten()], -1).expand(b, -1, -1)
        return {"pixel_values": pixels, "pixel_position_ids": positions}

    def _flat_inputs(self, model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """A batch [B, C, H, W] as Qwen3-VL's processor hands it: each image's patches flattened (channel, temporal
        frame, row, column), the image repeated over the temporal patch, in merge x merge block order, images in
        order; ``grid_thw`` one (1, rows, columns) per image."""
        tower, merge = self._parts(model)[0], self._merge(model)
        pe = self.patch_embedding(model)
        h, w = x.shape[-2:]
        if patch_stack(tower) is not None:
            return stack_inputs(tower, x, pe.kernel[0])
        p, t = pe.kernel[0], int(tower.patch_embed.temporal_patch_size)
        if h % (p * merge) or w % (p * merge):
            raise UnsupportedModelError(f"{type(tower).__name__} takes images whose sides are multiples of "
                                        f"{p * merge} px (patch {p} x merge {merge}); got {h}x{w}.")
        flat, grid = flat_temporal_patches(x, p, t, merge)
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

    def _stated_counts(self, model: nn.Module) -> tuple[int, int]:
        """(class tokens, register tokens) as the config states them (Pixio's ``n_cls_tokens``, DINOv3's
        ``num_register_tokens``), else as the embedding's tensors hold them (a ``cls_token`` of shape [1, n, C] is n
        class tokens); ``spec`` checks their sum against the tokens the model makes."""
        cls, _dist, registers = self.prefix_parts(model)
        cfg = self._parts(model)[0].config
        token = getattr(self._embeddings(model), "cls_token", None)
        classes = int(token.shape[1]) if cls and isinstance(token, torch.Tensor) and token.dim() == 3 else int(cls)
        for names, count in ((("n_cls_tokens", "num_cls_tokens", "num_class_tokens"), "classes"),
                             (("num_register_tokens", "n_register_tokens", "num_registers"), "registers")):
            stated = next((getattr(cfg, n) for n in names if isinstance(getattr(cfg, n, None), int)), None)
            if stated is not None and count == "classes":
                classes = int(stated)
            elif stated is not None:
                registers = int(stated)
        return classes, registers

    def declared_prefix(self, model: nn.Module) -> int | None:
        _cls, dist, _registers = self.prefix_parts(model)
        classes, registers = self._stated_counts(model)
        return classes + int(dist) + registers + self._detection(model)  # none declared is 0

    def _detection(self, model: nn.Module) -> int:
        det = getattr(self._embeddings(model), "detection_tokens", None)  # YOLOS: after the patches
        return int(det.shape[1]) if isinstance(det, torch.Tensor) and det.dim() == 3 else 0

    def token_layout(self, model: nn.Module, grid: tuple[int, int]) -> TokenLayout | None:
        if self._class_last(model):
            return standard_layout(grid, ("class",), prefix_last=True)
        if self._merge(model):
            return merge_block_layout(grid, self._merge(model))
        n = self._detection(model)
        classes, stated_registers = self._stated_counts(model)
        if not n and classes > 1:  # several class tokens (Pixio's n_cls_tokens), then the registers, then the patches
            _cls, dist, _registers = self.prefix_parts(model)
            return standard_layout(grid, ("class",) * classes + ("distillation",) * int(dist)
                                   + ("register",) * stated_registers)
        if not n:
            return None
        cls, dist, registers = self.prefix_parts(model)
        names = ("class",) * int(cls) + ("distillation",) * int(dist) + ("register",) * registers
        front = standard_layout(grid, names)
        return TokenLayout(front.tokens + (PrefixToken("detection"),) * n, front.grids)

    def _built_size(self, model: nn.Module) -> tuple[int, int]:
        return pair(config_image_size(self._parts(model)[0].config))

    def declared_grid(self, model: nn.Module) -> tuple[int, int] | None:
        flat = self._flat(model)
        if self._merge(model) or self._positioned(model) or (flat is not None and flat.ids):
            return None  # (any size: its positions are given with its patches)
        size, patch = self._built_size(model), pair(self._parts(model)[0].config.patch_size)
        return size[0] // patch[0], size[1] // patch[1]

    def image_size(self, model: nn.Module, name: str, input_size: Sequence[int] | None) -> tuple[int, int]:
        if self._positioned(model):  # Gemma 4: the size given, else 48 patches a side (timm's gemma4_vit_* size)
            stride = self.patch_embedding(model).stride
            return (int(input_size[0]), int(input_size[1])) if input_size is not None else (48 * stride[0],
                                                                                              48 * stride[1])
        if self._merge(model):  # Qwen3-VL: the size given, else its square position table's
            if input_size is not None:
                return int(input_size[0]), int(input_size[1])
            stride = self.patch_embedding(model).stride
            table = getattr(self._parts(model)[0].config, "num_position_embeddings", None)
            if table is None:  # Qwen2-VL, GLM-4.1V: 2-D RoPE, any size: the config's, else the default side,
                block = self._merge(model)  # in whole merge blocks
                stated = getattr(self._parts(model)[0].config, "image_size", None)
                px = int(stated) if isinstance(stated, int) and not isinstance(stated, bool) else _DEFAULT_SIDE_PX
                side = -(-px // (stride[0] * block)) * block
            else:
                side = math.isqrt(int(table))
            return side * stride[0], side * stride[1]
        if self.packs(model) and input_size is not None:  # Pixtral: 2-D RoPE from each patch's (row, column), no table
            return int(input_size[0]), int(input_size[1])
        flat = self._flat(model)
        if flat is not None and flat.ids:  # Pix2Struct: any size it has row and column ids for
            size = (int(input_size[0]), int(input_size[1])) if input_size is not None else \
                (-(-_DEFAULT_SIDE_PX // flat.patch) * flat.patch,) * 2
            most = flat.max_side(self._parts(model)[0])
            if most is not None and max(size) // flat.patch > most:
                raise UnsupportedModelError(
                    f"{name!r} has row and column ids for at most {most} patches a side ({most * flat.patch} px); got "
                    f"{size[0]}x{size[1]} px.")
            return size
        built = self._built_size(model)
        refuse_other_size(name, "generic (Hugging Face layout)", built, input_size)
        return built

    def tower(self, model: nn.Module) -> nn.Module:
        return self._parts(model)[0]

    def forward(self, model: nn.Module, x: torch.Tensor) -> Any:
        tower = self._parts(model)[0]
        if patch_stack(tower) is not None:
            return run_stack(tower, self._flat_inputs(model, x))
        if self._merge(model):
            return tower(**self._flat_inputs(model, x))
        if self._positioned(model):
            return tower(**self._positioned_inputs(model, x))
        flat = self._flat(model)
        if flat is not None:
            return tower(**flat.inputs(x))
        if self.packs(model):  # (any size: nothing to resample)
            return tower(pixel_values=x)
        return tower(**_hf_inputs(tower, x, tower.forward))

    def dynamic(self, model: nn.Module) -> bool:
        flat = self._flat(model)
        return self._merge(model) > 0 or self._positioned(model) or (flat is not None and flat.ids) or self.packs(model)

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a classifier; else the image embedding: ``get_image_features`` of a contrastive image-text
        model (one with a ``logit_scale``: AIMv2, CLIP-like; its projected embedding), else the tower's own output (a
        VLM's image features feed its language model and may need other inputs: Idefics3 takes images per sample,
        InstructBLIP a Q-Former prompt), read as the pooled output, a backbone's last feature map, or the class token
        (the mean token without one)."""
        if self._merge(model) or self._positioned(model):  # Qwen3-VL's merged, Gemma 4's pooled tokens, per image
            out = self.forward(model, x)
            pooled = getattr(out, "pooler_output", None) if self._merge(model) else None
            out = pooled if pooled is not None else out.last_hidden_state  # (VideoLLaMA3 has no pooled output)
            return out.reshape(x.shape[0], -1, out.shape[-1]).mean(1)
        if self._flat(model) is not None:  # Molmo2's pooled output, Pix2Struct's mean token
            out = self.forward(model, x)
            pooled = getattr(out, "pooler_output", None)
            return pooled if pooled is not None else out.last_hidden_state.mean(1)
        classifier = "ForImageClassification" in type(model).__name__
        if not classifier and hasattr(model, "get_image_features") and hasattr(model, "logit_scale"):
            out = model.get_image_features(**_hf_inputs(model, x, model.get_image_features))
            return out if isinstance(out, torch.Tensor) else out.pooler_output
        target = model if classifier else self._parts(model)[0]
        out = target(pixel_values=x) if self.packs(model) else target(**_hf_inputs(target, x, target.forward))
        if isinstance(out, torch.Tensor):  # BridgeTower's: every layer's normed tokens [layers, B, T, D], stacked
            out = out[-1] if out.dim() == 4 else out
            return out[:, 0] if self.prefix_parts(model)[0] else out.mean(1)
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
        table = getattr(emb, "positional_embedding", None)  # Molmo2's: one row per patch [N, D]
        if isinstance(table, torch.Tensor) and table.dim() == 2:
            return table.unsqueeze(0)
        table = getattr(emb, "position_embedding", None)
        return table.weight.unsqueeze(0) if isinstance(table, nn.Embedding) else None

    def embed_dim(self, model: nn.Module) -> int:
        return int(self._parts(model)[0].config.hidden_size)

    def num_classes(self, model: nn.Module) -> int:
        return int(model.config.num_labels) if "ForImageClassification" in type(model).__name__ else 0

    def data_config(self, model: nn.Module, spec: ModelSpec) -> dict[str, Any]:
        defaults = processor_defaults(tower_type(model)) or ProcessorDefaults("center", 224 / 256, IMAGENET_MEAN,
                                                                              IMAGENET_STD, "bicubic")
        return data_config_of(model, spec, defaults, self.patch_embedding(model).in_channels)

    def install_pool(self, model: nn.Module, capture: CaptureRequest, handles: Handles, name: str) -> None:
        """An attention-pooling head: a learned probe through one ``nn.MultiheadAttention`` (Phi-4-multimodal's
        head, SigLIP's kind), read from that module's own in-projection (``common.mha.install_probe_pool``); else
        one SDPA call of its queries over the tokens (AIMv2's ``head``), read at that call."""
        tower = self._parts(model)[0]
        head = getattr(tower, "head", None)
        if not isinstance(head, nn.Module) or not getattr(tower, "use_head", True) or \
                "Pool" not in type(head).__name__:
            return super().install_pool(model, capture, handles, name)
        mha = probe_attention(head)
        if mha is not None:
            return install_probe_pool(mha, capture, handles)
        install_pool_call_capture(head, capture, handles, name)


register_layout(HuggingFaceLayout())


__all__ = ["HuggingFaceLayout"]
