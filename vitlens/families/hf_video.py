"""Hugging Face transformers video transformers (issue 50): ``VideoMAE*`` (tubelets of ``tubelet_size`` frames,
joint space-time attention, no class token, a fixed sinusoidal table), ``Vivit*`` (a Conv3d tubelet embedding, a
class token, joint attention), ``VJEPA2*`` (the encoder only: 3-D RoPE on the queries and keys, joint attention, no
class token) and ``Timesformer*`` (a frame per step, a class token, ``attention_type="divided_space_time"``).

Each is read on preprocessed clips, ``pixel_values`` [B, frames, 3, H, W] at the size it was built for.

- VideoMAE, ViViT and V-JEPA 2 attend through transformers' ``AttentionInterface``: side capture reads sdpa's one
  call from its very arguments (the real output kept, so the outputs are bit for bit those of a run without
  capture) or eager's returned probabilities; inline capture switches the session to transformers' eager
  implementation and hands on the probabilities its output is computed from. Their Conv3d tokens are flattened
  time-major (step, row, col); ViViT's class token stands first. V-JEPA 2's RoPE is applied by the module before
  the attention function, so the queries and keys read are the rotated ones. VideoMAE is read without
  ``bool_masked_pos`` (every tubelet), V-JEPA 2 with ``skip_predictor=True`` (the encoder alone).
- TimeSformer's every block runs its own eager attention twice (``TimesformerSelfAttention``: q k^T x scale,
  softmax, ``attn_drop``): first ``temporal_attention``, each cell over the frames ([B * cells, heads, T, T]; the
  class token takes no part), then ``attention``, each frame over the class token and its cells
  ([B * T, heads, 1 + cells, 1 + cells]; the class token is copied into every frame, and its outputs averaged over
  the frames into the class token's residual). Both are read as they enter ``attn_drop`` -- the model's own
  tensor, so side and inline capture are one and the outputs are untouched. The capture hands over map 2l (block
  l's temporal map) and map 2l + 1 (its spatial map): ``ClipLayout.map_roles`` says so, and the spec's
  ``describe`` too. Its sequence is space-major (cell, frame) behind the class token. ``space_only`` and
  ``joint_space_time`` TimeSformers are refused in one line (not checked against their eager attention here).

transformers is an optional dependency (``pip install 'vitlens[hf]'``).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..core.clip_layout import ClipLayout
from ..core.spec import ModelSpec
from ..errors import UnsupportedModelError, ViewNotAvailableError
from ..kinds import VIDEO
from .base import CaptureAbilities, CaptureRequest, Handles, refuse_other_size, register
from .common.hf import HALF, IMAGENET_MEAN, IMAGENET_STD, HfTypes, HuggingFaceFamily, ProcessorDefaults, tower_type
from .common.interface import read_eager_returned, read_interface_beside
from .common.readers import read_at_dropout
from .common.windows import pair

#: the model types read, with their video processors' per-frame defaults (transformers 5.24), the one source of them
#: (``vitlens.clips.processing`` reads them through ``common.hf.video_processor_defaults``): the shortest edge
#: resized (VideoMAE and TimeSformer to the crop, ViViT and V-JEPA 2 to 256 / 224 of it), a centre crop, bilinear;
#: VideoMAE normalises with 0.5 / 0.5, ViViT rescales by 1 / 127.5 and subtracts 1 before its 0.5 / 0.5 (on [0, 1]
#: pixels: mean 0.75, std 0.25), V-JEPA 2 and TimeSformer with ImageNet's; the attention implementation kept as built
HF_TYPES = HfTypes(processors={
    "videomae": ProcessorDefaults("center", 1.0, HALF, HALF, "bilinear"),
    "vivit": ProcessorDefaults("center", 224 / 256, HALF, HALF, "bilinear", rescale=1 / 127.5, offset=1.0),
    "vjepa2": ProcessorDefaults("center", 224 / 256, IMAGENET_MEAN, IMAGENET_STD, "bilinear"),
    "timesformer": ProcessorDefaults("center", 1.0, IMAGENET_MEAN, IMAGENET_STD, "bilinear")},
    attn_implementation=None, clips=True)
#: the model classes read, by model type (pre-training heads refused: VideoMAE's masks, V-JEPA 2's predictor is
#: skipped in the bare model)
MODEL_CLASSES = {"videomae": ("VideoMAEModel", "VideoMAEForVideoClassification"),
                 "vivit": ("VivitModel", "VivitForVideoClassification"),
                 "vjepa2": ("VJEPA2Model", "VJEPA2ForVideoClassification"),
                 "timesformer": ("TimesformerModel", "TimesformerForVideoClassification")}
#: each type's attention class, as its modeling module names it
ATTENTION_CLASSES = {"videomae": "VideoMAESelfAttention", "vivit": "VivitAttention", "vjepa2": "VJEPA2RopeAttention",
                     "timesformer": "TimesformerSelfAttention"}
#: the types with a learned absolute position table (ViViT's over space-time tokens, TimeSformer's over the cells
#: plus one over the frames); VideoMAE's is a fixed sinusoidal table, V-JEPA 2 rotates q and k (3-D RoPE)
LEARNED_POSITIONS = ("vivit", "timesformer")
#: the keyword each type's forward takes the clip by
PIXELS = {"vjepa2": "pixel_values_videos"}


class HuggingFaceVideo(HuggingFaceFamily):
    """transformers VideoMAE, ViViT, V-JEPA 2 (joint space-time attention) and TimeSformer (divided)."""

    name = "hf-video"
    summary = "Hugging Face video transformers (VideoMAE, ViViT, V-JEPA 2, TimeSformer)"
    reads = ("Hugging Face transformers video models (VideoMAEModel, VivitModel, VJEPA2Model's encoder, "
             "TimesformerModel with divided space-time attention, and their video classifiers): every block's "
             "attention over tokens in space and time; the space-time views on clips [B, frames, 3, H, W]; needs "
             "transformers")
    names = (("hf:ORG/NAME or hf:FOLDER of a VideoMAE, ViViT, V-JEPA 2 or TimeSformer checkpoint, e.g. "
              "hf:MCG-NJU/videomae-base, hf:facebook/timesformer-base-finetuned-k400"),)
    capture = CaptureAbilities(view_mode="side")
    hf_types = HF_TYPES
    model_classes = MODEL_CLASSES
    base_attrs = ("videomae", "vivit", "vjepa2", "timesformer")

    def check(self, model: nn.Module, name: str) -> None:
        self.check_model_class(model, name)
        kind, cfg = tower_type(model), self.base(model).config
        if kind == "timesformer" and cfg.attention_type != "divided_space_time":
            raise UnsupportedModelError(
                f"{name!r} is a TimeSformer with attention_type={cfg.attention_type!r}; vitlens reads "
                "'divided_space_time' (the published checkpoints'), so this one is refused rather than read wrong.")
        cls = getattr(self.modeling(model), ATTENTION_CLASSES[kind or ""])
        for i, attn in enumerate(self.attention_modules(model)):
            if type(attn) is not cls:
                raise UnsupportedModelError(f"{name!r}: attention {i} is a {type(attn).__name__}, not the "
                                            f"{cls.__name__} vitlens reads exactly.")

    def layers(self, model: nn.Module) -> Sequence[nn.Module]:
        base = self.base(model)
        return base.layers if tower_type(model) == "vivit" else base.encoder.layer

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """Every map's attention module, first map first: a joint block's one; a TimeSformer block's temporal, then
        spatial ``TimesformerSelfAttention`` (``ClipLayout.map_roles``)."""
        kind = tower_type(model)
        if kind == "timesformer":
            return [m for layer in self.layers(model) for m in (layer.temporal_attention.attention,
                                                                 layer.attention.attention)]
        if kind == "videomae":
            return [layer.attention.attention for layer in self.layers(model)]
        return [layer.attention for layer in self.layers(model)]

    def clip_layout(self, model: nn.Module) -> ClipLayout:
        """Where each token stands in space and time (``core.clip_layout``), read from the config."""
        kind, cfg = tower_type(model), self.base(model).config
        if kind == "vjepa2":
            size, patch, frames, tubelet = pair(cfg.crop_size), pair(cfg.patch_size), cfg.frames_per_clip, \
                cfg.tubelet_size
        elif kind == "vivit":
            size, frames = pair(cfg.image_size), cfg.num_frames
            tubelet, patch = int(cfg.tubelet_size[0]), (int(cfg.tubelet_size[1]), int(cfg.tubelet_size[2]))
        else:
            size, patch, frames = pair(cfg.image_size), pair(cfg.patch_size), cfg.num_frames
            tubelet = int(getattr(cfg, "tubelet_size", 1)) if kind == "videomae" else 1
        grid = (size[0] // patch[0], size[1] // patch[1])
        prefix = ("class",) if kind in ("vivit", "timesformer") else ()
        divided = kind == "timesformer"
        return ClipLayout(frames=int(frames), tubelet=int(tubelet), grid=grid, stride_px=patch, prefix=prefix,
                          order="space-major" if divided else "time-major", divided=divided)

    def spec(self, model: nn.Module, name: str, input_size: tuple[int, int] | None = None) -> ModelSpec:
        cfg = self.base(model).config
        layout = self.clip_layout(model)
        size = (layout.grid[0] * layout.stride_px[0], layout.grid[1] * layout.stride_px[1])
        built = pair(cfg.crop_size if tower_type(model) == "vjepa2" else cfg.image_size)
        refuse_other_size(name, self.name, built, input_size)
        heads = int(cfg.num_attention_heads)
        return ModelSpec(
            name=name, kind=VIDEO.name, image_size=size, grid=layout.grid, stride_px=layout.stride_px,
            num_prefix_tokens=layout.num_prefix, num_layers=len(self.layers(model)), num_heads=heads,
            embed_dim=int(cfg.hidden_size), has_class_token=bool(layout.prefix),
            has_pos_embed=tower_type(model) in LEARNED_POSITIONS,
            num_classes=self.num_classes(model), num_params=sum(p.numel() for p in model.parameters()),
            family=self.name, prefix_labels=layout.prefix, token_order=layout.describe())

    def num_classes(self, model: nn.Module) -> int:
        return int(model.config.num_labels) if type(model).__name__.endswith("ForVideoClassification") else 0

    def logits(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A classifier's class logits; a bare model's mean token of its last hidden state (V-JEPA 2's encoder
        alone: ``skip_predictor=True``)."""
        kind = tower_type(model)
        kwargs: dict[str, Any] = {PIXELS.get(kind or "", "pixel_values"): x}
        if type(model).__name__.endswith("ForVideoClassification"):
            return model(**kwargs).logits
        if kind == "vjepa2":
            kwargs["skip_predictor"] = True
        return model(**kwargs).last_hidden_state.mean(1)

    def install_side(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        attns = self.attention_modules(model)
        if tower_type(model) == "timesformer":
            for layer, attn in enumerate(attns):
                read_at_dropout(attn.attn_drop, layer, capture, handles)
            return
        for layer, attn in enumerate(attns):
            read_interface_beside(attn, layer, capture, handles, f"a {type(attn).__name__}")

    def install_inline(self, model: nn.Module, capture: CaptureRequest, handles: Handles) -> None:
        if tower_type(model) == "timesformer":  # its own eager path: the same tensor either way
            self.install_side(model, capture, handles)
            return
        read_eager_returned(self.attention_modules(model), capture, handles)

    def head_outputs(self, attn: nn.Module) -> nn.Module | None:
        return None

    def pixel_filters(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, str, str]:
        raise ViewNotAvailableError(f"{spec.name} embeds 3-D tubelets (or frames of a clip); their filters are "
                                    "read by the video weight views, not the image filter view.")

    def position_table(self, model: nn.Module, spec: ModelSpec) -> tuple[torch.Tensor, tuple[int, int]] | None:
        return None

    def no_position_reason(self, model: nn.Module, spec: ModelSpec) -> str:
        kind = tower_type(model)
        what = {"videomae": "a fixed sinusoidal table over its space-time tokens",
                "vjepa2": "3-D rotary embeddings of the queries and keys (no table)"}.get(
                    kind or "", "a learned table over space and time")
        return (f"it is a video model whose position embedding is {what}, which the image position view does not "
                "read as one image's grid")


__all__ = ["HuggingFaceVideo"]

register(HuggingFaceVideo())
