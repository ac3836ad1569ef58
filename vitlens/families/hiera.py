"""Hiera (timm ``hiera_*``, ``timm.models.hiera``; Hugging Face ``HieraModel`` / ``HieraForImageClassification``):
mask-unit attention over an "unrolled" token sequence, with the queries max-pooled at the first block of each
pooling stage; and SAM 2's Hiera (timm ``HieraDet``, ``sam2_hiera_*``: ``read_hieradet_windows``, ``TimmHieraDet``),
windows padded on a row-major grid, queries pooled inside each window.

Token order. Hiera's patch tokens are reordered once, before the first block (``Unroll``: the q-stride offsets
of every pooling moved outward, so that mask units are contiguous by stride and a max over ``q_stride`` groups
of the sequence is a 2-D max pool). A mask-unit attention views the tokens as [tokens per window, windows] (the
window of a sequence position is its number modulo the windows); a pooling block max-pools its queries over
``q_stride`` groups, so its queries are tokens of the next stage's coarser grid while its keys are the block's
input tokens on the finer grid ("query-pooled"), and max-pools its residual the same way (after its ``proj``).
A global block is one window over all tokens.

Geometry (``windows``). None of this is re-derived: every block's windows are read by running the model's own
code on one-hot token numbers. The model's ``Unroll`` (transformers: ``unroll``) places each stage-0 token; each
block's attention runs on a stand-in (``common.windows.StandIn``: one head of one-hot channels, ``qkv`` three copies of
its input, ``proj`` the identity, scale 1, the non-fused path) and its own reshapes, window view and query
max-pool hand over, at its first matrix product, q (each query: the one-hot of the tokens it pools) and k^T;
the block's own ``forward`` on a stand-in (norms the identity, attention and MLP zero) gives its pooled
residual, the token order handed to the next block. A pooled query is placed on the coarse grid at the block
of fine tokens it pools (checked to be one whole ``q_stride`` block), its centre in pixels the mean of theirs;
a stage-0 token sits at its patch's centre, (r + 0.5) x the patch stride. The pooled residual's transport (the
rollout) is stated as each pooled token the mean of the fine tokens it max-pools (``query_from``).

Capture. timm's ``MaskUnitAttention`` computes softmax(q * scale @ k^T) over [B, heads, windows, Nq, Nk] (5-D)
or [B, heads, Nq, Nk] (global): on its non-fused path the probabilities are read as its own ``softmax`` returns
them (the only one in its forward), on its fused path side capture reads its one
``F.scaled_dot_product_attention`` call (softmax(q k^T * scale) from its very arguments, the real output kept)
and inline capture turns the non-fused path on for the session. transformers' ``HieraMaskUnitAttention`` is
eager only and returns its probabilities when asked (``output_attentions``): they are asked for and handed on,
the output unchanged. Either way the maps are handed on as [B * windows, heads, Nq, Nk], windows in the
model's order.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..core.attention import conv_filters
from ..core.spec import ModelSpec
from ..core.windows import WindowGeometry
from ..errors import UnsupportedModelError
from ..kinds import HIERARCHICAL
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.blocks import StagedFamily
from .common.hiera import HF, TIMM, TimmHieraBase, read_windows, window_emitter
from .common.hf import IMAGENET_MEAN, IMAGENET_STD, HfTypes, HuggingFaceFamily, ProcessorDefaults
from .common.readers import read_returned


class TimmHiera(TimmHieraBase):
    """timm ``Hiera`` (``hiera_*``): mask-unit and global attention over its unrolled tokens, queries max-pooled at
    each pooling stage's first block (module docstring)."""

    name = "timm-hiera"
    summary = "timm Hiera (hiera_*)"
    reads = ("timm Hiera (hiera_*, timm.models.hiera): mask-unit (windowed) and global attention over its unrolled "
             "token order, query pooling between stages; attention distance in image pixels per block and stage, "
             "one query's window, rollout through the windows and the query pooling")
    names = ("timm names: hiera_tiny_224, hiera_small_abswin_256 (timm.list_models('hiera_*'))",)

    def matches(self, model: nn.Module) -> bool:
        from timm.models.hiera import Hiera

        return isinstance(model, Hiera)

    def check(self, model: nn.Module, name: str) -> None:
        from timm.models.hiera import HieraBlock, MaskUnitAttention, PatchEmbed

        if type(model.patch_embed) is not PatchEmbed or model.patch_embed.spatial_dims != 2 \
                or not model.patch_embed.reshape or len(model.patch_stride) != 2:
            raise UnsupportedModelError(f"{name!r}: vitlens reads 2-D image Hiera (one Conv2d patch embedding); this "
                                        f"one embeds {getattr(model.patch_embed, 'spatial_dims', '?')}-D patches.")
        if model.pos_embed_spatial is not None:
            raise UnsupportedModelError(f"{name!r}: separate spatial and temporal position tables (video Hiera); "
                                        "vitlens reads image Hiera.")
        self.check_block_classes(model, name, HieraBlock, MaskUnitAttention)

    def grid(self, model: nn.Module) -> tuple[int, int]:
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(g) for g in model.tokens_spatial_shape)  # type: ignore[return-value]

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(g) * int(s) for g, s in zip(model.tokens_spatial_shape, model.patch_stride))  # type: ignore[return-value]

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        """(stage, block) of every block (a block after the i-th stage end is in stage i + 1)."""
        return [(sum(1 for e in model.stage_ends if e < i), block) for i, block in enumerate(model.blocks)]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        size = self.image_size(model)
        refuse_other_size(name, self.name, size, input_size)
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=self.grid(model),
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            stride_px=tuple(int(s) for s in model.patch_stride),  # type: ignore[arg-type]
            num_prefix_tokens=0, num_layers=len(model.blocks), num_heads=max(self.block_heads(model)),
            embed_dim=int(model.patch_embed.proj.out_channels), has_class_token=False,
            has_pos_embed=model.pos_embed is not None,
            num_classes=int(getattr(model, "num_classes", 0)), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        return read_windows(model.unroll, self.blocks(model), self.grid(model),
                            # the ignore below: 2 ints (mypy: tuple[int, ...])
                            tuple(int(s) for s in model.patch_stride),  # type: ignore[arg-type]
                            # the ignore below: 2 ints (mypy: tuple[int, ...])
                            tuple(int(s) for s in model.q_stride), TIMM)  # type: ignore[arg-type]

    def heads_of(self, block: nn.Module) -> int:
        return int(block.attn.heads)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        if model.pos_embed is None:
            return None
        if model.pos_embed_win is None:  # one learned row per stage-0 token, row-major
            return model.pos_embed.detach(), spec.grid
        # abs-win: what the model adds at each stage-0 token, its own sum of the interpolated global table and the
        # tiled window table (model._pos_embed on zeros)
        with torch.no_grad():
            zeros = model.pos_embed.new_zeros(1, spec.grid[0] * spec.grid[1], model.pos_embed.shape[1])
            return model._pos_embed(zeros).detach(), spec.grid

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return "this Hiera was built without a learned absolute position table"


