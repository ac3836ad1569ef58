"""Hugging Face transformers ViTDet (``VitDetModel``, ``VitDetBackbone``) and the SAM image encoder
(``SamVisionModel``, the ``vision_encoder`` of ``SamModel``; SAM-HQ's ``SamHQVisionModel`` / ``SamHQModel``, the
same code under other names): one grid of patch tokens, most blocks attending within non-overlapping windows
(padded to whole windows with zero tokens that stay unmasked keys, no shift), a few globally (ViTDet's blocks
outside ``window_block_indices``, SAM's ``global_attn_indexes``), with a decomposed relative-position term
q . R_h[dy] + q . R_w[dx] (Li et al. 2022, from the unscaled queries) added to the scores.

Read as timm's SAM is (``vitlens.families.sam``, ``vitlens.families.swin``): each layer's windows come from its
own ``forward`` (run on a stand-in whose pre-attention norm is the identity and whose attention is a recorder,
on a grid of token numbers: the partition and the padding are the model's own code), a global block is one
window over the whole grid; ``spec.kind`` is "hierarchical" and the views are the windowed ones (one stage).

Capture.

- ViTDet's ``VitDetAttention`` has one implementation, eager: softmax((q * scale) k^T + the decomposed term),
  whose probabilities it returns when called with ``output_attentions=True`` (its output is computed the same
  way either way). Side and inline capture call it so and hand those probabilities on ([B * windows, heads, N, N],
  the very tensor the output is made from, in the graph when asked), returning the layer what it asked for: the
  outputs are bit for bit those of a run without capture.
- SAM's layers are built on ``config._attn_implementation``: ``SamVisionAttention`` (eager) returns its
  probabilities beside its output ([B * windows * heads, N, N], handed on as [B * windows, heads, N, N]), read by
  a forward hook; ``SamVisionSdpaAttention`` makes one ``F.scaled_dot_product_attention`` call with the
  decomposed term as its additive mask, read from its very arguments, the real output kept (side capture, outputs
  bit for bit). Inline capture runs the eager class's ``forward`` on an sdpa module for the session (the
  probabilities the output is computed from).

Not rolled out: the convolutions that mix neighbouring tokens outside the attention (SAM's neck after the last
layer; ViTDet's optional residual bottleneck blocks, ``residual_block_indices``, empty by default, after the
layers they follow), as for timm's SAM.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

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
from .common.readers import read_returned
from .common.sdpa_calls import read_calls
from .common.windows import StandIn, identity, pair, record_windows

#: (SAM's processor resizes the longest side and pads; read on a square image, that is a squash)
_DET_PROCESSOR = ProcessorDefaults("squash", 1.0, IMAGENET_MEAN, IMAGENET_STD, "bilinear")


class _WindowedGridFamily(HuggingFaceFamily, StagedFamily):
    """What ViTDet and SAM share: one grid, windowed and global layers, read through each layer's own code."""

    capture = CaptureAbilities(view_mode="side")  # side reads the model's own probabilities, or its sdpa call's

    def encoder(self, model: nn.Module) -> nn.Module:
        """The module holding the patch embedding and the layers (``base``)."""
        return self.base(model)

    def layers(self, model: nn.Module) -> Sequence[nn.Module]:
        raise NotImplementedError

    def blocks(self, model: nn.Module) -> list[tuple[int, nn.Module]]:
        return [(0, layer) for layer in self.layers(model)]  # one stage

    def config(self, model: nn.Module) -> Any:
        return self.encoder(model).config

    def patch_conv(self, model: nn.Module) -> nn.Conv2d:
        raise NotImplementedError

    def check_classes(self, model: nn.Module, name: str, layer_cls: str, attn_classes: Sequence[str],
                      attn_attr: str) -> None:
        self.check_model_class(model, name)
        modeling = self.modeling(model)
        if not isinstance(self.patch_conv(model), nn.Conv2d):
            raise UnsupportedModelError(f"{name!r}: its patch embedding is not one convolution; vitlens reads "
                                        f"transformers' {modeling.__name__.rsplit('.', 1)[-1]} as it is written.")
        check_blocks(name, ((f"layer {i}", layer) for i, layer in enumerate(self.layers(model))),
                     getattr(modeling, layer_cls), tuple(getattr(modeling, c) for c in attn_classes), "transformers",
                     attn_attr)

    def image_size(self, model: nn.Module) -> tuple[int, int]:
        return pair(self.config(model).image_size)

    def grid(self, model: nn.Module) -> tuple[int, int]:
        (h, w), (py, px) = self.image_size(model), pair(self.config(model).patch_size)
        return h // py, w // px

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        cfg = self.config(model)
        size = self.image_size(model)
        refuse_other_size(name, self.name, size, input_size)
        return ModelSpec(
            name=name, kind=HIERARCHICAL.name, image_size=size, grid=self.grid(model), stride_px=pair(cfg.patch_size),
            num_prefix_tokens=0, num_layers=len(self.layers(model)), num_heads=max(self.block_heads(model)),
            embed_dim=int(cfg.hidden_size), has_class_token=False,
            # the ignore below: the table does not read the spec here (None: not built yet)
            has_pos_embed=self.position_table(model, None) is not None,  # type: ignore[arg-type]
            num_classes=0, num_params=sum(p.numel() for p in model.parameters()), family=self.name)

    def run_layer(self, layer: nn.Module, numbers: torch.Tensor, recorder: Callable[..., Any]) -> Any:
        """The layer's own ``forward`` on [H, W] token numbers, a recorder for its attention (``windows``)."""
        raise NotImplementedError

    def windows(self, model: nn.Module, input_hw: Sequence[int]) -> list[WindowGeometry]:
        stride = pair(self.config(model).patch_size)
        out = []
        for i, layer in enumerate(self.layers(model)):
            def run(numbers: torch.Tensor, recorder: Callable[..., Any], layer: nn.Module = layer) -> Any:
                return self.run_layer(layer, numbers, recorder)

            out.append(record_windows(run, self.grid(model), 0, stride, f"layer {i} ({type(layer).__name__})"))
        return out

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return attn.proj  # the heads side by side, [B * windows, h, w, heads * head_dim]

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        conv = self.patch_conv(model)
        return conv_filters(conv, module_path(model, conv), "the patch embedding E", spec.name)

    def relative_bias(self, model: nn.Module, spec: ModelSpec) -> None:
        return None

    def no_relative_bias_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return ("its relative-position term is decomposed and depends on the query (q . R_h[dy] + q . R_w[dx], "
                "Li et al. 2022), not a learned bias by offset that could be shown on its own")



