"""Hugging Face transformers Swin (``SwinModel``, ``SwinForImageClassification``, and ``SwinBackbone``: the one
inside Mask2Former, OneFormer and UperNet, read through the whole model as its tower) and Swin V2 (``Swinv2Model``,
``Swinv2ForImageClassification``, and ``Swinv2Backbone``, read through a whole model likewise), read block by block
through their windows as timm's Swins are
(``vitlens.families.swin``: the same windowed views, the same stand-in, ``vitlens.families.common.windows``).

Geometry (``windows``). A transformers Swin layer pads, shifts and partitions inside its own ``forward``
(Swin: after ``layernorm_before``; it pads to whole windows *before* the cyclic shift, timm shifts first, so
the two put padding in other windows; Swin V2 builds its window size at construction from the stage's
``input_resolution``, which can differ from the grid its forward gets). So each layer's ``forward`` itself is
run, on a stand-in (``common.windows.StandIn``) whose ``attention`` is a recorder and whose ``layernorm_before`` is the
identity, on a grid of token numbers at the stage's input dimensions: whatever the layer clamps (Swin's
``set_shift_and_window_size``), pads, rolls and partitions is its own code's doing, and the recorder reads the
windows and the mask handed to the attention. The model is not touched. A ``SwinBackbone`` runs its layers with
``always_partition=True`` (no clamping: a layer keeps the window and shift it was built with, padded), and so does
the stand-in's run of its layers (``is_backbone``); a ``Swinv2Backbone`` runs its layers as a ``Swinv2Model`` does
(its layers take no such flag) and hands on the stages' outputs before their patch merging, unnormed.

Capture.

- Swin (``SwinAttention``) calls the attention function of ``config._attn_implementation`` through
  transformers' ``AttentionInterface`` with the window queries and keys and one additive mask, the
  relative-position bias plus the shifted windows' mask. Side capture runs the module as it is: under
  ``sdpa`` the one ``F.scaled_dot_product_attention`` call is read (softmax(q k^T * scale + mask) from its
  very arguments, the real output kept); under ``eager`` the module returns the probabilities its output is
  made from, and those are handed on. The outputs are bit for bit those of a run without capture. Another
  implementation (flex, a kernel) gives neither and is refused at the forward in one line. Inline capture
  runs transformers' ``eager`` implementation of the module for the session (the probabilities the output is
  computed from, in the graph when asked).
- Swin V2 (``Swinv2SelfAttention``) computes its probabilities itself, eagerly (scaled cosine attention, a
  continuous position bias 16 sigmoid(MLP of log-spaced offsets), the mask): they are read as they enter its
  ``dropout``, the model's own, so side and inline capture are the same and the outputs are untouched.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry
from ..errors import UnsupportedModelError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.blocks import StagedFamily, check_blocks
from .common.hf import (IMAGENET_MEAN, IMAGENET_STD, HfTypes, HuggingFaceFamily, ProcessorDefaults, module_path,
                        tower_type)
from .common.readers import read_at_dropout
from .common.interface import read_eager_returned, read_interface_beside
from .common.windows import StandIn, identity, pair, record_windows
from .common.relative_bias import RelativeBias

if TYPE_CHECKING:
    from .common.relative_bias import RelativeBias

#: the model types read, their image processors' defaults, and the implementation ``hf:`` names load with (sdpa: its
#: one call is read, the outputs bit for bit)
HF_TYPES = HfTypes(processors={"swin": ProcessorDefaults("squash", 1.0, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
                               "swinv2": ProcessorDefaults("squash", 1.0, IMAGENET_MEAN, IMAGENET_STD, "bicubic")})
#: the model classes read, by model type (a masked-image-modeling head is refused; Swin's backbone, the one inside
#: Mask2Former, OneFormer and UperNet, is read: ``is_backbone``)
MODEL_CLASSES = {"swin": ("SwinModel", "SwinForImageClassification", "SwinBackbone"),
                 "swinv2": ("Swinv2Model", "Swinv2ForImageClassification", "Swinv2Backbone")}
#: each model type's layer, attention and patch merging classes
LAYER_CLASSES = {"swin": ("SwinLayer", "SwinAttention", "SwinPatchMerging"),
                 "swinv2": ("Swinv2Layer", "Swinv2Attention", "Swinv2PatchMerging")}
#: the attention implementations whose side capture is read (sdpa's one call, eager's returned probabilities)
SIDE_IMPLEMENTATIONS = ("eager", "sdpa")


class HuggingFaceSwin(HuggingFaceFamily, StagedFamily):
    """transformers ``Swin*`` and ``Swinv2*``: read block by block through their windows (module docstring)."""

    name = "hf-swin"
    summary = "Hugging Face Swin and Swin V2"
    reads = ("Hugging Face transformers Swin and Swin V2 (SwinModel, SwinForImageClassification, Swinv2Model, "
             "Swinv2ForImageClassification; SwinBackbone and Swinv2Backbone, also inside Mask2Former, OneFormer and "
             "UperNet): windowed and shifted-window attention, patch merging; the windowed "
             "views as for timm's Swin; needs transformers")
    names = ("hf:ORG/NAME or hf:FOLDER of a Swin or Swin V2 checkpoint, e.g. "
             "hf:microsoft/swin-tiny-patch4-window7-224, hf:microsoft/swinv2-tiny-patch4-window8-256",)
    capture = CaptureAbilities(view_mode="side")  # side leaves the model's own forward (sdpa or eager) as it is
    hf_types = HF_TYPES
    model_classes = MODEL_CLASSES
    base_attrs = ("swin", "swinv2")

    def check(self, model: nn.Module, name: str) -> None:
        self.check_model_class(model, name)
        kind = tower_type(model)
        modeling = self.modeling(model)
        layer_cls, attn_cls, merge_cls = (getattr(modeling, c) for c in LAYER_CLASSES[kind or ""])
        for s, stage in enumerate(self.stages(model)):
            if stage.downsample is not None and type(stage.downsample) is not merge_cls:
                raise UnsupportedModelError(f"{name!r}: stage {s} downsamples with {type(stage.downsample).__name__}; "
                                            f"vitlens reads {merge_cls.__name__} (2x2 tokens into one).")
            check_blocks(name, ((f"stage {s} layer {i}", layer) for i, layer in enumerate(stage.blocks)), layer_cls,
                         (attn_cls,), "transformers", "attention")
            for i, layer in enumerate(stage.blocks):
                if kind == "swinv2" and type(layer.attention.self) is not modeling.Swinv2SelfAttention:
                    raise UnsupportedModelError(f"{name!r}: stage {s} layer {i}'s attention is a "
                                                f"{type(layer.attention.self).__name__}, not Swinv2SelfAttention.")

    def stages(self, model: nn.Module) -> Sequence[nn.Module]:
        return self.base(model).encoder.layers

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return [(s, layer) for s, stage in enumerate(self.stages(model)) for layer in stage.blocks]

    def attention_of(self, block: nn.Module) -> nn.Module:
        """A layer's ``attention`` (its parent is the layer: ``LoadedModel.block_names``)."""
        return block.attention

    def heads_of(self, block: nn.Module) -> int:
        return int(_self_attention(block).num_attention_heads)

    def stage_layout(self, model: nn.Module) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(token grid, pixel stride) of every stage at the built size, as the encoder hands them on: the patch
        embedding pads the image to whole patches, a stage that ends with a patch merging hands the next
        ((H + 1) // 2, (W + 1) // 2) tokens at twice the stride."""
        cfg = model.config
        (ih, iw), (py, px) = pair(cfg.image_size), pair(cfg.patch_size)
        h, w, sy, sx = -(-ih // py), -(-iw // px), py, px
        out = []
        for stage in self.stages(model):
            out.append(((h, w), (sy, sx)))
            if stage.downsample is not None:
                h, w, sy, sx = (h + 1) // 2, (w + 1) // 2, 2 * sy, 2 * sx
        return out

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        cfg = model.config
        size = pair(cfg.image_size)
        refuse_other_size(name, self.name, size, input_size)
        layout = self.stage_layout(model)
        emb = self.base(model).embeddings
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=layout[0][0], stride_px=pair(cfg.patch_size),
            num_prefix_tokens=0, num_layers=len(self.blocks(model)), num_heads=max(self.block_heads(model)),
            embed_dim=int(cfg.embed_dim), has_class_token=False,
            has_pos_embed=getattr(emb, "position_embeddings", None) is not None,
            num_classes=self.num_classes(model), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        layout = self.stage_layout(model)
        backbone = is_backbone(model)
        return [layer_windows(layer, *layout[stage], stage, always_partition=backbone)
                for stage, layer in self.blocks(model)]

    def attention_input(self, model: nn.Module, block: nn.Module) -> str | None:
        # Swin's attention reads layernorm_before's output; Swin V2 is res-post-norm (its layernorm_before
        # follows the attention, which reads the layer's input)
        return "layernorm_before" if tower_type(model) == "swin" else None

    def cam_layer(self, model: nn.Module) -> str | None:
        """The final ``layernorm`` over the last stage's tokens [B, H * W, C] (what the pooler averages): a
        transformers Swin layer returns a tuple, and no module of the last layer outputs its residual sum, so
        the norm that follows it stands in for the last block's output. None for a ``Swinv2Backbone``, which has no
        final norm (its default target layer is refused in one line: name one)."""
        if type(model).__name__ == "Swinv2Backbone":
            return None
        prefix = module_path(model, self.base(model))
        return f"{prefix}.layernorm" if prefix else "layernorm"

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A classifier's class logits, a ``SwinModel``'s pooled output, a ``SwinBackbone``'s or ``Swinv2Backbone``'s
        last feature map's mean over its tokens [B, C] (a backbone hands on feature maps, no pooled output)."""
        if type(model).__name__ in ("SwinBackbone", "Swinv2Backbone"):
            return model(pixel_values=x).feature_maps[-1].flatten(2).mean(-1)
        return super().logits(model, x)

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            if tower_type(model) == "swinv2":
                read_at_dropout(attn.self.dropout, layer, capture, handles)
            else:
                read_interface_beside(attn, layer, capture, handles, "a Swin attention")

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        attns = self.attention_modules(model)
        if tower_type(model) == "swinv2":
            for layer, attn in enumerate(attns):
                read_at_dropout(attn.self.dropout, layer, capture, handles)
            return
        read_eager_returned(attns, capture, handles)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        """The module whose input is the heads side by side: Swin's ``o_proj``, Swin V2's ``output.dense``."""
        return attn.o_proj if hasattr(attn, "o_proj") else attn.output.dense

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        conv = self.base(model).embeddings.patch_embeddings.projection
        where = {id(mod): n for n, mod in model.named_modules()}
        return conv_filters(conv, where[id(conv)], "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        pos = getattr(self.base(model).embeddings, "position_embeddings", None)  # use_absolute_embeddings
        if pos is None:
            return None
        return pos.detach(), spec.grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        if tower_type(model) == "swinv2":
            return ("Swin V2 adds a continuous relative-position bias (an MLP of log-spaced offsets) inside each "
                    "window instead of a learned absolute position table (use_absolute_embeddings is off)")
        return ("Swin adds a learned relative-position bias inside each window instead of a learned absolute "
                "position table (use_absolute_embeddings is off)")

    def relative_bias(self, model: nn.Module, spec: ModelSpec) -> "RelativeBias":
        """Every layer's position bias inside its window, [heads, N, N], computed by the model's own modules:
        Swin's ``relative_position_bias()`` module; Swin V2's 16 sigmoid of its ``continuous_position_bias_mlp``
        of the log-spaced offset table, looked up by the relative-position index (transformers computes it inside
        the attention's forward; these are its steps)."""
        biases, sources, grids = [], [], []
        names = {id(mod): name for name, mod in model.named_modules()}  # where: counted from 1, and the module's name
        with torch.no_grad():
            for i, (s, layer) in enumerate(self.blocks(model)):
                where = f"stage {s + 1}, block {i + 1} ({names.get(id(layer), '?')})"
                attn = _self_attention(layer)
                size = getattr(attn, "window_size", None) or attn.relative_position_bias.window_size
                wh, ww = (int(w) for w in size)
                if hasattr(attn, "continuous_position_bias_mlp"):
                    table = attn.continuous_position_bias_mlp(attn.relative_coords_table).view(
                        -1, attn.num_attention_heads)
                    bias = 16 * torch.sigmoid(table[attn.relative_position_index.view(-1)].view(
                        wh * ww, wh * ww, -1).permute(2, 0, 1))
                    sources.append(f"{where}: 16 sigmoid(continuous_position_bias_mlp(relative_coords_table))"
                                   "[relative_position_index]")
                else:
                    bias = attn.relative_position_bias()[0]
                    sources.append(f"{where}: relative_position_bias() (its table by relative_position_index)")
                biases.append(bias.detach().float().cpu())
                grids.append((wh, ww))
        return RelativeBias(biases=tuple(biases), sources=tuple(sources), grid=grids[0], num_prefix_tokens=0,
                            grids=tuple(grids))



def _self_attention(layer: nn.Module) -> nn.Module:
    """The module that holds the heads: Swin's ``attention``, Swin V2's ``attention.self``."""
    attention = layer.attention
    return attention.self if hasattr(attention, "self") else attention


def is_backbone(model: nn.Module) -> bool:
    """Whether ``model`` is transformers' ``SwinBackbone`` (Mask2Former's, OneFormer's, UperNet's ``load_backbone``):
    it runs its ``swin`` with ``always_partition=True`` (a layer keeps the window size and shift it was built with
    on a grid smaller than its window, padded, where a ``SwinModel`` clamps them), and hands on the normed feature
    maps of its ``out_features`` stages."""
    return type(model).__name__ == "SwinBackbone"


def layer_windows(layer: nn.Module, grid: tuple[int, int], stride: tuple[int, int], stage: int,
                  always_partition: bool = False) -> WindowGeometry:
    """One transformers Swin / Swin V2 layer's windows, read by running the layer's own ``forward`` on a stand-in
    whose ``attention`` is a recorder and whose ``layernorm_before`` is the identity (module docstring).

    Args:
        layer: a ``SwinLayer`` or ``Swinv2Layer``.
        grid: (H_s, W_s) the input dimensions its stage hands it.
        stride: (sy, sx) pixels between the stage's tokens.
        stage: the stage's number.
        always_partition: run the layer as ``SwinBackbone`` does (``is_backbone``).

    Returns:
        The ``WindowGeometry`` of the layer.
    """
    # the forward as its modeling file writes it: transformers wraps a GradientCheckpointingLayer's forward for
    # gradient checkpointing (the wrapper reads type(self).forward), which a run without gradients never uses
    forward = inspect.unwrap(type(layer).forward)
    h, w = grid

    def run(numbers: torch.Tensor, recorder: Callable[..., Any]) -> Any:
        stand_in = StandIn(layer, attention=recorder, layernorm_before=identity)
        extra = {"always_partition": True} if always_partition else {}
        return forward(stand_in, numbers.reshape(1, h * w, 1), (h, w), **extra)

    return record_windows(run, grid, stage, stride, f"stage {stage} {type(layer).__name__}")


register(HuggingFaceSwin())