#: the transformers classes read (a backbone or the MAE pre-training model is refused)
HF_CLASSES = ("HieraModel", "HieraForImageClassification")


class HuggingFaceHiera(HuggingFaceFamily, StagedFamily):
    """transformers ``HieraModel`` / ``HieraForImageClassification`` (module docstring)."""

    name = "hf-hiera"
    summary = "Hugging Face Hiera"
    reads = ("Hugging Face transformers Hiera (HieraModel, HieraForImageClassification): mask-unit and global "
             "attention over the unrolled tokens, query pooling between stages; the windowed views as for timm's "
             "Hiera; needs transformers")
    names = ("hf:ORG/NAME or hf:FOLDER of a Hiera checkpoint, e.g. hf:facebook/hiera-tiny-224-in1k-hf",)
    capture = CaptureAbilities(view_mode="side")
    attention_inputs = ("layernorm_before",)
    hf_types = HfTypes(processors={"hiera": ProcessorDefaults("center", 224 / 256, IMAGENET_MEAN, IMAGENET_STD,
                                                              "bicubic")})
    model_classes = {"hiera": HF_CLASSES}
    base_attrs = ("hiera",)

    def check(self, model: nn.Module, name: str) -> None:
        self.check_model_class(model, name)
        modeling = self.modeling(model)
        cfg = model.config
        if len(cfg.patch_stride) != 2:
            raise UnsupportedModelError(f"{name!r}: vitlens reads 2-D image Hiera.")
        if float(getattr(cfg, "mask_ratio", 0.0) or 0.0) and getattr(self.base(model).embeddings, "is_mae", False):
            raise UnsupportedModelError(f"{name!r}: an MAE Hiera drops mask units at random; vitlens reads every "
                                        "token.")
        for i, (_s, layer) in enumerate(self.blocks(model)):
            if type(layer) is not modeling.HieraLayer or type(layer.attn) is not modeling.HieraMaskUnitAttention:
                raise UnsupportedModelError(
                    f"{name!r}: layer {i} is a {type(layer).__name__} with "
                    f"{type(getattr(layer, 'attn', None)).__name__}; vitlens reads transformers' HieraLayer with "
                    "HieraMaskUnitAttention exactly.")

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return [(s, layer) for s, stage in enumerate(self.base(model).encoder.stages) for layer in stage.layers]

    def grid(self, model: nn.Module) -> tuple[int, int]:
        cfg = model.config
        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return tuple(int(i) // int(s) for i, s in zip(cfg.image_size, cfg.patch_stride))  # type: ignore[return-value]

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        cfg = model.config
        size = tuple(int(s) for s in cfg.image_size)
        refuse_other_size(name, self.name, size, input_size)
        return ModelSpec(
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=self.grid(model),  # type: ignore[arg-type]
            # the ignore below: 2 ints (mypy: tuple[int, ...])
            stride_px=tuple(int(s) for s in cfg.patch_stride),  # type: ignore[arg-type]
            num_prefix_tokens=0, num_layers=len(self.blocks(model)), num_heads=max(self.block_heads(model)),
            embed_dim=int(cfg.embed_dim), has_class_token=False, has_pos_embed=True,
            num_classes=self.num_classes(model), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name)

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        cfg, base = model.config, self.base(model)
        unroll = self.modeling(model).unroll
        size = tuple(int(s) for s in cfg.image_size)
        stride = tuple(int(s) for s in cfg.patch_stride)

        def run(x: torch.Tensor) -> torch.Tensor:
            return unroll(x, image_shape=size, patch_stride=stride, schedule=base.unroll_schedule)

        # the ignore below: 2 ints (mypy: tuple[int, ...])
        return read_windows(run, self.blocks(model), self.grid(model), stride,  # type: ignore[arg-type]
                            # the ignore below: 2 ints (mypy: tuple[int, ...])
                            tuple(int(s) for s in cfg.query_stride), HF)  # type: ignore[arg-type]

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        by_window = capture.sending_to(window_emitter(capture))
        for layer, attn in enumerate(self.attention_modules(model)):
            # its own probabilities, asked for (``output_attentions=True``) and handed on; the caller gets its output
            # unchanged and the probabilities only if it asked
            read_returned(attn, layer, by_window, handles, lambda out, asked: (out[0], out[1] if asked else None))

    install_inline = install_side  # eager only: the probabilities it returns are those its output is made from

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        conv = self.base(model).embeddings.patch_embeddings.projection
        where = {id(mod): n for n, mod in model.named_modules()}
        return conv_filters(conv, where[id(conv)], "the patch embedding E", spec.name)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return self.base(model).embeddings.position_embeddings.detach(), spec.grid


register(TimmHiera())
register(HuggingFaceHiera())