class HuggingFaceVitDet(_WindowedGridFamily):
    """transformers ``VitDetModel`` / ``VitDetBackbone``: windowed and global layers on one grid (module docstring)."""

    name = "hf-vitdet"
    summary = "Hugging Face ViTDet"
    reads = ("Hugging Face transformers ViTDet (VitDetModel, VitDetBackbone): windowed layers (padded, no shift) "
             "and global layers on one grid, decomposed relative position; the windowed views as for timm's SAM; "
             "needs transformers")
    names = ("hf:FOLDER of a saved VitDetModel / VitDetBackbone, or the model object",)
    attention_inputs = ("norm1",)
    hf_types = HfTypes(processors={"vitdet": _DET_PROCESSOR})
    model_classes = {"vitdet": ("VitDetModel", "VitDetBackbone")}

    def check(self, model: nn.Module, name: str) -> None:
        self.check_classes(model, name, "VitDetLayer", ("VitDetAttention",), "attention")

    def layers(self, model: nn.Module) -> Sequence[nn.Module]:
        return model.encoder.layer

    def patch_conv(self, model: nn.Module) -> nn.Conv2d:
        return model.embeddings.projection

    def attention_of(self, block: nn.Module) -> nn.Module:
        return block.attention

    def run_layer(self, layer: nn.Module, numbers: torch.Tensor, recorder: Callable[..., Any]) -> Any:
        # the layer's forward as its modeling file writes it (transformers wraps a GradientCheckpointingLayer's
        # forward for checkpointing, unused without gradients); it takes [B, C, H, W]
        forward = inspect.unwrap(type(layer).forward)
        return forward(StandIn(layer, attention=recorder, norm1=identity), numbers[None, None])

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        for layer, attn in enumerate(self.attention_modules(model)):
            # asked for its probabilities, the layer handed what it asked for
            read_returned(attn, layer, capture, handles, lambda out, asked: out if asked else out[:1])

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        self.install_side(model, capture, handles)  # its one (eager) path: the probabilities the output is made from

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        pos = model.embeddings.position_embeddings  # [1, 1 + n, D] at pretrain_image_size, a class token's row first
        if pos is None:
            return None
        n = int(pos.shape[1]) - 1
        side = int(round(n ** 0.5))
        return pos.detach()[:, 1:], (side, side)

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return "this ViTDet was built without an absolute position table (use_absolute_position_embeddings=False)"

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The mean over the grid of the last layer's output (a backbone's last feature map)."""
        out = model(pixel_values=x)
        features = out.feature_maps[-1] if type(model).__name__ == "VitDetBackbone" else out.last_hidden_state
        return features.mean(dim=(-2, -1))


class HuggingFaceSam(_WindowedGridFamily):
    """transformers SAM and SAM-HQ image encoders: windowed and global layers on one grid (module docstring)."""

    name = "hf-sam"
    summary = "Hugging Face SAM / SAM-HQ image encoders"
    reads = ("Hugging Face transformers SAM and SAM-HQ image encoders (SamVisionModel, SamModel's vision_encoder, "
             "SamHQVisionModel, SamHQModel's): windowed layers (padded, no shift) and global layers on one grid, "
             "decomposed relative position, under eager or sdpa; the windowed views as for timm's SAM; needs "
             "transformers")
    names = ("hf:ORG/NAME or hf:FOLDER of a SAM checkpoint, e.g. hf:facebook/sam-vit-base (its vision encoder is "
             "read; the prompt encoder and mask decoder are kept)",)
    attention_inputs = ("layer_norm1",)
    #: (a whole SamModel's type is its vision encoder's: ``towers``)
    hf_types = HfTypes(processors={"sam_vision_model": _DET_PROCESSOR, "sam_hq_vision_model": _DET_PROCESSOR},
                       towers={"sam": "sam_vision_model", "sam_hq": "sam_hq_vision_model"})
    base_attrs = ("vision_encoder",)
    model_classes = {"sam_vision_model": ("SamVisionModel", "SamVisionEncoder", "SamModel"),
                     "sam_hq_vision_model": ("SamHQVisionModel", "SamHQVisionEncoder", "SamHQModel")}

    def _prefix(self, model: nn.Module) -> str:
        return "SamHQ" if (tower_type(model) or "").startswith("sam_hq") else "Sam"

    def check(self, model: nn.Module, name: str) -> None:
        p = self._prefix(model)
        self.check_classes(model, name, f"{p}VisionLayer", (f"{p}VisionAttention", f"{p}VisionSdpaAttention"), "attn")

    def layers(self, model: nn.Module) -> Sequence[nn.Module]:
        return self.encoder(model).layers

    def patch_conv(self, model: nn.Module) -> nn.Conv2d:
        return self.encoder(model).patch_embed.projection

    def heads_of(self, block: nn.Module) -> int:
        return int(block.attn.num_attention_heads)

    def run_layer(self, layer: nn.Module, numbers: torch.Tensor, recorder: Callable[..., Any]) -> Any:
        forward = inspect.unwrap(type(layer).forward)  # [B, H, W, C]; it calls self.attn(hidden_states=...)

        def attn(hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return recorder(hidden_states)

        return forward(StandIn(layer, attn=attn, layer_norm1=identity), numbers[None, :, :, None])

    def _eager_class(self, model: nn.Module) -> type[nn.Module]:
        return getattr(self.modeling(model), f"{self._prefix(model)}VisionAttention")

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        eager = self._eager_class(model)
        for layer, attn in enumerate(self.attention_modules(model)):
            if type(attn) is eager:
                _read_returned_weights(attn, layer, capture, handles)
            else:
                _read_sdpa_call(attn, layer, capture, handles)

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        eager = self._eager_class(model)
        for layer, attn in enumerate(self.attention_modules(model)):
            if type(attn) is not eager:  # the sdpa subclass: its eager parent's forward for the session
                handles.set_attr(attn, "forward", eager.forward.__get__(attn, type(attn)))
            _read_returned_weights(attn, layer, capture, handles)

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        pos = self.encoder(model).pos_embed  # [1, gh, gw, D]
        if pos is None:
            return None
        pos = pos.detach()
        return pos.reshape(1, -1, pos.shape[-1]), (int(pos.shape[1]), int(pos.shape[2]))

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        return "this SAM encoder was built without an absolute position table (use_abs_pos=False)"

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The mean over the grid of the image embedding (the encoder's neck output; a ``SamModel``'s
        ``vision_encoder`` alone, its prompt encoder and mask decoder not run)."""
        return self.encoder(model)(pixel_values=x).last_hidden_state.mean(dim=(-2, -1))


