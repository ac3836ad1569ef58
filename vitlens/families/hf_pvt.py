"""Hugging Face transformers Pyramid Vision Transformers: PVT v1 (``PvtModel``, ``PvtForImageClassification``) and
PVT v2 (``PvtV2Model``, ``PvtV2ForImageClassification``), read block by block on their stages' grids.

A PVT has (usually four) stages; each starts with its own patch embedding, a strided convolution of the previous
stage's tokens (of the image, at the first stage): v1 a plain one (``kernel_size=strides[i]``,
``stride=patch_sizes[i]``, no padding), v2 an overlapping one (kernel ``patch_sizes[i]``, stride ``strides[i]``,
padding kernel // 2: 7x7 stride 4, then 3x3 stride 2). Its blocks attend globally with *spatial-reduction
attention*: the queries are the stage's tokens, the keys and values a strided convolution (``kernel = stride =
sr_ratio``, then a LayerNorm) of them, a coarser grid; at ``sr_ratio == 1`` the keys are the queries' tokens. PVT v2
with ``linear_attention`` pools the keys by ``AdaptiveAvgPool2d(7)`` (then a 1x1 convolution, LayerNorm, GELU):
7x7 keys at every stage. PVT v1 adds a class token at its last stage (transformers builds it there for every
config): the class token joins the grid's tokens as queries and keys, and the classifier reads it.

Capture. Both compute their probabilities eagerly, ``softmax(q k^T / sqrt(d))`` (transformers has no other
implementation of them); they are read as they enter the attention's dropout (v1 ``attention.self.dropout``, v2
``attention.attn_drop``), the model's own, so side and inline capture are the same reading and the outputs are
untouched; [B, heads, Nq, Nk], Nq the stage's tokens (plus the class token, first, in v1's last stage), Nk the
pooled keys (plus the class token).

Geometry (``windows``). One "window" per block holding all its queries and keys; kind "pooled" where the keys are
pooled (``sr_ratio > 1`` or linear attention), "global" where they are the queries' tokens. A stage's grid is its
embedding convolution's output size (floor((H + 2p - k) / s) + 1); its tokens sit at (r + 0.5) x the stage's stride
(the product of the embedding convolutions' strides: the stride cell's centre, as for every family; an
overlapping embedding is centred a fixed offset above and left of it, the same for every token of a stage, so no
distance changes); a key at the mean of the centres of the tokens its pooling covers (``transport_centres``). The
class token has no place in the image: it is marked -1 in the block's index (``WindowGeometry.prefix_tokens``),
so the distance reads the grid's queries and keys, renormalised over the grid's keys.

Stated transports (rollout). The keys: the reduction's footprint, each key the mean of the tokens its kernel (v2
linear: its adaptive bin) covers (``key_from``: exact for which tokens; the convolution's own weights are a stated
approximation, the adaptive average pool's are exactly these); the residual is the identity. Between stages, the
stage's embedding (``stage_from``): each embedded token the mean of the previous stage's tokens its kernel covers
inside the grid (the zero padding is no token). The source is the class token in v1 (the classifier reads it;
its share is dropped where it enters, a learned parameter) and the mean over the last stage's tokens in v2 (its
classifier's mean). Not transported, as a rollout follows attention and the residual only: v2's Mix-FFN 3x3
depthwise convolution (it mixes neighbouring tokens inside the MLP branch).

Refused, in one line: another class of these model types (``PvtV2Backbone``: load the checkpoint as
``PvtV2Model``), a block or embedding class other than transformers' own, a stage without blocks, and a v1 whose
class-token stage reduces its keys (``sr_ratio > 1`` there: transformers' own forward cannot reshape the class
token with the grid and fails).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.windows import Transport, WindowGeometry, adaptive_pooling_transport, transport_centres
from ..errors import UnsupportedModelError, ViewNotAvailableError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.blocks import StagedFamily
from .common.hf import (IMAGENET_MEAN, IMAGENET_STD, HfTypes, HuggingFaceFamily, ProcessorDefaults, is_image_classifier,
                        module_path, tower_type)
from .common.readers import read_at_dropout
from .common.windows import pair, pooled_grid, pooling_module_transport, pooling_of, token_centres

#: the model types read, their image processors' defaults, and no other attention implementation asked for at load
#: (transformers has one of them, eager, which is read)
HF_TYPES = HfTypes(processors={"pvt": ProcessorDefaults("squash", 1.0, IMAGENET_MEAN, IMAGENET_STD, "bicubic"),
                               "pvt_v2": ProcessorDefaults("squash", 1.0, IMAGENET_MEAN, IMAGENET_STD, "bicubic")},
                   attn_implementation=None)
#: the model classes read, by model type
MODEL_CLASSES = {"pvt": ("PvtModel", "PvtForImageClassification"),
                 "pvt_v2": ("PvtV2Model", "PvtV2ForImageClassification")}
#: each model type's embedding, layer and self-attention classes
LAYER_CLASSES = {"pvt": ("PvtPatchEmbeddings", "PvtLayer", "PvtEfficientSelfAttention"),
                 "pvt_v2": ("PvtV2OverlapPatchEmbeddings", "PvtV2BlockLayer", "PvtV2SelfAttention")}


class HuggingFacePvt(HuggingFaceFamily, StagedFamily):
    """transformers ``Pvt*`` and ``PvtV2*``: spatial-reduction attention read block by block (module docstring)."""

    name = "hf-pvt"
    summary = "Hugging Face PVT and PVT v2"
    reads = ("Hugging Face transformers PVT and PVT v2 (PvtModel, PvtForImageClassification, PvtV2Model, "
             "PvtV2ForImageClassification): spatial-reduction attention (keys pooled by a strided convolution, or "
             "v2's linear 7x7 adaptive pooling) on four stages of strided patch embeddings, v1's class token in its "
             "last stage; distance in image pixels beside the uniform distance over the pooled keys, rollout through "
             "the poolings and the stage embeddings with a stated transport; needs transformers")
    names = ("hf:ORG/NAME or hf:FOLDER of a PVT or PVT v2 checkpoint, e.g. hf:Zetatech/pvt-tiny-224, "
             "hf:OpenGVLab/pvt_v2_b0",)
    capture = CaptureAbilities(view_mode="side")  # both modes read the model's own probabilities
    attention_inputs = ("layer_norm_1",)
    hf_types = HF_TYPES
    model_classes = MODEL_CLASSES
    base_attrs = ("pvt", "pvt_v2")

    def check(self, model: nn.Module, name: str) -> None:
        self.check_model_class(model, name)
        kind = tower_type(model)
        modeling = self.modeling(model)
        emb_cls, layer_cls, attn_cls = (getattr(modeling, c) for c in LAYER_CLASSES[kind or ""])
        for s, (emb, layers) in enumerate(self.stages(model)):
            if type(emb) is not emb_cls or not isinstance(self.embedding_conv(emb), nn.Conv2d):
                raise UnsupportedModelError(f"{name!r}: stage {s} embeds with {type(emb).__name__}; vitlens reads "
                                            f"transformers' {emb_cls.__name__} (one strided convolution).")
            pooling_of(self.embedding_conv(emb))  # refuses dilation, in one line
            if not len(layers):
                raise UnsupportedModelError(f"{name!r}: stage {s} has no blocks; vitlens reads PVTs whose every stage "
                                            "has at least one.")
            for i, layer in enumerate(layers):
                attn = self.self_attention(layer)
                if type(layer) is not layer_cls or type(attn) is not attn_cls:
                    raise UnsupportedModelError(
                        f"{name!r}: stage {s} layer {i} is a {type(layer).__name__} with {type(attn).__name__}; "
                        f"vitlens reads transformers' {layer_cls.__name__} with {attn_cls.__name__} exactly and "
                        "refuses others.")
                if self.prefix_tokens(emb) and self.key_pooling(attn) is not None:
                    raise UnsupportedModelError(
                        f"{name!r}: stage {s} has PVT's class token and reduces its keys (sr_ratio "
                        f"{attn.sequences_reduction_ratio}); transformers' own forward cannot reshape the class token "
                        "with the grid, so it is refused (PVT v1 reduces no keys in its class-token stage).")

    # --- structure ----------------------------------------------------------------------------------------------

    def stages(self, model: nn.Module) -> list[tuple[nn.Module, Sequence[nn.Module]]]:
        """(patch embedding, layers) of every stage, first to last."""
        enc = self.base(model).encoder
        if hasattr(enc, "patch_embeddings"):  # v1
            return list(zip(enc.patch_embeddings, enc.block))
        return [(stage.patch_embedding, stage.blocks) for stage in enc.layers]

    @staticmethod
    def embedding_conv(emb: nn.Module) -> nn.Module:
        """A stage embedding's convolution (v1 ``projection``, v2 ``proj``)."""
        return emb.projection if hasattr(emb, "projection") else emb.proj

    @staticmethod
    def self_attention(layer: nn.Module) -> nn.Module:
        """The module that holds the heads: v1 ``attention.self``, v2 ``attention``."""
        attention = layer.attention
        return attention.self if hasattr(attention, "self") else attention

    @staticmethod
    def prefix_tokens(emb: nn.Module) -> int:
        """1 where the stage's embedding adds PVT v1's class token, else 0."""
        return int(getattr(emb, "cls_token", None) is not None)

    @staticmethod
    def key_pooling(attn: nn.Module) -> nn.Module | None:
        """The module that pools a block's keys: v2 linear attention's ``AdaptiveAvgPool2d``, the reduction
        convolution (v1 ``sequence_reduction``, v2 ``spatial_reduction``) at a ratio above 1, else None."""
        if getattr(attn, "linear_attention", False):
            return attn.pool
        ratio = getattr(attn, "sequences_reduction_ratio", getattr(attn, "spatial_reduction_ratio", 1))
        if ratio > 1:
            return attn.sequence_reduction if hasattr(attn, "sequence_reduction") else attn.spatial_reduction
        return None

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return [(s, layer) for s, (_emb, layers) in enumerate(self.stages(model)) for layer in layers]

    def attention_of(self, block: nn.Module) -> nn.Module:
        """A layer's ``attention`` (its parent is the layer: ``LoadedModel.block_names``)."""
        return block.attention

    def heads_of(self, block: nn.Module) -> int:
        return int(self.self_attention(block).num_attention_heads)

    def stage_layout(self, model: nn.Module, input_hw: Sequence[int] | None = None
                     ) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """(token grid, pixel stride) of every stage at an input of ``input_hw`` pixels (None: the built size): each
        embedding convolution's output size, the stride the product of the convolutions' strides."""
        grid, stride = tuple(int(s) for s in (input_hw or self.image_size(model))), (1, 1)
        out = []
        for emb, _layers in self.stages(model):
            conv = self.embedding_conv(emb)
            grid = pooled_grid(grid, conv)  # type: ignore[arg-type]  # 2 ints (mypy: tuple[int, ...])
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            stride = tuple(a * b for a, b in zip(stride, pooling_of(conv)[1]))  # type: ignore[assignment]
            out.append((grid, stride))
        return out

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        return pair(self.base(model).config.image_size)

    def cam_layer(self, model: nn.Module) -> str | None:
        """PVT v2: its last stage's final ``layer_norm`` over the stage's tokens [B, H * W, C] (what the classifier
        averages; a transformers PVT layer returns a tuple, so the norm that follows the last one stands in for its
        output). PVT v1 is refused in one line: its last stage's tokens are [class token, grid], and its classifier
        reads the class token alone.

        Raises:
            ViewNotAvailableError: PVT v1.
        """
        if tower_type(model) == "pvt":
            raise ViewNotAvailableError(
                "PVT v1's last stage holds its class token beside the grid's tokens and its classifier reads the "
                "class token alone, so a CAM on that stage's grid is not defined here; its input methods (saliency, "
                "integrated gradients, ...) and the rollout from the class token are.")
        base = self.base(model)
        prefix = module_path(model, base)
        last = f"encoder.layers.{len(base.encoder.layers) - 1}.layer_norm"
        return f"{prefix}.{last}" if prefix else last

    # --- geometry -----------------------------------------------------------------------------------------------

    def key_layout(self, attn: nn.Module, grid: tuple[int, int]) -> tuple[tuple[int, int], Transport | None]:
        """(key grid, the keys' stated transport onto the stage's tokens, None where the keys are those tokens)."""
        pool = self.key_pooling(attn)
        if pool is None:
            return grid, None
        if isinstance(pool, nn.AdaptiveAvgPool2d):
            coarse = pair(pool.output_size)
            return coarse, adaptive_pooling_transport(grid, coarse)
        return pooled_grid(grid, pool), pooling_module_transport(grid, pool)

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        """Every block's geometry: one window of all its queries (the stage's tokens, behind v1's class token) over
        all its keys (pooled, or the same tokens), their centres in input pixels and the stated transports (module
        docstring)."""
        out = []
        previous: tuple[int, int] | None = None
        for s, ((emb, layers), (grid, stride)) in enumerate(zip(self.stages(model),
                                                                self.stage_layout(model, input_hw))):
            conv = self.embedding_conv(emb)
            stage_from = None if previous is None else pooling_module_transport(previous, conv, grid)
            centres = token_centres(grid, stride)
            p = self.prefix_tokens(emb)
            for i, layer in enumerate(layers):
                key_grid, key_from = self.key_layout(self.self_attention(layer), grid)
                key_centres = centres if key_from is None else transport_centres(key_from, centres)
                nq, nk = grid[0] * grid[1], key_grid[0] * key_grid[1]
                out.append(WindowGeometry(
                    stage=s, grid=grid, stride_px=stride,
                    index=np.concatenate([np.full(p, -1), np.arange(nq)]).astype(np.int64)[None],
                    allowed=np.ones((1, p + nq, p + nk), dtype=bool), kind="global" if key_from is None else "pooled",
                    key_index=np.concatenate([np.full(p, -1), np.arange(nk)]).astype(np.int64)[None],
                    key_grid=key_grid, query_centres=centres, key_centres=key_centres, key_from=key_from,
                    stage_from=stage_from if i == 0 else None, prefix_tokens=p))
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
            embed_dim=int(cfg.hidden_sizes[0]), has_class_token=False,
            has_pos_embed=getattr(self.stages(model)[0][0], "position_embeddings", None) is not None,
            num_classes=self.num_classes(model), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def _dropouts(self, model: nn.Module) -> list[nn.Module]:
        """The dropout every layer's probabilities enter (v1 ``attention.self.dropout``, v2 ``attention.attn_drop``)."""
        attns = [self.self_attention(layer) for _s, layer in self.blocks(model)]
        return [a.attn_drop if hasattr(a, "attn_drop") else a.dropout for a in attns]

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, dropout in enumerate(self._dropouts(model)):
            read_at_dropout(dropout, layer, capture, handles)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        self.install_side(model, capture, handles)  # the model's own probabilities, the output computed from them

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        """The module whose input is the heads side by side: v1's ``output.dense``, v2's ``proj``."""
        return attn.output.dense if hasattr(attn, "output") else attn.proj

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        conv = self.embedding_conv(self.stages(model)[0][0])
        where = {id(mod): n for n, mod in model.named_modules()}
        return conv_filters(conv, where[id(conv)], "the first stage's patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        emb = self.stages(model)[0][0]
        pos = getattr(emb, "position_embeddings", None)  # v1: a table per stage; the first stage's is shown
        if pos is None or pos.shape[1] != spec.grid[0] * spec.grid[1] + self.prefix_tokens(emb):
            return None
        return pos.detach()[:, self.prefix_tokens(emb):], spec.grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        if tower_type(model) == "pvt_v2":
            return ("PVT v2 learns no absolute position table: position comes from the zero padding of its "
                    "overlapping patch embeddings and of the 3x3 depthwise convolution in its feed-forward network")
        return "its first stage's position table does not cover that stage's grid"

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Class logits of a classifier; else v1's class token, v2's mean over the last stage's tokens (what each
        classifier reads)."""
        out = model(pixel_values=x)
        if is_image_classifier(model):
            return out.logits
        last = out.last_hidden_state
        return last[:, 0] if last.dim() == 3 else last.flatten(2).mean(-1)


register(HuggingFacePvt())
