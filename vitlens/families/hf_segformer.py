"""Hugging Face transformers SegFormer's encoder, the Mix Transformer (``SegformerModel``,
``SegformerForImageClassification``; ``SegformerForSemanticSegmentation`` is read through its ``segformer``, as
whole models through their tower), read block by block on its stages' grids, as PVT v2 is (``hf-pvt``).

A SegFormer has (usually four) stages; each starts with an overlapping patch embedding, a strided convolution of
the previous stage's tokens (of the image, at the first stage; kernel ``patch_sizes[i]``, stride ``strides[i]``,
padding kernel // 2: 7x7 stride 4, then 3x3 stride 2). Its blocks attend globally with *efficient self-attention*:
the queries are the stage's tokens, the keys and values a strided convolution (``kernel = stride = sr_ratio``, then
a LayerNorm) of them, a coarser grid; at ``sr_ratio == 1`` the keys are the queries' tokens. No class token, no
position table (position comes from the zero padding of the embeddings and of the Mix-FFN's 3x3 depthwise
convolution).

Capture. ``SegformerAttention`` calls the attention function of ``config._attn_implementation`` through
transformers' ``AttentionInterface`` (``common.interface``): side capture runs it as it is (sdpa's one call read
from its very arguments, the real output kept; eager's returned probabilities), the outputs bit for bit those of a
run without capture; inline capture runs transformers' eager implementation for the session (the probabilities the
output is computed from). [B, heads, Nq, Nk], Nq the stage's tokens, Nk the reduced keys.

Geometry (``windows``) and stated transports (rollout): as PVT's. One "window" per block holding all its queries
and keys, kind "pooled" where the keys are reduced, "global" where they are the queries' tokens; a stage's grid is
its embedding convolution's output size, its tokens at (r + 0.5) x the stage's stride (the product of the
embeddings' strides); a key at the mean of the centres of the tokens its reduction covers. The keys' transport is
the reduction's footprint (each key the mean of the tokens its kernel covers); between stages, the stage's
embedding (each embedded token the mean of the previous stage's tokens its kernel covers inside the grid); the
source is the mean over the last stage's tokens (what the classifier averages). Not transported: the Mix-FFN's
depthwise convolution (inside the MLP branch).

Size. SegFormer reads any input size and its config names none: it is read at ``config.image_size`` where set,
else at its image processor's default, 512x512; another size is refused in one line (build the config with
``image_size``).

Refused, in one line: another class of this model type, a layer or attention class other than transformers' own,
a stage without blocks.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.windows import Transport, WindowGeometry, transport_centres
from ..errors import UnsupportedModelError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.blocks import StagedFamily, check_blocks
from .common.hf import (IMAGENET_MEAN, IMAGENET_STD, HfTypes, HuggingFaceFamily, ProcessorDefaults, is_hf_model,
                        is_image_classifier, module_path, tower_type)
from .common.interface import read_eager_returned, read_interface_beside
from .common.windows import pair, pooled_grid, pooling_module_transport, pooling_of, token_centres

#: the model type read, its image processor's defaults (512x512, bilinear), loaded with sdpa (its one call is read)
HF_TYPES = HfTypes(processors={"segformer": ProcessorDefaults("squash", 1.0, IMAGENET_MEAN, IMAGENET_STD, "bilinear")})
#: the model classes read (the semantic-segmentation model is read through its ``segformer``)
MODEL_CLASSES = {"segformer": ("SegformerModel", "SegformerForImageClassification")}
#: the size a config without ``image_size`` is read at (SegformerImageProcessor's default)
DEFAULT_SIZE = (512, 512)


class HuggingFaceSegformer(HuggingFaceFamily, StagedFamily):
    """transformers ``SegformerModel`` / ``SegformerForImageClassification``: efficient attention over keys reduced
    by a strided convolution, read block by block (module docstring)."""

    name = "hf-segformer"
    summary = "Hugging Face SegFormer (Mix Transformer)"
    reads = ("Hugging Face transformers SegFormer's Mix Transformer encoder (SegformerModel, "
             "SegformerForImageClassification; SegformerForSemanticSegmentation through its segformer): efficient "
             "attention over keys reduced by a strided convolution on four stages of overlapping patch embeddings; "
             "distance in image pixels beside the uniform distance over the reduced keys, rollout through the "
             "reductions and the stage embeddings with a stated transport; needs transformers")
    names = ("hf:ORG/NAME or hf:FOLDER of a SegFormer checkpoint, e.g. hf:nvidia/mit-b0, "
             "hf:nvidia/segformer-b0-finetuned-ade-512-512",)
    capture = CaptureAbilities(view_mode="side")  # side leaves the model's own forward (sdpa or eager) as it is
    attention_inputs = ("layernorm_before",)
    hf_types = HF_TYPES
    model_classes = MODEL_CLASSES
    base_attrs = ("segformer",)

    def matches(self, model: nn.Module) -> bool:
        """A SegFormer of a class read here; another (the semantic-segmentation model) is read through its tower."""
        return (is_hf_model(model) and tower_type(model) == "segformer"
                and type(model).__name__ in MODEL_CLASSES["segformer"])

    def check(self, model: nn.Module, name: str) -> None:
        modeling = self.modeling(model)
        for s, (emb, layers) in enumerate(self.stages(model)):
            if type(emb) is not modeling.SegformerOverlapPatchEmbeddings or not isinstance(emb.proj, nn.Conv2d):
                raise UnsupportedModelError(f"{name!r}: stage {s} embeds with {type(emb).__name__}; vitlens reads "
                                            "transformers' SegformerOverlapPatchEmbeddings (one strided convolution).")
            pooling_of(emb.proj)  # refuses dilation, in one line
            if not len(layers):
                raise UnsupportedModelError(f"{name!r}: stage {s} has no blocks; vitlens reads SegFormers whose every "
                                            "stage has at least one.")
            check_blocks(name, ((f"stage {s} layer {i}", layer) for i, layer in enumerate(layers)),
                         modeling.SegformerLayer, (modeling.SegformerAttention,), "transformers", "attention")

    # --- structure ----------------------------------------------------------------------------------------------

    def stages(self, model: nn.Module) -> list[tuple[nn.Module, Sequence[nn.Module]]]:
        """(patch embedding, layers) of every stage, first to last."""
        return [(stage.patch_embeddings, stage.blocks) for stage in self.base(model).stages]

    @staticmethod
    def key_pooling(attn: nn.Module) -> nn.Module | None:
        """The reduction convolution of a block's keys at a ratio above 1, else None."""
        return attn.sequence_reduction.sequence_reduction if attn.sequence_reduction_ratio > 1 else None

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return [(s, layer) for s, (_emb, layers) in enumerate(self.stages(model)) for layer in layers]

    def attention_of(self, block: nn.Module) -> nn.Module:
        """A layer's ``attention`` (its parent is the layer: ``LoadedModel.block_names``)."""
        return block.attention

    def heads_of(self, block: nn.Module) -> int:
        return int(block.attention.num_attention_heads)

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        """``config.image_size`` where set, else the image processor's default 512x512 (module docstring)."""
        size = getattr(self.base(model).config, "image_size", None)
        return DEFAULT_SIZE if size is None else pair(size)

    def stage_layout(self, model: nn.Module, input_hw: Sequence[int] | None = None
                     ) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(token grid, pixel stride) of every stage at an input of ``input_hw`` pixels (None: the size read at): each
        embedding convolution's output size, the stride the product of the convolutions' strides."""
        grid, stride = tuple(int(s) for s in (input_hw or self.image_size(model))), (1, 1)
        out = []
        for emb, _layers in self.stages(model):
            grid = pooled_grid(grid, emb.proj)  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            stride = tuple(a * b for a, b in zip(stride, pooling_of(emb.proj)[1]))  # type: ignore[assignment]
            out.append((grid, stride))
        return out

    def cam_layer(self, model: nn.Module) -> str | None:
        """The last stage's final ``layer_norm`` over its tokens [B, H * W, C] (what the classifier averages; a
        SegFormer layer's output is followed by it)."""
        base = self.base(model)
        prefix = module_path(model, base)
        last = f"stages.{len(base.stages) - 1}.layer_norm"
        return f"{prefix}.{last}" if prefix else last

    # --- geometry -----------------------------------------------------------------------------------------------

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        """Every block's geometry: one window of all its queries (the stage's tokens) over all its keys (reduced, or
        the same tokens), their centres in input pixels and the stated transports (module docstring)."""
        out = []
        previous: tuple[int, int] | None = None
        for s, ((emb, layers), (grid, stride)) in enumerate(zip(self.stages(model),
                                                                self.stage_layout(model, input_hw))):
            stage_from = None if previous is None else pooling_module_transport(previous, emb.proj, grid)
            centres = token_centres(grid, stride)
            for i, layer in enumerate(layers):
                pool = self.key_pooling(layer.attention)
                key_grid = pooled_grid(grid, pool)
                key_from: Transport | None = pooling_module_transport(grid, pool)
                key_centres = centres if key_from is None else transport_centres(key_from, centres)
                nq, nk = grid[0] * grid[1], key_grid[0] * key_grid[1]
                out.append(WindowGeometry(
                    stage=s, grid=grid, stride_px=stride, index=np.arange(nq, dtype=np.int64)[None],
                    allowed=np.ones((1, nq, nk), dtype=bool), kind="global" if key_from is None else "pooled",
                    key_index=np.arange(nk, dtype=np.int64)[None], key_grid=key_grid, query_centres=centres,
                    key_centres=key_centres, key_from=key_from, stage_from=stage_from if i == 0 else None))
            previous = grid
        return out

    # --- spec and capture ---------------------------------------------------------------------------------------

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        cfg = self.base(model).config
        size = self.image_size(model)
        refuse_other_size(name, self.name, size, input_size)
        layout = self.stage_layout(model, size)
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=layout[0][0], stride_px=layout[0][1],
            num_prefix_tokens=0, num_layers=len(self.blocks(model)), num_heads=max(self.block_heads(model)),
            embed_dim=int(cfg.hidden_sizes[0]), has_class_token=False, has_pos_embed=False,
            num_classes=self.num_classes(model), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            read_interface_beside(attn, layer, capture, handles, "a SegFormer attention")

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        read_eager_returned(self.attention_modules(model), capture, handles)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        """The module whose input is the heads side by side: ``o_proj``."""
        return attn.o_proj

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        conv = self.stages(model)[0][0].proj
        where = {id(mod): n for n, mod in model.named_modules()}
        return conv_filters(conv, where[id(conv)], "the first stage's overlapping patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return None

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("SegFormer learns no absolute position table: position comes from the zero padding of its "
                "overlapping patch embeddings and of the 3x3 depthwise convolution in its Mix-FFN")

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a classifier; else the mean over the last stage's tokens (what the classifier reads)."""
        out = model(pixel_values=x)
        if is_image_classifier(model):
            return out.logits
        last = out.last_hidden_state
        return last.flatten(2).mean(-1) if last.dim() == 4 else last.mean(1)


register(HuggingFaceSegformer())