def _read_returned_weights(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """SAM's eager attention returns (output, probabilities [B * windows * heads, N, N]): handed on as
    [B * windows, heads, N, N] (its dropout, off in eval, is applied after; the output is made from these)."""
    heads = int(attn.num_attention_heads)

    def hook(_mod: nn.Module, _args: tuple, out: Any) -> None:
        weights = out[1].reshape(-1, heads, *out[1].shape[-2:])
        capture(layer, weights.detach().float() if capture.detach else weights)

    handles.hook(attn.register_forward_hook(hook))


def _read_sdpa_call(attn: nn.Module, layer: int, capture: CaptureRequest, handles: Handles) -> None:
    """Side capture of ``SamVisionSdpaAttention``: its one SDPA call's softmax(q k^T * scale + mask) from its very
    arguments (the mask: the decomposed relative-position term), [B * windows, heads, N, N]; the real output kept."""
    def after(seen: list[torch.Tensor], _out: Any) -> None:
        if len(seen) != 1:
            raise UnsupportedModelError(
                f"Side capture reads a SAM attention under sdpa as its one scaled_dot_product_attention call; "
                f"{type(attn).__name__} made {len(seen)}: capture with mode='inline' (its eager attention).")
        capture(layer, seen[0])

    read_calls(attn, handles, after)


register(HuggingFaceVitDet())
register(HuggingFaceSam())
